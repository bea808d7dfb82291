"""Delta versions: a puller holding v−1 receives only what changed, and always ends with the trainer's exact bytes.

Real weight servers and pullers on loopback sockets; updates are random (sparse and dense), in the bf16 wire dtype.
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import DeltaInfo, Manifest, validate_manifest
from rlboost_hpc.rollout.remote_weights import RemoteWeights
from rlboost_hpc.weights import delta as delta_codec
from rlboost_hpc.weights.puller import WeightPuller, WeightTransferError
from rlboost_hpc.weights.server import WeightServer

CHUNK = 1 << 14


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 96, generator=g), "layers.0.w": torch.randn(96, 96, generator=g),
            "layers.1.w": torch.randn(96, 96, generator=g), "norm": torch.ones(96), "pos": torch.arange(64)}


def step(sd: dict[str, torch.Tensor], g: torch.Generator, frac: float, scale: float = 1e-2) -> dict:
    """An RL-like update: a fraction ``frac`` of the float elements move by a small relative amount."""
    out = {}
    for k, v in sd.items():
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < frac
            v = v + mask * scale * v.abs().clamp_min(1e-3) * torch.randn(v.shape, generator=g)
        out[k] = v.clone()
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8)
                                        if a[k].dtype == torch.bfloat16 else a[k], b[k].view(torch.uint8)
                                        if b[k].dtype == torch.bfloat16 else b[k]) for k in a)


def published(server: WeightServer, seed: int, frac: float, **puller_kw):
    """Versions 0 and 1 (a step changing ``frac`` of the elements) on ``server``; version 0 pulled.
    Returns (puller, the pulled version 0)."""
    sd = model()
    server.publish(0, sd)
    p = WeightPuller(server.endpoint, timeout_s=10, **puller_kw)
    held = p.pull(0)
    server.publish(1, step(sd, torch.Generator().manual_seed(seed), frac))
    return p, held


@pytest.fixture
def server():
    with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as s:
        yield s


@settings(max_examples=12, deadline=None)
@given(fracs=st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_delta_chains_are_bit_exact(fracs, seed):
    g = torch.Generator().manual_seed(seed)
    sd = model(seed)
    with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as srv:
        srv.publish(0, sd)
        puller = WeightPuller(srv.endpoint, streams=2, window=2, timeout_s=10)
        held = puller.pull(0)
        for v, frac in enumerate(fracs, start=1):
            sd = step(sd, g, frac)
            srv.publish(v, sd)
            got = puller.pull(v, base=held)
            assert got.checksum == srv.manifest(v).checksum
            assert same_bytes(got.state_dict, srv.local_state_dict(v))
            d = srv.delta_nbytes(v)
            if d is not None:  # the delta was offered: only its bytes moved
                assert got.phases["bytes_received"] == d
                assert got.phases["delta_fallbacks"] == 0
            else:
                assert got.phases["bytes_received"] == got.nbytes
            held = got


def test_sparse_update_moves_a_small_fraction_and_dense_one_goes_full(server):
    g = torch.Generator().manual_seed(1)
    sd = model()
    server.publish(0, sd)
    p = WeightPuller(server.endpoint, streams=2, timeout_s=10)
    held = p.pull(0)
    sd = step(sd, g, 0.001)
    server.publish(1, sd)
    got = p.pull(1, base=held)
    full = got.nbytes
    assert 0 < got.phases["bytes_received"] < full / 20
    assert got.phases["unchanged_chunks"] > 0
    sd = {k: (v * 3 + 1 if v.is_floating_point() else v) for k, v in sd.items()}  # every element changes
    server.publish(2, sd)
    assert server.delta_nbytes(2) is None  # ≥ 0.5× the full bytes: not offered
    got2 = p.pull(2, base=got)
    assert got2.phases["bytes_received"] == full and "delta_chunks" not in got2.phases
    assert same_bytes(got2.state_dict, server.local_state_dict(2))


def test_a_corrupted_base_is_detected_per_chunk_and_fetched_in_full(server):
    p, held = published(server, 2, 0.05, streams=1)
    assert server.delta_nbytes(1) is not None
    held.buffer[:held.nbytes].bitwise_xor_(torch.tensor(0x5A, dtype=torch.uint8))  # memory went bad after verify
    got = p.pull(1, base=held)
    assert got.phases["delta_fallbacks"] > 0
    assert same_bytes(got.state_dict, server.local_state_dict(1))


def test_a_base_byte_gone_bad_in_an_unchanged_chunk_is_detected_and_fetched_in_full(server):
    """Regression: an unchanged chunk was taken from the base on the strength of the base manifest's checksum, so a
    byte of the base that went bad after its pull stayed in the new version, under the right whole checksum."""
    sd = {"a": torch.randn(64, 1024)}  # 8 chunks of CHUNK bytes in bf16
    server.publish(0, sd)
    p = WeightPuller(server.endpoint, streams=1, timeout_s=10)
    held = p.pull(0)
    nxt = {"a": sd["a"].clone()}
    nxt["a"][0, :10] += 1.0  # only chunk 0 changes
    server.publish(1, nxt)
    held.buffer[6 * CHUNK + 100] ^= 0xFF  # the base's bytes of unchanged chunk 6 go bad
    got = p.pull(1, base=held)
    assert got.phases["unchanged_chunks"] == 6 and got.phases["base_mismatches"] == 1
    assert got.phases["full_chunks"] == 1 and got.phases["bytes_received"] < 2 * CHUNK
    assert same_bytes(got.state_dict, server.local_state_dict(1))


def test_a_base_of_another_run_with_the_same_version_number_is_not_used(server):
    with WeightServer(chunk_bytes=CHUNK) as other:
        other.publish(0, model(seed=99))
        foreign = WeightPuller(other.endpoint, timeout_s=10).pull(0)
    g = torch.Generator().manual_seed(3)
    sd = model()
    server.publish(0, sd)
    server.publish(1, step(sd, g, 0.01))
    got = WeightPuller(server.endpoint, timeout_s=10).pull(1, base=foreign)  # says "I hold 0": wrong checksum
    assert "delta_chunks" not in got.phases and got.phases["bytes_received"] == got.nbytes
    assert same_bytes(got.state_dict, server.local_state_dict(1))


def test_a_corrupt_delta_payload_falls_back_to_the_full_chunk(server):
    p, held = published(server, 4, 0.05)
    server._payload_hook = lambda v, i, payload: bytes(payload[: len(payload) // 2]) \
        if isinstance(payload.obj, bytes) else payload  # every delta payload (not the full chunks) is truncated
    got = p.pull(1, base=held)
    assert got.phases["delta_fallbacks"] > 0 and got.phases["delta_chunks"] == 0
    assert same_bytes(got.state_dict, server.local_state_dict(1))


def test_a_base_older_than_the_delta_pulls_full(server):
    g = torch.Generator().manual_seed(5)
    sd = model()
    server.publish(0, sd)
    p = WeightPuller(server.endpoint, timeout_s=10)
    held = p.pull(0)
    for v in (1, 2):
        sd = step(sd, g, 0.01)
        server.publish(v, sd)
    got = p.pull(2, base=held)  # the delta of 2 is against 1
    assert got.phases["bytes_received"] == got.nbytes
    assert same_bytes(got.state_dict, server.local_state_dict(2))


def test_deltas_off_means_full_pulls():
    with WeightServer(chunk_bytes=CHUNK, delta=False) as srv:
        sd = model()
        srv.publish(0, sd)
        p = WeightPuller(srv.endpoint, timeout_s=10)
        held = p.pull(0)
        srv.publish(1, step(sd, torch.Generator().manual_seed(6), 0.01))
        assert srv.delta_nbytes(1) is None
        assert p.pull(1, base=held).phases["bytes_received"] == held.nbytes


def test_version_evicted_during_a_delta_pull_fails_cleanly_and_the_next_pull_is_exact():
    g = torch.Generator().manual_seed(7)
    with WeightServer(chunk_bytes=CHUNK, keep_versions=1) as srv:
        sd = model()
        srv.publish(0, sd)
        weights = RemoteWeights(streams=1, window=1, timeout_s=10)
        weights.pull(srv.endpoint, 0)
        sd = step(sd, g, 0.3)
        srv.publish(1, sd)
        published = threading.Event()

        def hook(v, i, payload):  # a slow puller: version 2 is published while version 1 is in flight
            if not published.is_set():
                published.set()
                srv.publish(2, step(sd, g, 0.3))
            return payload

        srv._payload_hook = hook
        with pytest.raises(WeightTransferError) as e:
            weights.pull(srv.endpoint, 1)
        assert e.value.code == "version_gone"
        srv._payload_hook = None
        assert weights._base is None  # the half-updated base is gone, never used again
        got = weights.pull(srv.endpoint, 2)
        assert got.checksum == srv.manifest(2).checksum
        assert same_bytes(dict(got.state_dict), srv.local_state_dict(2))


def test_remote_weights_keeps_the_base_only_when_asked(server):
    sd = model()
    server.publish(0, sd)
    kept, dropped = RemoteWeights(2, 2, 10.0), RemoteWeights(2, 2, 10.0, keep_base=False)
    kept.pull(server.endpoint, 0)
    dropped.pull(server.endpoint, 0)
    assert kept._base is not None and dropped._base is None
    server.publish(1, step(sd, torch.Generator().manual_seed(8), 0.01))
    assert kept.pull(server.endpoint, 1).wire_bytes == server.delta_nbytes(1)


def test_apply_chunk_refuses_garbage_and_wrong_lengths():
    base = bytearray(b"\x01" * 4096)
    with pytest.raises(delta_codec.DeltaError):
        delta_codec.apply_chunk(memoryview(base), b"not zstd at all")
    longer = delta_codec.encode_chunk(memoryview(b"\x02" * 8192), memoryview(b"\x01" * 8192))
    with pytest.raises(delta_codec.DeltaError):
        delta_codec.apply_chunk(memoryview(base), longer)  # decodes to more than the chunk: capped, refused
    assert bytes(base) == b"\x01" * 4096
    assert delta_codec.encode_chunk(memoryview(b"ab"), memoryview(b"ab")) is None


def test_manifest_with_a_malformed_delta_is_invalid(server):
    server.publish(0, model())
    m = server.manifest(0)
    bad = Manifest(version=1, total_bytes=m.total_bytes, chunk_bytes=m.chunk_bytes, tensors=m.tensors,
                   chunk_checksums=m.chunk_checksums, checksum=m.checksum,
                   delta=DeltaInfo(base_version=0, base_checksum=1, sizes=[0], nbytes=0))
    with pytest.raises(ProtocolError, match="delta lists 1 chunk sizes"):
        validate_manifest(bad)


def test_manager_drains_an_instance_whose_checksum_differs_from_the_trainers():
    core = ManagerCore(clock=lambda: 0.0, settings=ManagerSettings(heartbeat_s=0.25, heartbeat_timeout_s=2.0))
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0, checksum=0xABC))
    core.on_message(b"a", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4, engine="torch"))
    core.on_message(b"b", M.Register(job_id="k", attempt=0, kind="preemptible", max_batch=4, engine="torch"))
    core.outbox.clear()
    core.on_message(b"a", M.WeightsLoaded(version=0, checksum=0xABD, nbytes=8, pull_s=0.1, load_s=0.1, wire_bytes=8))
    core.on_message(b"b", M.WeightsLoaded(version=0, checksum=0xABC, nbytes=8, pull_s=0.1, load_s=0.1, wire_bytes=3))
    assert core.fleet.instances["j#0"].state.value != "ready" and core.fleet.instances["k#0"].state.value == "ready"
    assert any(p == b"a" and isinstance(m, M.Drain) for p, m in core.outbox)
    assert core.counters.weight_checksum_mismatches == 1 and core.counters.weight_pulled_bytes == 11


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=5000), flips=st.lists(st.tuples(st.integers(0, 4999), st.integers(1, 255)),
                                                                  max_size=50))
def test_encode_then_apply_restores_any_chunk(data, flips):
    new = bytearray(data)
    for pos, bits in flips:
        new[pos % len(new)] ^= bits
    payload = delta_codec.encode_chunk(memoryview(bytes(new)), memoryview(data))
    dest = bytearray(data)
    if payload is None:
        assert bytes(new) == data
    else:
        delta_codec.apply_chunk(memoryview(dest), payload)
    assert bytes(dest) == bytes(new)


def test_one_ulp_steps_with_carries_code_to_small_numbers():
    """An Adam step moves a bf16 element by ±1 in its last place; where that carries into the high byte
    (0x00ff -> 0x0100) XOR sets nine bits, the offset difference is 129: every high byte of the payload's planes
    is 0 and the payload is smaller than XOR's (regression: the encoding was XOR, 7-14 % larger on real steps)."""
    import numpy as np
    import zstandard

    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    base[::7] = 0x00FF  # words whose +1 carries into the high byte
    step = np.where(rng.random(base.size) < 0.2, rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), base.size), 0)
    new = (base + step.astype(np.uint16)).astype(np.uint16)
    payload = delta_codec.encode_chunk(memoryview(new.view(np.uint8)), memoryview(base.view(np.uint8)))
    planes = np.frombuffer(zstandard.ZstdDecompressor().decompress(payload), dtype=np.uint8)
    assert not planes[base.size:].any()
    xor = np.bitwise_xor(new, base).view(np.uint8)
    xor_planes = np.concatenate([xor[0::2], xor[1::2]])
    assert len(payload) < len(zstandard.ZstdCompressor(level=1).compress(xor_planes.tobytes()))
    dest = bytearray(base.view(np.uint8).tobytes())
    delta_codec.apply_chunk(memoryview(dest), payload)
    assert bytes(dest) == new.view(np.uint8).tobytes()


