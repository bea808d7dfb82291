"""Wire messages: round trips, schema checks, and fuzzing of the decoder."""
from __future__ import annotations

import random

import pytest

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.errors import ProtocolError

SAMPLES = [
    M.Register(job_id="123", attempt=2, kind="preemptible", max_batch=32, host="h", pid=7, node="n1"),
    M.Heartbeat(version=3, active=1, tokens_generated=99),
    M.WeightsLoaded(version=1, checksum=2**63, nbytes=10, pull_s=0.1, load_s=0.2),
    M.Tokens(rids=["a", "b"], offsets=[0, 4], counts=[2, 1], versions=[1, 1], finish=[0, 1],
             ids=M.pack_i32([5, 6, 7]), logprobs=M.pack_f32([-1.0, -2.0, -3.0])),
    M.Assign(works=[M.Work(rid="r", prompt_ids=[1, 2], prefix_ids=[3], tokens_left=4, temperature=1.0,
                           top_p=0.9, seed=5, stop_ids=[1, 2], version=0)]),
    M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(gid="g", prompt_ids=[1], n=2, max_new_tokens=3,
                                                         temperature=1.0, top_p=1.0, seed=0, stop_ids=[])]),
    M.Released(rids=["x"], tokens_generated=3),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert M.decode(M.encode(msg)) == msg


@pytest.mark.parametrize("ids,lps,counts", [
    (M.pack_i32([1, 2]), M.pack_f32([0.1]), [2]),       # logprobs shorter than ids (case R3)
    (M.pack_i32([1, 2]), M.pack_f32([0.1, 0.2]), [3]),  # counts disagree with payload
    (b"\x00\x00\x00", M.pack_f32([0.1]), [1]),           # truncated int32
])
def test_non_parallel_token_arrays_are_rejected(ids, lps, counts):
    msg = M.Tokens(rids=["a"], offsets=[0], counts=counts, versions=[0], finish=[0], ids=ids, logprobs=lps)
    with pytest.raises(ProtocolError, match="tok:"):
        M.decode(M.encode(msg))


def test_unknown_fields_types_and_tags_are_rejected():
    import msgspec

    enc = msgspec.msgpack.encode
    for bad in [{"t": "hb", "version": 1, "active": 0, "tokens_generated": 0, "extra": 1},
                {"t": "hb", "version": "1", "active": 0, "tokens_generated": 0},
                {"t": "nope"}, {"version": 1}, [1, 2, 3]]:
        with pytest.raises(ProtocolError):
            M.decode(enc(bad))


def test_oversized_frame_is_rejected_before_decoding():
    with pytest.raises(ProtocolError, match="exceeds"):
        M.decode(b"\x00" * (M.MAX_FRAME_BYTES + 1))


@pytest.mark.fuzz
def test_fuzz_decoder_only_raises_protocol_error():
    """≥ 10,000 random, truncated, bit-flipped and spliced frames: decode returns a valid message or raises
    ProtocolError — never anything else."""
    rng = random.Random(1234)
    valid = [M.encode(m) for m in SAMPLES]
    n_ok = 0
    for i in range(12_000):
        kind = i % 4
        if kind == 0:
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        elif kind == 1:
            v = rng.choice(valid)
            frame = v[: rng.randint(0, len(v))]
        elif kind == 2:
            v = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                v[rng.randrange(len(v))] ^= 1 << rng.randrange(8)
            frame = bytes(v)
        else:
            a, b = rng.choice(valid), rng.choice(valid)
            frame = a[: rng.randint(0, len(a))] + b[rng.randint(0, len(b)):]
        try:
            msg = M.decode(frame)
        except ProtocolError:
            continue
        n_ok += 1
        if isinstance(msg, M.Tokens):  # whatever decodes is internally consistent
            assert len(msg.ids) == 4 * sum(msg.counts)
    assert n_ok < 12_000


def test_version_runs_round_trip_and_reject_garbage():
    from rlboost_hpc.protocol.errors import ProtocolError

    for vs in ([], [3], [3, 3, 3], [1, 1, 2, 2, 2, 1]):
        assert M.expand_version_runs(M.version_runs(vs)).tolist() == vs
    assert len(M.version_runs([7] * 1000)) == 8  # one (version, count) pair
    with pytest.raises(ProtocolError, match="whole number of"):
        M.expand_version_runs(M.pack_i32([1, 2, 3]))
    with pytest.raises(ProtocolError, match="negative count"):
        M.expand_version_runs(M.pack_i32([1, -2]))
