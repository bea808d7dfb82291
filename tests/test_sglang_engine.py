"""SGLangEngine against a real SGLang 0.5.23 server on CPU (stories260K, head_dim 8, torch_native attention).

One server is shared by the whole session (start-up ≈ 25–45 s on 2 cores); the crash test starts its own.
Needs the CPU route installed: ``scripts/install-sglang-cpu.sh`` (the fixture fails, naming it, otherwise).
Exactness is asserted for greedy decoding only: SGLang's sampled decoding uses its own RNG (per-request seeded
sampling needs ``--enable-deterministic-inference``, which SGLang refuses with the CPU attention backend).
"""
from __future__ import annotations

import importlib.util
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from _util import collect_until
from _util import load_hf_dir
from rlboost_hpc.models.tokenizer import Llama2cTokenizer
from rlboost_hpc.rollout.engines.base import EngineError, GenRequest, SamplingParams, TokenEvent
from rlboost_hpc.rollout.engines.factory import make_sglang_engine
from rlboost_hpc.rollout.engines.sglang_engine import SGLangEngine
from rlboost_hpc.rollout.engines.sglang_server import SGLangServer, free_port
from rlboost_hpc.rollout.engines.sglang_stream import new_entries
from rlboost_hpc.rollout.engines.sglang_weights import init_weight_sender_group
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from sglang_cpu import INSTALL_SCRIPT, stub_env

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0)
NOSTOP = SamplingParams(temperature=0.0, stop_token_ids=())  # long greedy runs: stories260K ends a story with BOS
PROMPTS = [
    "Once upon a time, there was a little",
    "One day, a boy named",
    "Lily and her mom went to the",
    "Tom had a big red",
    "The sun was shining and",
    "Sam wanted to play with his",
]
ATOL = 1e-4  # SGLang (fp32, torch_native) vs our torch engine: observed ≤ 5e-6


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.fail(f"sglang is not installed in this venv; run `{INSTALL_SCRIPT}` first (the CPU route: "
                    f"SGLang 0.5.23 without CUDA packages, see docs/sglang.md)", pytrace=False)


@pytest.fixture(scope="session")
def loaded(stories260k_hf_dir: Path):
    return load_hf_dir(stories260k_hf_dir)


@pytest.fixture(scope="session")
def tok(stories260k_hf_dir: Path) -> Llama2cTokenizer:
    return Llama2cTokenizer.from_file(stories260k_hf_dir / "tok512.bin")


class _Shared:
    """The session's SGLang engine; relaunched if a test killed its server (the crash test runs last)."""

    def __init__(self, loaded, root: Path) -> None:
        self.loaded, self.root, self.eng, self.launches = loaded, root, None, 0

    def get(self) -> SGLangEngine:
        if self.eng is None or not self.eng.server.alive():
            if self.eng is not None:
                self.eng.close()
            cfg, sd = self.loaded
            d = self.root / f"launch{self.launches}"
            self.launches += 1
            self.eng = make_sglang_engine(cfg.to_hf_dict(), sd, 8, work_dir=d / "model", device="cpu",
                                          env=stub_env(), log_path=d / "server.log", startup_timeout_s=240)
        return self.eng


@pytest.fixture(scope="session")
def shared(loaded, tmp_path_factory: pytest.TempPathFactory):
    """One SGLang server + engine for the session, built like the rollout agent builds engines."""
    _require_sglang()
    holder = _Shared(loaded, tmp_path_factory.mktemp("sglang"))
    yield holder
    if holder.eng is not None:
        holder.eng.close()
        assert not holder.eng.server.alive()


@pytest.fixture
def engine(shared: _Shared, loaded):
    """The shared engine, idle and holding the original stories260K weights (restored after a test changed them)."""
    eng = shared.get()
    assert eng.num_active == 0
    yield eng
    if eng.server.alive():
        eng.abort_all()
        if eng.version != 0:
            eng.load_weights(loaded[1], 0)


