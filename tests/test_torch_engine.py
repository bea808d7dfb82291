"""TorchEngine: the Engine contract on the real stories260K model (greedy reference text, batching, migration,
stop tokens, weight loads, validation) and the counter-based sampler."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from rlboost_hpc import paths
from rlboost_hpc.models.llama import LlamaModel
from _util import collect_until
from _util import load_hf_dir
from rlboost_hpc.models.tokenizer import Llama2cTokenizer
from rlboost_hpc.rollout.engines import torch_engine as te
from rlboost_hpc.rollout.engines.base import EngineError, GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import (
    TorchEngine,
    generate_all,
    sample_tokens,
    uniform,
    uniform_reference,
)

torch.set_num_threads(1)  # tiny model: extra threads only contend on a shared 2-core box

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
PROMPTS = [
    "Once upon a time, there was a little",
    "One day, a boy named",
    "Lily and her mom went to the",
    "Tom had a big red",
    "The sun was shining and",
    "Sam wanted to play with his",
    "A little bird sat on a",
    "Mia found a shiny",
]


@pytest.fixture(scope="module")
def loaded(stories260k_hf_dir: Path):
    return load_hf_dir(stories260k_hf_dir)


@pytest.fixture(scope="module")
def tok(stories260k_hf_dir: Path) -> Llama2cTokenizer:
    return Llama2cTokenizer.from_file(stories260k_hf_dir / "tok512.bin")


@pytest.fixture
def engine(loaded) -> TorchEngine:
    cfg, sd = loaded
    return TorchEngine(cfg, sd, max_batch=8)


def _engine(loaded, **kw) -> TorchEngine:
    cfg, sd = loaded
    return TorchEngine(cfg, sd, **kw)


def _run(eng: TorchEngine, rid: str, prompt: list[int], n: int, sp: SamplingParams, prefix=()):
    return generate_all(eng, [GenRequest(rid, list(prompt), n, sp, list(prefix))])[rid]


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i)


# ---------------------------------------------------------------------------------------------- reference
def test_greedy_200_reproduces_llama2c(engine, tok):
    expected = paths.data_file("stories260K/expected_greedy_200.txt").read_text()
    ids, lps, reason = _run(engine, "g", [1], 200, GREEDY)
    assert reason == "length" and len(ids) == len(lps) == 200
    assert tok.decode([1] + ids) == expected
    assert all(lp <= 0 for lp in lps)


@pytest.mark.parametrize("sp", [GREEDY, SamplingParams(temperature=0.7, top_p=0.8, seed=5),
                                SamplingParams(temperature=1.3, seed=9)])
def test_behaviour_logprobs_equal_teacher_forced_scoring(loaded, engine, tok, sp):
    """The engine's logprobs equal log_softmax(forward(prompt+response)/T) at the sampled tokens."""
    cfg, sd = loaded
    prompt = tok.encode(PROMPTS[0])
    ids, lps, _ = _run(engine, "x", prompt, 60, sp)
    model = LlamaModel.from_state_dict(cfg, sd).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1:-1]
    t = sp.temperature or 1.0
    ref = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- batching
def test_batched_equals_one_at_a_time(loaded, tok):
    reqs = [GenRequest(f"r{i}", tok.encode(p), 48, GREEDY if i % 2 else _seeded(i)) for i, p in enumerate(PROMPTS)]
    batched = generate_all(_engine(loaded, max_batch=8), reqs)
    queued = generate_all(_engine(loaded, max_batch=3), reqs)  # more requests than slots: FIFO queue
    single = _engine(loaded, max_batch=1)
    for r in reqs:
        ids, lps, reason = generate_all(single, [r])[r.rid]
        for other in (batched, queued):
            assert other[r.rid][0] == ids, r.rid
            assert other[r.rid][2] == reason
            torch.testing.assert_close(torch.tensor(other[r.rid][1]), torch.tensor(lps), rtol=0, atol=1e-5)