def test_each_chunk_is_encoded_as_soon_as_it_is_hashed_and_the_delta_is_the_same(monkeypatch):
    """The publish hands chunk i to the delta encoder right after hashing it (overlapped with the next chunks),
    not after the last one; the delta equals the one encoded after the whole version is written."""
    from rlboost_hpc.models import layout

    events: list[tuple[str, int]] = []
    ready = delta_codec.Encoder.chunk_ready
    monkeypatch.setattr(delta_codec.Encoder, "chunk_ready", lambda self, i: (events.append(("ready", i)),
                                                                             ready(self, i))[1])
    sd = {k: v for k, v in model().items() if v.is_floating_point()}  # one FlatState: floats only
    nxt = step(sd, torch.Generator().manual_seed(3), 0.05)
    deltas = {}
    for overlap in (True, False):
        with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as srv:
            srv.store._delta_overlap = overlap
            hashed = srv.store._hash_chunk
            monkeypatch.setattr(srv.store, "_hash_chunk", lambda view, i, r: (events.append(("hash", i)),
                                                                         hashed(view, i, r))[1])
            srv.publish(0, layout.FlatState.pack(sd, torch.bfloat16))
            events.clear()
            srv.publish(1, layout.FlatState.pack(nxt, torch.bfloat16))
            n = srv.manifest(1).total_bytes // CHUNK + 1
            deltas[overlap] = srv.store._held[1].delta
        assert n > 2 and events.count(("hash", n - 1)) == 1
        first_ready = events.index(("ready", 0))
        if overlap:
            assert first_ready < events.index(("hash", 1))  # chunk 0 encoded while chunk 1 is written
        else:
            assert first_ready > events.index(("hash", n - 1))
    assert deltas[True] is not None and deltas[True] == deltas[False]