def _torch(loaded, sd=None, max_batch=8) -> TorchEngine:
    cfg, base = loaded
    return TorchEngine(cfg, base if sd is None else sd, max_batch=max_batch)


def _run(eng, rid, prompt, n, sp=GREEDY, prefix=()):
    return generate_all(eng, [GenRequest(rid, list(prompt), n, sp, list(prefix))])[rid]


def _close(a, b, atol=ATOL):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=0, atol=atol)


def _perturbed(sd: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {k: v * (1 + scale * torch.randn(v.shape, generator=g)) for k, v in sd.items() if k != "lm_head.weight"}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # stories260K is tied
    return out


# ---------------------------------------------------------------------------------------------- parity
def test_greedy_ids_and_logprobs_equal_torch_engine(engine, loaded, tok):
    reqs = [GenRequest(f"p{i}", tok.encode(p), 24 + 8 * i, GREEDY) for i, p in enumerate(PROMPTS)]
    reqs.append(GenRequest("bos", [1], 64, GREEDY))
    ref = generate_all(_torch(loaded), reqs)
    got = generate_all(engine, reqs)
    assert set(got) == set(ref)
    for r in reqs:
        ids, lps, reason = got[r.rid]
        assert ids == ref[r.rid][0], r.rid
        assert reason == ref[r.rid][2] and len(lps) == len(ids) <= r.max_new_tokens
        _close(lps, ref[r.rid][1])
    assert engine.num_active == 0 and engine.step() == []


def test_step_streams_every_token_once(engine, tok):
    """The server streams a response in pieces (counted as they arrive, whatever a consumer's step() merges:
    on a loaded machine one step can take a whole response) and step() returns every token exactly once."""
    chunks0 = engine.chunks_received
    engine.add(GenRequest("s", tok.encode(PROMPTS[0]), 120, NOSTOP))
    seen = []
    while engine.num_active:
        evs = engine.step()
        assert evs, "step() returned nothing while a request was active"
        for e in evs:
            assert len(e.token_ids) == len(e.logprobs) >= 1 or e.finished
            seen += e.token_ids
    assert len(seen) == 120  # nothing duplicated or dropped
    assert engine.chunks_received - chunks0 >= 120 // 16  # streamed: --stream-interval 16
    # cumulative chunks (SGLang 0.5.23 echoes an abort of a queued request with only its last id when incremental)
    assert "--incremental-streaming-output" not in engine.server.base_args


def test_stream_chunks_incremental_cumulative_and_cumulative_running_ahead_of_their_count():
    """Regression: SGLang streams an intermediate cumulative chunk as a reference to its growing lists and
    serialises it later, so a loaded server sent ``completion_tokens=1`` with 3 ids and 3 logprobs — the engine
    called it inconsistent and the worker died with 30 requests in flight. A cumulative chunk running ahead of its
    count is now taken whole, and the next one (whose count is behind what was received) adds only what is new."""
    lp = [[-0.5, t, None] for t in range(10)]
    ids = list(range(10))
    assert new_entries(ids[:3], lp[:3], 1, 0) == (ids[:3], lp[:3])  # ahead of its count: all 3 are real tokens
    assert new_entries(ids[:5], lp[:5], 2, 3) == (ids[3:5], lp[3:5])  # count behind what was received
    assert new_entries(ids[:5], lp[:5], 5, 5) == ([], [])  # nothing new
    assert new_entries(ids[5:8], lp[5:8], 8, 5) == (ids[5:8], lp[5:8])  # incremental
    assert new_entries([], [], 8, 8) == ([], [])  # an empty finishing chunk
    assert new_entries(ids[:4], lp[:4], None, 2) == (ids[2:4], lp[2:4])  # no count: cumulative
    for bad in [(ids[:3], lp[:2], 3, 0),  # ids and logprobs disagree
                (ids[:2], lp[:2], 6, 3),  # fewer entries than received, not the 3 new ones
                (ids[:2], lp[:2], 9, 5)]:  # incremental with the wrong number of entries
        with pytest.raises(EngineError, match="inconsistent chunk"):
            new_entries(*bad)


def test_migration_torch_to_sglang_resumes_exactly(engine, loaded, tok):
    """Start on torch, abort at k, resume on SGLang with prefix ids and the remaining budget (R1)."""
    N = 48
    for pi in (0, 3):
        prompt = tok.encode(PROMPTS[pi])
        full_ids, full_lps, full_reason = _run(_torch(loaded), "u", prompt, N)
        rng = random.Random(pi)
        for k in sorted({1, N - 1, *rng.sample(range(2, N - 1), 3)}):
            head, head_lps, reason = collect_until(_torch(loaded, max_batch=2), GenRequest("m", prompt, N, GREEDY), k)
            assert reason is None and head == full_ids[:len(head)]
            tail, tail_lps, tail_reason = _run(engine, "m", prompt, N - len(head), prefix=head)
            assert len(head) + len(tail) == N  # the original budget, never more
            assert head + tail == full_ids and tail_reason == full_reason, (pi, k)
            _close(head_lps + tail_lps, full_lps)


def test_migration_sglang_to_torch_resumes_exactly(engine, loaded, tok):
    """Start on SGLang, abort mid-way (abort hands back what step() had not), resume on torch. N leaves seconds
    of decoding after the last abort point, so the abort lands mid-response even on a loaded machine (with 200,
    a server that outran its descheduled client once finished two of the four before their abort)."""
    N = 480
    prompt = tok.encode(PROMPTS[1])
    full_ids, full_lps, full_reason = _run(_torch(loaded), "u", prompt, N, NOSTOP)
    migrated = 0
    for k in (1, 9, 33, 120):
        head, head_lps, reason = collect_until(engine, GenRequest(f"m{k}", prompt, N, NOSTOP), k)
        assert head == full_ids[:len(head)] and len(head) >= min(k, len(full_ids))
        _close(head_lps, full_lps[:len(head)])
        if reason is not None:  # the server finished before the abort landed: nothing to migrate
            assert head == full_ids and reason == full_reason
            continue
        migrated += 1
        tail, tail_lps, tail_reason = _run(_torch(loaded), "r", prompt, N - len(head), NOSTOP, prefix=head)
        assert head + tail == full_ids and tail_reason == full_reason
        _close(head_lps + tail_lps, full_lps)
    assert migrated >= 3


def test_migration_chain_sglang_torch_sglang(engine, loaded, tok):
    N = 480
    prompt = tok.encode(PROMPTS[4])
    full_ids, full_lps, _ = _run(_torch(loaded), "u", prompt, N, NOSTOP)
    ids: list[int] = []
    lps: list[float] = []
    for eng, k in ((engine, 7), (_torch(loaded, max_batch=2), 13)):
        got, got_lps, reason = collect_until(eng, GenRequest("c", prompt, N - len(ids), NOSTOP, list(ids)), k)
        assert reason is None
        ids += got
        lps += got_lps
    tail, tail_lps, reason = _run(engine, "c", prompt, N - len(ids), NOSTOP, prefix=ids)
    assert ids + tail == full_ids and reason == "length"
    _close(lps + tail_lps, full_lps)


# ---------------------------------------------------------------------------------------------- abort (R2)
def test_abort_returns_every_token_and_leaves_others_running(engine, loaded, tok):
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    full = {i: _run(_torch(loaded), "u", p, 300)[0] for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        engine.add(GenRequest(f"a{i}", p, 300, GREEDY))
    got: dict[str, list[int]] = {f"a{i}": [] for i in range(3)}
    while len(got["a1"]) < 5:
        for e in engine.step():
            got[e.rid] += e.token_ids
    ev = engine.abort("a1")
    assert ev is None or (isinstance(ev, TokenEvent) and not ev.finished and len(ev.token_ids) == len(ev.logprobs))
    got["a1"] += ev.token_ids if ev else []
    assert engine.abort("a1") is None and engine.abort("nope") is None
    assert engine.num_active == 2
    assert got["a1"] == full[1][:len(got["a1"])] and len(got["a1"]) >= 5  # nothing lost, nothing invented
    done = {}
    while engine.num_active:
        for e in engine.step():
            assert e.rid != "a1"
            got[e.rid] += e.token_ids
            if e.finished:
                done[e.rid] = e.finish_reason
    assert set(done) == {"a0", "a2"}
    assert got["a0"] == full[0] and got["a2"] == full[2]


def test_abort_right_after_add_and_abort_all(engine, tok):
    """Aborting before the server has seen the request (or while it is queued) neither hangs nor leaks."""
    engine.add(GenRequest("q", tok.encode(PROMPTS[0]), 300, GREEDY))
    assert engine.abort("q") is None and engine.num_active == 0  # never submitted: dropped locally
    engine.add(GenRequest("q", tok.encode(PROMPTS[0]), 300, GREEDY))
    engine.streams.submit()  # on the wire now; the server may not have registered the rid yet (abort is re-sent)
    ev = engine.abort("q")
    assert ev is None or len(ev.token_ids) == len(ev.logprobs)
    assert engine.num_active == 0
    for i in range(10):  # more than max_batch=8: some wait in SGLang's queue
        engine.add(GenRequest(f"z{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), 300, GREEDY))
    engine.step()
    evs = engine.abort_all()
    assert engine.num_active == 0 and engine.step() == []
    assert all(len(e.token_ids) == len(e.logprobs) for e in evs)


# ---------------------------------------------------------------------------------------------- weights
def test_load_weights_logprobs_equal_trainer_model(engine, loaded, tok):
    """After loading modified weights the engine's greedy ids and logprobs equal those of the torch engine
    (the trainer's model) with the same weights — also for a prompt already in SGLang's prefix cache (W5)."""
    cfg, base = loaded
    prompt = tok.encode(PROMPTS[5])
    _run(engine, "warm", prompt, 8)  # prompt now in the radix cache under the old weights
    new = _perturbed(base, 1)
    engine.load_weights(new, 1)
    assert engine.version == 1 and engine.fenced is None
    info = engine.control.call("GET", "/model_info", None, what="model_info")
    assert info["weight_version"] == "1"
    reqs = [GenRequest("w0", prompt, 40, GREEDY), GenRequest("w1", tok.encode(PROMPTS[0]), 40, GREEDY)]
    ref = generate_all(_torch(loaded, new), reqs)
    old = generate_all(_torch(loaded), reqs)
    got = generate_all(engine, reqs)
    for r in reqs:
        assert got[r.rid][0] == ref[r.rid][0]
        _close(got[r.rid][1], ref[r.rid][1])
    assert any(got[r.rid][1] != old[r.rid][1] for r in reqs)  # the update took effect
    # and back: a second version change
    engine.load_weights(base, 0)
    again = generate_all(engine, reqs)
    for r in reqs:
        assert again[r.rid][0] == old[r.rid][0]
        _close(again[r.rid][1], old[r.rid][1])


def test_a_pulled_flat_version_loads_as_one_flattened_bucket_with_the_same_result(engine, loaded, tok, monkeypatch):
    """A pulled version is a FlatState: it reaches SGLang as ONE shared-memory segment (``flattened_bucket``, the
    layout's padding skipped by the metadata), and the engine then generates exactly what the torch engine does
    with the same weights; the tensor-by-tensor path is not taken."""
    from rlboost_hpc.rollout.engines import sglang_weights
    from rlboost_hpc.models.layout import FlatState

    cfg, base = loaded
    new = {k: v for k, v in _perturbed(base, 2).items() if k != "lm_head.weight"}
    flat = FlatState.pack({k: v.to(torch.bfloat16) for k, v in new.items()})  # as pulled: bf16 over one buffer
    per_tensor = []
    monkeypatch.setattr(sglang_weights, "serialize_named_tensors",
                        lambda named: per_tensor.append(1) or pytest.fail("sent tensor by tensor"))
    engine.load_weights(flat, 3)
    assert engine.version == 3 and engine.fenced is None and not per_tensor
    bucket = sglang_weights.flat_bucket(flat, engine.server_dtype)
    item = (engine.server_dtype or flat.flat.dtype).itemsize
    assert bucket["flattened_tensor"].numel() == flat.flat.numel() * item  # one segment: every byte, padding too
    meta = bucket["metadata"]
    assert [m.name for m in meta] == flat.table.names and all(m.end_idx - m.start_idx == m.numel for m in meta)
    assert all(m.numel == flat[m.name].numel() * item and tuple(m.shape) == tuple(flat[m.name].shape) for m in meta)
    reqs = [GenRequest("f0", tok.encode(PROMPTS[1]), 40, GREEDY), GenRequest("f1", tok.encode(PROMPTS[2]), 40, GREEDY)]
    ref = generate_all(_torch(loaded, {k: flat[k].float() for k in flat}), reqs)
    got = generate_all(engine, reqs)
    for r in reqs:
        assert got[r.rid][0] == ref[r.rid][0]
        _close(got[r.rid][1], ref[r.rid][1])


def test_a_version_pulled_into_shared_memory_reaches_sglang_without_a_copy(engine, loaded, tok, monkeypatch):
    """A worker running SGLang pulls into shared memory (``receive_buffer_factory``): a version in the server's
    dtype is handed to SGLang as the pulled bytes themselves — no copy into a fresh segment — and generates what
    the torch engine does with those weights; the next pull into the same (base) buffer loads the same way."""
    from rlboost_hpc.rollout.engines import sglang_weights
    from rlboost_hpc.rollout.engines.factory import receive_buffer_factory
    from rlboost_hpc.weights import WeightPuller, WeightServer

    cfg, base = loaded
    factory = receive_buffer_factory({"kind": "sglang"})
    assert factory is sglang_weights.shared_host_buffer
    assert receive_buffer_factory({"kind": "torch", "device": "cpu"}) is None  # a GPU's: pinned (test_weight_layout)
    dtype = engine.server_dtype or torch.float32
    monkeypatch.setattr(sglang_weights, "as_shared", lambda *a: pytest.fail("the pulled version was copied"))
    reqs = [GenRequest("s0", tok.encode(PROMPTS[0]), 30, GREEDY), GenRequest("s1", tok.encode(PROMPTS[4]), 30, GREEDY)]
    got = None
    with WeightServer(chunk_bytes=1 << 16, keep_versions=1) as srv:
        for v, seed in ((6, 5), (7, 6)):
            srv.publish(v, {k: t for k, t in _perturbed(base, seed).items() if k != "lm_head.weight"}, dtype=dtype)
            got = WeightPuller(srv.endpoint, buffer_factory=factory).pull(v, base=got)
            assert got.buffer.is_shared()
            engine.load_weights(got.state_dict, v)
            assert engine.version == v and engine.fenced is None
            ref = generate_all(_torch(loaded, {k: got.state_dict[k].float() for k in got.state_dict}), reqs)
            out = generate_all(engine, reqs)
            for r in reqs:
                assert out[r.rid][0] == ref[r.rid][0]


def test_load_weights_refused_while_active_and_validated(engine, loaded, tok):
    cfg, base = loaded
    prompt = tok.encode(PROMPTS[3])
    full, _, full_reason = _run(_torch(loaded), "u", prompt, 300)
    engine.add(GenRequest("busy", prompt, 300, GREEDY))
    ids, reason = [], None
    ids += [t for e in engine.step() for t in e.token_ids]  # in flight on the server now
    with pytest.raises(EngineError, match="refused: 1 request"):
        engine.load_weights(_perturbed(base, 2), 5)
    # W4: setting the weight version label never aborts in-flight work
    engine.version = 3
    assert engine.control.call("GET", "/model_info", None, what="model_info")["weight_version"] == "3"
    while engine.num_active:
        for e in engine.step():
            ids += e.token_ids
            reason = e.finish_reason if e.finished else reason
    assert ids == full and reason == full_reason
    engine.version = 0
    bad = dict(base)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(EngineError, match="model.norm.weight"):
        engine.load_weights(bad, 6)
    missing = {k: v for k, v in base.items() if "layers.1." not in k}
    with pytest.raises(EngineError, match="missing"):
        engine.load_weights(missing, 6)
    assert engine.version == 0 and engine.fenced is None  # validation failures change nothing
    assert _run(engine, "after", prompt, 300)[0] == full


def test_failed_update_fences_until_a_complete_load(engine, loaded, tok, monkeypatch):
    """W2/W3: a server-side failure in the middle of an update surfaces with its message and fences the engine."""
    cfg, base = loaded
    real = engine.control.call

    def skip_begin(method, path, body, what, timeout=None):
        if path == "/begin_weight_update":  # lose the begin: the server then refuses the load itself
            return {"success": True}
        return real(method, path, body, what, timeout)

    monkeypatch.setattr(engine.control, "call", skip_begin)
    with pytest.raises(EngineError, match="(?s)update_weights_from_tensor.*failed.*begin_weight_update"):
        engine.load_weights(_perturbed(base, 3), 7)
    monkeypatch.undo()
    assert engine.version == -1 and engine.fenced
    with pytest.raises(EngineError, match="fenced"):
        engine.add(GenRequest("x", [1], 4, GREEDY))
    engine.load_weights(base, 0)  # the session left by the failure was closed: a full load works again
    assert engine.version == 0 and engine.fenced is None
    assert _run(engine, "ok", tok.encode(PROMPTS[0]), 16)[0] == _run(_torch(loaded), "t", tok.encode(PROMPTS[0]), 16)[0]


def test_load_weights_from_distributed_gloo(engine, loaded, tok):
    """/init_weights_update_group + /update_weights_from_distributed over a gloo group (this process = holder)."""
    import torch.distributed as dist

    cfg, base = loaded
    new = _perturbed(base, 4)
    port = free_port()
    holder: dict = {}
    engine.weights.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name="t_gloo",
                                            backend="gloo", join=lambda: holder.setdefault(
                                                "g", init_weight_sender_group("127.0.0.1", port, 2, 0, "t_gloo",
                                                                              "gloo")))
    sent = {k: v for k, v in new.items() if k != "lm_head.weight"}

    def send():
        for v in sent.values():
            dist.broadcast(v.contiguous(), src=0, group=holder["g"])

    engine.weights.load_weights_from_distributed([(k, v.dtype, tuple(v.shape)) for k, v in sent.items()], 2, send,
                                                 group_name="t_gloo")
    assert engine.version == 2
    reqs = [GenRequest("d0", tok.encode(PROMPTS[1]), 32, GREEDY)]
    ref = generate_all(_torch(loaded, new), reqs)["d0"]
    got = generate_all(engine, reqs)["d0"]
    assert got[0] == ref[0]
    _close(got[1], ref[1])


def test_prestart_on_dummy_weights_is_fenced_until_the_first_load(loaded, tok, tmp_path):
    """The agent can boot the server while the first version is still being pulled (``state_dict=None`` →
    ``--load-format dummy``); it serves nothing until a complete version is loaded (W3)."""
    _require_sglang()
    cfg, sd = loaded
    eng = make_sglang_engine(cfg.to_hf_dict(), None, 4, work_dir=tmp_path / "m", device="cpu", env=stub_env(),
                             startup_timeout_s=240)
    try:
        assert eng.version == -1 and eng.fenced and not (tmp_path / "m" / "model.safetensors").exists()
        with pytest.raises(EngineError, match="fenced"):
            eng.add(GenRequest("x", [1], 4, GREEDY))
        eng.load_weights(sd, 0)
        assert eng.version == 0 and eng.fenced is None
        prompt = tok.encode(PROMPTS[2])
        got = _run(eng, "a", prompt, 32)
        ref = _run(_torch(loaded), "a", prompt, 32)
        assert got[0] == ref[0]
        _close(got[1], ref[1])
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------- supervision
def test_add_validation(engine):
    with pytest.raises(EngineError, match="empty prompt"):
        engine.add(GenRequest("e", [], 4, GREEDY))
    with pytest.raises(EngineError, match="outside"):
        engine.add(GenRequest("e", [1, 512], 4, GREEDY))
    with pytest.raises(EngineError, match="exceeds max_len"):
        engine.add(GenRequest("e", [1] * 500, 20, GREEDY))
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.add(GenRequest("e", [1], 0, GREEDY))
    engine.add(GenRequest("dup", [1], 50, GREEDY))
    with pytest.raises(EngineError, match="duplicate"):
        engine.add(GenRequest("dup", [1], 50, GREEDY))
    engine.abort("dup")
    assert engine.num_active == 0


def _fake_python(tmp_path: Path, body: str) -> str:
    """A stand-in interpreter for the server command (tests our supervision, not SGLang's CLI)."""
    p = tmp_path / "fake-python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def test_startup_failure_carries_the_log_tail(tmp_path):
    s = SGLangServer(tmp_path, device="cpu", log_path=tmp_path / "bad.log", startup_timeout_s=60,
                     python=_fake_python(tmp_path, 'echo "simulated: CUDA error at model load" >&2; exit 3'))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="(?s)exited with code 3 during start-up.*simulated: CUDA error"):
        s.start()
    assert time.monotonic() - t0 < 10 and not s.alive()


def test_startup_deadline_kills_the_process_group(tmp_path):
    s = SGLangServer(tmp_path, device="cpu", log_path=tmp_path / "slow.log", startup_timeout_s=1.5,
                     python=_fake_python(tmp_path, 'echo "loading forever"; sleep 60 & sleep 60'))
    with pytest.raises(EngineError, match="(?s)not healthy within 2s.*loading forever"):
        s.start()
    assert not s.alive()
    deadline = time.monotonic() + 5
    while _live_group_members(s.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_group_members(s.proc.pid) == []  # the whole process group is gone, children included


def _live_group_members(pgid: int) -> list[int]:
    """Pids of non-zombie processes in process group ``pgid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def test_server_crash_surfaces_as_engine_error_with_log_tail(engine, loaded, tok):
    """Kill the server mid-stream: the next step() raises EngineError naming the death and the log tail.
    Runs last in this module (it kills the shared server; a later test would get a relaunched one)."""
    eng = engine
    eng.add(GenRequest("c", tok.encode(PROMPTS[0]), 400, GREEDY))
    got: list[int] = []
    while len(got) < 3:
        for e in eng.step():
            got += e.token_ids
    os.kill(eng.server.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as ei:
        while True:
            for e in eng.step():
                got += e.token_ids
    msg = str(ei.value)
    assert "died" in msg and str(eng.server.log_path) in msg and "tail" in msg
    assert time.monotonic() - t0 < 30
    with pytest.raises(EngineError, match="died"):
        eng.add(GenRequest("d", [1], 4, GREEDY))
    with pytest.raises(EngineError, match="died"):
        eng.load_weights(loaded[1], 1)
    eng.abort_all()  # returns promptly on a dead server
    assert eng.num_active == 0