def test_a_group_sharing_its_prompt_prefills_once_and_equals_one_at_a_time(loaded, tok, monkeypatch):
    """GRPO groups: the responses of one prompt share one prefill (the others copy its keys and values), distinct
    inputs (another prompt, a migrated response's prefix) are prefilled together in one batched pass — and every
    response is what it is alone."""
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[5])
    reqs = [GenRequest(f"a{i}", a, 24, _seeded(i)) for i in range(4)] + \
        [GenRequest(f"b{i}", b, 24, _seeded(10 + i)) for i in range(3)] + \
        [GenRequest("m", a, 20, _seeded(2), [17, 42, 99, 5])]  # a migrated sibling: its prefix makes it distinct
    eng = _engine(loaded, max_batch=8)
    calls: list[list[int]] = []
    real = eng.model.prefill_many
    monkeypatch.setattr(eng.model, "prefill_many", lambda c, s, x, adapter=None: calls.append([len(i) for i in x])
                        or real(c, s, x, adapter=adapter))
    together = generate_all(eng, reqs)
    assert calls == [[len(a), len(b), len(a) + 4]]  # one pass, one row per distinct input
    for r in reqs:
        alone = _run(_engine(loaded, max_batch=1), r.rid, r.prompt_ids, r.max_new_tokens, r.sampling, r.prefix_ids)
        assert together[r.rid][0] == alone[0], r.rid
        torch.testing.assert_close(torch.tensor(together[r.rid][1]), torch.tensor(alone[1]), rtol=0, atol=1e-5)