def test_the_encoder_encodes_chunks_never_declared_ready_and_stops_cleanly():
    import numpy as np

    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 10_000, dtype=np.uint8)
    new = base.copy()
    new[::97] ^= 1
    with delta_codec.Encoder(memoryview(new), memoryview(base), 1024, 4, 0xAB, threads=2) as enc:
        enc.chunk_ready(3)
        enc.chunk_ready(3)
        d = enc.result()
    assert (d.base_version, d.base_checksum, len(d.sizes), d.full_nbytes) == (4, 0xAB, 10, 10_000)
    dest = bytearray(base.tobytes())
    for i, payload in enumerate(d.payloads):
        assert payload is not None
        delta_codec.apply_chunk(memoryview(dest)[i * 1024:(i + 1) * 1024], payload)
    assert bytes(dest) == new.tobytes()
    with pytest.raises(ValueError, match="differ in length"):
        delta_codec.Encoder(memoryview(new), memoryview(base[:10]), 1024, 0, 0)
    with delta_codec.Encoder(memoryview(new), memoryview(base), 1024, 0, 0) as enc:
        for bad in (10, -1):
            with pytest.raises(IndexError, match="out of range"):
                enc.chunk_ready(bad)
        enc.close()
        with pytest.raises(RuntimeError, match="closed"):
            enc.result()