def test_prefill_many_equals_prefill_of_each(loaded, tok):
    cfg, sd = loaded
    model = LlamaModel.from_state_dict(cfg, sd).eval()
    seqs = [tok.encode(p) for p in PROMPTS[:3]] + [[1]]
    one, many = model.new_cache(4, 64), model.new_cache(6, 64)
    each = torch.stack([model.prefill(one, i, s) for i, s in enumerate(seqs)])
    torch.testing.assert_close(model.prefill_many(many, [5, 1, 3, 0], seqs), each, rtol=1e-5, atol=1e-5)
    for i, s in zip([5, 1, 3, 0], range(4)):
        n = len(seqs[s])
        assert many.length(i) == n
        torch.testing.assert_close(many.k[:, i, :, :n], one.k[:, s, :, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(many.v[:, i, :, :n], one.v[:, s, :, :n], rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        model.prefill_many(many, [1, 1], seqs[:2])


def test_step_events_contract(engine, tok):
    assert engine.step() == [] and engine.num_active == 0
    engine.add(GenRequest("a", tok.encode(PROMPTS[1]), 5, GREEDY))
    assert engine.num_active == 1
    first = engine.step()
    # a request started in this step yields its prefill token and one decode token
    assert [(e.rid, len(e.token_ids), e.finished) for e in first] == [("a", 2, False)]
    engine.add(GenRequest("b", tok.encode(PROMPTS[2]), 1, GREEDY))
    second = {e.rid: e for e in engine.step()}
    assert len(second["a"].token_ids) == 1 and not second["a"].finished
    assert len(second["b"].token_ids) == 1 and second["b"].finished and second["b"].finish_reason == "length"
    assert engine.num_active == 1
    total = 3
    while engine.num_active:
        for e in engine.step():
            assert len(e.token_ids) == len(e.logprobs) == 1
            total += 1
            if e.finished:
                assert e.finish_reason == "length"
    assert total == 5


# ---------------------------------------------------------------------------------------------- migration
@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stop", [(), (1, 2)], ids=["nostop", "stop"])
def test_migration_resume_equals_uninterrupted(loaded, tok, sp, stop):
    sp = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, stop_token_ids=stop)
    N = 64
    for pi, text in enumerate(PROMPTS[:2]):
        prompt = tok.encode(text) if pi else [1]
        full_ids, full_lps, full_reason = _run(_engine(loaded, max_batch=4), "u", prompt, N, sp)
        rng = random.Random(17 + pi)
        ks = sorted({1, len(full_ids) - 1, *rng.sample(range(1, len(full_ids)), 6)})
        for k in ks:
            if k < 1:
                continue
            # (a) stopped by abort after >= k tokens, resumed on a NEW engine
            head, head_lps, reason = collect_until(_engine(loaded, max_batch=4), GenRequest("m", prompt, N, sp), k)
            # (b) exactly k tokens via a smaller budget
            ex_ids, ex_lps, ex_reason = _run(_engine(loaded, max_batch=2), "e", prompt, k, sp)
            assert ex_ids == full_ids[:len(ex_ids)]
            for pre, pre_lps, pre_reason in ((head, head_lps, reason), (ex_ids, ex_lps, ex_reason)):
                if pre_reason == "stop" or len(pre) >= N:
                    assert pre == full_ids and pre_reason == full_reason
                    continue
                tail, tail_lps, tail_reason = _run(_engine(loaded, max_batch=4), "r", prompt, N - len(pre), sp,
                                                   prefix=pre)
                assert len(pre) + len(tail) <= N  # R1: the original budget is never exceeded
                assert len(tail) == len(tail_lps)
                assert pre + tail == full_ids, (k, len(pre))
                assert tail_reason == full_reason
                torch.testing.assert_close(torch.tensor(pre_lps + tail_lps), torch.tensor(full_lps),
                                           rtol=0, atol=1e-5)


def test_migration_chain_of_three_engines_sampled(loaded, tok):
    prompt = tok.encode(PROMPTS[3])
    N = 50
    full = _run(_engine(loaded), "u", prompt, N, SAMPLED)
    got_ids: list[int] = []
    got_lps: list[float] = []
    for k in (7, 19):
        ids, lps, reason = collect_until(_engine(loaded, max_batch=2),
                                          GenRequest("m", prompt, N - len(got_ids), SAMPLED, list(got_ids)), k)
        assert reason is None
        got_ids += ids
        got_lps += lps
    ids, lps, reason = _run(_engine(loaded), "r", prompt, N - len(got_ids), SAMPLED, prefix=got_ids)
    assert got_ids + ids == full[0] and reason == full[2] == "length"
    torch.testing.assert_close(torch.tensor(got_lps + lps), torch.tensor(full[1]), rtol=0, atol=1e-5)


def test_seed_controls_sampling(engine, tok):
    prompt = tok.encode(PROMPTS[4])
    a = _run(engine, "a", prompt, 40, SamplingParams(temperature=1.0, seed=3))
    b = _run(engine, "b", prompt, 40, SamplingParams(temperature=1.0, seed=3))
    c = _run(engine, "c", prompt, 40, SamplingParams(temperature=1.0, seed=4))
    assert a == b
    assert a[0] != c[0]


# ---------------------------------------------------------------------------------------------- stop tokens
def test_stop_tokens(loaded):
    eng = _engine(loaded, max_batch=4)
    out = generate_all(eng, [
        GenRequest("stop12", [1], 511, SamplingParams(temperature=0.0, stop_token_ids=(1, 2))),
        GenRequest("eos_only", [1], 511, SamplingParams(temperature=0.0, stop_token_ids=(2,))),
        GenRequest("short", [1], 30, SamplingParams(temperature=0.0, stop_token_ids=(1, 2))),
    ])
    ids, lps, reason = out["stop12"]
    # the model ends a story with BOS (id 1), never EOS: a stop set with 1 stops, the token is included
    assert reason == "stop" and ids[-1] == 1 and 1 not in ids[:-1] and 2 not in ids
    assert 200 < len(ids) < 511 and len(lps) == len(ids)
    eos_ids, _, eos_reason = out["eos_only"]
    assert eos_reason == "length" and len(eos_ids) == 511 and eos_ids[:len(ids)] == ids
    assert out["short"][2] == "length" and out["short"][0] == ids[:30]


# ---------------------------------------------------------------------------------------------- validation/abort
def test_add_validation(loaded):
    eng = _engine(loaded, max_batch=2, max_len=64)
    eng.add(GenRequest("a", [1], 5, GREEDY))
    with pytest.raises(EngineError, match="'a'.*duplicate"):
        eng.add(GenRequest("a", [1], 5, GREEDY))  # queued
    eng.step()
    with pytest.raises(EngineError, match="duplicate"):
        eng.add(GenRequest("a", [1], 5, GREEDY))  # running
    with pytest.raises(EngineError, match="empty prompt"):
        eng.add(GenRequest("b", [], 5, GREEDY))
    with pytest.raises(EngineError, match="max_new_tokens"):
        eng.add(GenRequest("b", [1], 0, GREEDY))
    with pytest.raises(EngineError, match="= 65 exceeds max_len 64"):
        eng.add(GenRequest("b", [1] * 10, 50, GREEDY, [5] * 5))
    eng.add(GenRequest("fits", [1] * 10, 49, GREEDY, [5] * 5))  # exactly max_len
    with pytest.raises(EngineError, match="outside"):
        eng.add(GenRequest("b", [1, 512], 5, GREEDY))
    with pytest.raises(EngineError, match="non-integer"):
        eng.add(GenRequest("b", [1, 2.5], 5, GREEDY))
    with pytest.raises(EngineError, match="temperature"):
        eng.add(GenRequest("b", [1], 5, SamplingParams(temperature=-1.0)))
    with pytest.raises(EngineError, match="top_p"):
        eng.add(GenRequest("b", [1], 5, SamplingParams(top_p=0.0)))
    assert eng.num_active == 2
    out = generate_all(eng, [])
    assert len(out["fits"][0]) == 49


def test_abort_frees_slot_and_queue(loaded, tok):
    eng = _engine(loaded, max_batch=1)
    eng.add(GenRequest("a", [1], 100, GREEDY))
    eng.add(GenRequest("b", tok.encode(PROMPTS[5]), 10, GREEDY))
    eng.add(GenRequest("c", [1], 10, GREEDY))
    assert {e.rid for e in eng.step()} == {"a"}
    eng.abort("c")  # queued
    eng.abort("nope")  # unknown: no-op
    eng.abort("a")  # running
    assert eng.num_active == 1
    evs = eng.step()
    assert [e.rid for e in evs] == ["b"]
    rest = generate_all(eng, [])
    ref = _run(_engine(loaded), "b", tok.encode(PROMPTS[5]), 10, GREEDY)
    assert evs[0].token_ids + rest["b"][0] == ref[0]  # b ran as if alone
    assert eng.num_active == 0


# ---------------------------------------------------------------------------------------------- weights
def test_load_weights_refused_while_active(loaded):
    cfg, sd = loaded
    eng = _engine(loaded, max_batch=2)
    eng.add(GenRequest("a", [1], 20, GREEDY))
    with pytest.raises(EngineError, match="1 request"):
        eng.load_weights(sd, 1)  # queued counts as active
    eng.step()
    with pytest.raises(EngineError, match="active"):
        eng.load_weights(sd, 1)
    assert eng.version == 0
    eng.abort("a")
    eng.load_weights(sd, 1)
    assert eng.version == 1


def test_load_weights_rejects_bad_tensors_atomically(loaded):
    cfg, sd = loaded
    eng = _engine(loaded, max_batch=2)
    before = _run(eng, "a", [1], 30, GREEDY)
    bad = dict(sd)
    bad["model.layers.2.mlp.down_proj.weight"] = torch.zeros(64, 171)
    bad["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 0  # would change outputs if applied
    with pytest.raises(EngineError, match=r"model\.layers\.2\.mlp\.down_proj\.weight has shape \[64, 171\]"):
        eng.load_weights(bad, 5)
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(EngineError, match="missing.*model.norm.weight"):
        eng.load_weights(missing, 5)
    extra = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(EngineError, match="unexpected.*q_proj.bias"):
        eng.load_weights(extra, 5)
    ints = dict(sd, **{"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(EngineError, match="model.norm.weight has dtype"):
        eng.load_weights(ints, 5)
    untied = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1})
    with pytest.raises(EngineError, match="tied"):
        eng.load_weights(untied, 5)
    assert eng.version == 0
    assert _run(eng, "b", [1], 30, GREEDY) == before
    with pytest.raises(EngineError, match="missing"):
        TorchEngine(cfg, missing)


def test_load_weights_bf16_changes_outputs_version_and_resets_cache(loaded, tok):
    cfg, sd = loaded
    eng = _engine(loaded, max_batch=4)
    prompt = tok.encode(PROMPTS[6])
    before = _run(eng, "a", prompt, 40, SAMPLED)
    bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    bf16.pop("lm_head.weight")  # tied copies may be omitted (as save_pretrained does)
    eng.load_weights(bf16, 3)
    assert eng.version == 3
    assert eng.cache.lengths == [0] * 4
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    after = _run(eng, "b", prompt, 40, SAMPLED)
    fresh = _run(TorchEngine(cfg, bf16, max_batch=4), "c", prompt, 40, SAMPLED)
    assert after == fresh  # the request after the load saw only the new weights
    assert not torch.allclose(torch.tensor(after[1][:5]), torch.tensor(before[1][:5]), atol=1e-4)
    eng.load_weights(sd, 4)
    assert _run(eng, "d", prompt, 40, SAMPLED) == before


# ---------------------------------------------------------------------------------------------- sampler
def test_uniform_matches_reference():
    cases = [(0, 0), (0, 1), (1, 0), (42, 17), (-1, 5), (2**63, 3), (2**70 + 11, 2**33), (123456789, 511)]
    seeds = torch.tensor([te._s64(s) for s, _ in cases])
    ks = torch.tensor([k for _, k in cases])
    got = uniform(seeds, ks).tolist()
    assert got == [uniform_reference(s, k) for s, k in cases]
    many = uniform(torch.zeros(10000, dtype=torch.long), torch.arange(10000))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01


def _reference_inverse_cdf(p: list[float], top_p: float, u: float) -> int:
    order = sorted(range(len(p)), key=lambda i: -p[i])  # stable
    kept, acc = [], 0.0
    for i in order:
        if top_p < 1.0 and acc >= top_p:
            break
        kept.append(i)
        acc += p[i]
    target = u * (sum(p) if top_p >= 1.0 else acc)
    c = 0.0
    for i in kept:
        c += p[i]
        if c > target:
            return i
    return kept[-1]


def test_inverse_cdf_fast_path_equals_reference(monkeypatch):
    g = torch.Generator().manual_seed(0)
    R, V = 300, 512
    logits = torch.randn(R, V, generator=g) * torch.linspace(0.3, 6, R)[:, None]
    probs = torch.softmax(logits.double(), -1)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99, 0.2][i % 5] for i in range(R)], dtype=torch.float64)
    u = torch.rand(R, generator=g, dtype=torch.float64)
    fast = te._inverse_cdf_top_p(probs, top_p, u)
    monkeypatch.setattr(te, "_FAST_K", V)
    slow = te._inverse_cdf_top_p(probs, top_p, u)
    assert torch.equal(fast, slow)
    ref = [_reference_inverse_cdf(probs[i].tolist(), top_p[i].item(), u[i].item()) for i in range(R)]
    assert fast.tolist() == ref


def test_sampler_distribution_and_nucleus():
    g = torch.Generator().manual_seed(1)
    V, n = 512, 20000
    row = torch.randn(V, generator=g) * 2.5
    logits = row.expand(n, V).contiguous()
    for temp, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        toks, lps = sample_tokens(logits, [temp] * n, [top_p] * n, [7] * n, list(range(n)))
        probs = torch.softmax(row.double() / temp, -1)
        sp, si = probs.sort(descending=True, stable=True)
        keep = (sp.cumsum(0) - sp) < top_p if top_p < 1 else torch.ones(V, dtype=torch.bool)
        target = torch.zeros(V, dtype=torch.float64)
        target[si[keep]] = sp[keep] / sp[keep].sum()
        freq = torch.bincount(torch.tensor(toks), minlength=V).double() / n
        assert 0.5 * (freq - target).abs().sum().item() < 0.04, (temp, top_p)
        assert freq[target == 0].sum().item() == 0  # never outside the nucleus
        logp = torch.log_softmax(row / temp, -1)
        assert torch.allclose(torch.tensor(lps), logp[torch.tensor(toks)], atol=1e-6)
    toks, lps = sample_tokens(row[None], [0.0], [0.5], [0], [0])
    assert toks == [int(row.argmax())] and math.isclose(lps[0], torch.log_softmax(row, -1).max().item(),
                                                        abs_tol=1e-6)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, seed=0)],
                         ids=["greedy", "sampled"])