def test_a_publish_overtaken_by_a_newer_one_is_refused_and_not_counted(monkeypatch):
    """Regression: a publish refused because a newer version was published meanwhile counted a delta publish."""
    sd = model()
    with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as srv:
        srv.publish(0, sd)
        hashed = srv.store._hash_chunk
        raced = []

        def hash_then_race(view, i, ready):
            if not raced:
                raced.append(True)
                t = threading.Thread(target=srv.publish, args=(2, step(sd, torch.Generator().manual_seed(5), 0.01)))
                t.start()
                t.join()
            return hashed(view, i, ready)

        monkeypatch.setattr(srv.store, "_hash_chunk", hash_then_race)
        with pytest.raises(ValueError, match="strictly increase"):
            srv.publish(1, step(sd, torch.Generator().manual_seed(4), 0.01))
        assert srv.versions == [0, 2]
        st = srv.stats
        assert (st["publishes"], st["delta_publishes"]) == (2, 1)


def test_a_delta_that_runs_out_of_memory_leaves_the_version_served_in_full(monkeypatch):
    """A delta only saves bytes: an encoder out of memory must not fail the publish (it did: MemoryError)."""
    sd = model()
    with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as srv:
        srv.publish(0, sd)
        p = WeightPuller(srv.endpoint, timeout_s=10)
        held = p.pull(0)
        monkeypatch.setattr(delta_codec, "encode_chunk", lambda new, base: (_ for _ in ()).throw(MemoryError()))
        nxt = step(sd, torch.Generator().manual_seed(6), 0.01)
        srv.publish(1, nxt)
        assert srv.delta_nbytes(1) is None and srv.stats["delta_failures"] == 1
        got = p.pull(1, base=held)
        assert "delta_chunks" not in got.phases and same_bytes(got.state_dict, srv.local_state_dict(1))