def test_migration_across_a_stop(loaded, sp):
    """The uninterrupted story ends with a stop token; a resumed one stops at the same place."""
    N = 400
    full_ids, full_lps, reason = _run(_engine(loaded), "u", [1], N, sp)
    assert reason == "stop" and full_ids[-1] == 1
    for k in (3, len(full_ids) // 2, len(full_ids) - 1):
        pre, pre_lps, _ = _run(_engine(loaded), "p", [1], k, sp)
        tail, tail_lps, tail_reason = _run(_engine(loaded), "r", [1], N - k, sp, prefix=pre)
        assert pre + tail == full_ids and tail_reason == "stop"
        torch.testing.assert_close(torch.tensor(pre_lps + tail_lps), torch.tensor(full_lps), rtol=0, atol=1e-5)


def test_engine_factory_from_the_runs_spec(tmp_path, loaded):
    """endpoints.json's engine spec picks the worker's engine; unknown kinds/options are clear errors."""
    from rlboost_hpc.config import RolloutCfg
    from rlboost_hpc.rollout.engines.base import EngineError
    from rlboost_hpc.rollout.engines.factory import engine_spec, factory_from_spec, torch_engine_factory

    assert engine_spec(RolloutCfg()) == {"kind": "torch", "device": "auto", "dtype": "auto"}
    spec = engine_spec(RolloutCfg(engine="sglang", device="cpu", sglang={"env": {"A": "1"}}))
    assert spec["kind"] == "sglang" and spec["device"] == "cpu" and spec["sglang"]["env"] == {"A": "1"}
    assert factory_from_spec(None, 4).__qualname__ == torch_engine_factory(4).__qualname__
    assert callable(factory_from_spec(spec, 4, log_path=tmp_path / "s.log"))  # builds nothing until called
    with pytest.raises(EngineError, match="unknown rollout engine 'vllm'"):
        factory_from_spec({"kind": "vllm"}, 4)
    with pytest.raises(EngineError, match=r"unknown sglang engine option\(s\) \['gpus'\]"):
        factory_from_spec({"kind": "sglang", "sglang": {"gpus": 2}}, 4)
    # the engine is built where it runs: a device that is not there is an EngineError naming the setting
    sd = {k: v for k, v in loaded[1].items()}
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="rollout.device = 'cuda'"):
            torch_engine_factory(4, "cuda")(loaded[0].to_hf_dict(), sd)
    eng = torch_engine_factory(4, "cpu", "float32")(loaded[0].to_hf_dict(), sd)
    assert eng.device.type == "cpu" and eng.dtype == torch.float32
    # with the trainer's parsed architecture (Welcome.model_arch) the worker never re-reads config.json
    eng = torch_engine_factory(4, "cpu")({}, sd, arch=loaded[0])
    assert eng.config == loaded[0]


def test_a_flat_version_loads_with_one_copy_into_flat_weights_and_other_layouts_take_the_checked_path(loaded, tok):
    """A pulled single-dtype version is a FlatState: the engine moves its parameters into one flat tensor of the same
    layout on the first such load, then loads each version with one copy; a FlatState of another layout (an extra
    tensor) goes through the per-tensor checks and is refused with the same error as a dict."""
    from rlboost_hpc.models.layout import FlatState

    cfg, sd = loaded
    prompt = tok.encode(PROMPTS[6])
    bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items() if k != "lm_head.weight"}  # tied head: the embedding
    reference = _run(TorchEngine(cfg, bf16, max_batch=4), "r", prompt, 40, SAMPLED)
    eng = _engine(loaded, max_batch=4)
    eng.load_weights(FlatState.pack(bf16), 1)
    flat = eng._flat
    assert flat is not None and len(flat) == len(bf16)
    lo, hi = flat.flat.data_ptr(), flat.flat.data_ptr() + flat.flat.numel() * flat.flat.element_size()
    assert all(lo <= p.data_ptr() < hi for p in eng.model.parameters())  # the weights live in the flat tensor
    assert _run(eng, "a", prompt, 40, SAMPLED) == reference
    eng.load_weights(FlatState.pack({k: v * 0 for k, v in bf16.items()}), 2)
    assert all(not p.any() for p in eng.model.parameters())  # one copy reached every parameter, the head too
    assert eng._flat is flat and eng.version == 2
    eng.load_weights(FlatState.pack(bf16), 3)
    assert _run(eng, "b", prompt, 40, SAMPLED) == reference
    bias = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64, dtype=torch.bfloat16)}
    extra = FlatState.pack(dict(bf16, **bias))
    with pytest.raises(EngineError, match="unexpected.*q_proj.bias"):
        eng.load_weights(extra, 4)
    assert eng.version == 3 and _run(eng, "c", prompt, 40, SAMPLED) == reference
    eng.load_weights(sd, 5)  # a dict still loads tensor by tensor, into the flat weights
    assert all(lo <= p.data_ptr() < hi for p in eng.model.parameters())
