"""megatron_bridge in a world of one: HF config parsing, the weight bridge for every TP/PP layout (pure tensor
code, in-process), and the Megatron backend against the torch backend / ``transformers`` (one subprocess
running ``python tests/megatron_scenarios.py single``, so Megatron's global state and the CPU compatibility
layer never touch the pytest process)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.megatron

from megatron_bridge.arch import (  # noqa: E402
    ModelArch,
    UnsupportedArchitecture,
    arch_from_hf,
    check_layout,
    padded_vocab,
    stage_layers,
)
from megatron_bridge.bridge import assemble, hf_shapes, hf_to_megatron, megatron_to_pieces  # noqa: E402

from _util import SCENARIOS  # noqa: E402


def _arch(**kw) -> ModelArch:
    base = dict(family="qwen3", vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, qkv_bias=True, qk_norm=True)
    base.update(kw)
    return ModelArch(**base)


def _random_hf(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_shapes(arch).items()}


# ------------------------------------------------------------------------------------------------ config
def test_families_and_features_are_parsed():
    lc = ModelArch("llama", 512, 64, 172, 5, 8, 4, 8, 512, tie_word_embeddings=True)
    a = arch_from_hf(lc)
    assert (a.family, a.tie_word_embeddings, a.qkv_bias, a.qk_norm, a.head_dim) == ("llama", True, False, False, 8)
    q3 = arch_from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 16,
                       "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 1, "head_dim": 32, "rope_theta": 1e6})
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32 and q3.q_dim == 64
    q2 = arch_from_hf({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "tie_word_embeddings": True})
    assert q2.qkv_bias and not q2.qk_norm and q2.num_key_value_heads == 2


@pytest.mark.parametrize("extra, needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_type='yarn'"),
    ({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}}, "only RoPE scaling Megatron"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_local_experts": 8}, "mixture of experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
])
def test_unsupported_variants_are_refused_by_name(extra, needle):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 2}
    d.update(extra)
    with pytest.raises(UnsupportedArchitecture, match=needle):
        arch_from_hf(d)


def test_parallel_layout_checks_and_uneven_pipeline_split():
    a = _arch()
    with pytest.raises(UnsupportedArchitecture, match="num_key_value_heads=4 is not divisible by tp=3"):
        check_layout(a, 3, 1)
    with pytest.raises(UnsupportedArchitecture, match="smaller than pp=6"):
        check_layout(a, 1, 6)
    assert [list(stage_layers(a, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(a, 3, r)) for r in range(3)] == [[0, 1, 2], [3], [4]]
    assert padded_vocab(a, 2) == 302 and padded_vocab(a, 4) == 304 and padded_vocab(a, 1) == 301


# ------------------------------------------------------------------------------------------------ bridge
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 3), (4, 5)])
@pytest.mark.parametrize("kind", ["qwen3-untied", "qwen2-tied", "llama-tied"])
def test_bridge_round_trip_is_exact_for_every_layout(tp, pp, kind):
    """HF → every rank's Megatron shard → every rank's pieces → assembled HF: bit-exact, nothing missing or
    duplicated, padded vocabulary rows zero and never exported, Megatron shapes as GPTModel expects."""
    fam, tied = kind.split("-")
    a = _arch(family=fam, tie_word_embeddings=tied == "tied", qkv_bias=fam == "qwen2", qk_norm=fam == "qwen3")
    hf = _random_hf(a)
    specs, tensors = [], {}
    for p in range(pp):
        for t in range(tp):
            local = hf_to_megatron(hf, a, tp=tp, tp_rank=t, pp=pp, pp_rank=p)
            nl = len(stage_layers(a, pp, p))
            assert local["decoder.layers.0.self_attention.linear_qkv.weight"].shape == \
                ((a.q_dim + 2 * a.kv_dim) // tp, a.hidden_size)
            assert local["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * a.intermediate_size // tp, 64)
            assert f"decoder.layers.{nl - 1}.input_layernorm.weight" in local
            assert f"decoder.layers.{nl}.input_layernorm.weight" not in local
            if p == 0:
                emb = local["embedding.word_embeddings.weight"]
                assert emb.shape == (padded_vocab(a, tp) // tp, 64)
                if t == tp - 1 and padded_vocab(a, tp) > a.vocab_size:
                    assert emb[-(padded_vocab(a, tp) - a.vocab_size):].abs().sum() == 0
            if p == pp - 1:
                assert ("output_layer.weight" in local) == (not a.tie_word_embeddings or pp > 1)
            for piece in megatron_to_pieces(local, a, tp=tp, tp_rank=t, pp=pp, pp_rank=p):
                assert piece.key not in tensors
                specs.append(piece.spec())
                tensors[piece.key] = piece.tensor.clone()  # pieces are views: detach from `local`
    out = assemble(json.loads(json.dumps(specs)), tensors)
    assert set(out) == set(hf)
    for k in hf:
        assert torch.equal(out[k], hf[k]), k
    # every HF element exported exactly once
    assert sum(t.numel() for t in tensors.values()) == sum(t.numel() for t in hf.values())


def test_pieces_are_views_of_the_live_parameters():
    a = _arch()
    local = hf_to_megatron(_random_hf(a), a, tp=2, tp_rank=1, pp=1, pp_rank=0)
    pieces = megatron_to_pieces(local, a, tp=2, tp_rank=1, pp=1, pp_rank=0)
    by = {p.hf_name: p for p in pieces}
    q = by["model.layers.0.self_attn.q_proj.weight"]
    assert q.tensor.data_ptr() == local["decoder.layers.0.self_attention.linear_qkv.weight"].data_ptr()
    local["decoder.layers.0.self_attention.linear_qkv.weight"].zero_()
    assert q.tensor.abs().sum() == 0  # an optimizer step in place is seen by the next export
    assert (q.start, q.stop) == (a.q_dim // 2, a.q_dim)
    assert "model.norm.weight" not in by  # replicated: exported by TP rank 0 only


def test_assemble_rejects_gaps_and_wrong_sizes():
    spec = {"key": "w@0:0:2", "hf_name": "w", "dim": 0, "start": 0, "stop": 2, "slice_shape": [2, 3],
            "full_shape": [4, 3]}
    with pytest.raises(ValueError, match="cover 2 of 4"):
        assemble([spec], {"w@0:0:2": torch.zeros(2, 3)})
    spec2 = dict(spec, key="w@0:2:4", start=2, stop=4)
    with pytest.raises(ValueError, match="has 5 elements"):
        assemble([spec, spec2], {"w@0:0:2": torch.zeros(2, 3), "w@0:2:4": torch.zeros(5)})


def test_manifest_lists_one_position_per_shard_and_checks_coverage():
    from types import SimpleNamespace

    from megatron_bridge.export import build_manifest, holder_entry, manifest_nbytes, positions

    a = _arch(num_hidden_layers=2)
    hf = _random_hf(a)
    entries = []
    for dp in range(2):
        for t in range(2):
            lay = SimpleNamespace(rank=dp * 2 + t, tp_rank=t, pp_rank=0, dp_rank=dp)
            local = hf_to_megatron(hf, a, tp=2, tp_rank=t, pp=1, pp_rank=0)
            entries.append(holder_entry(lay, f"tcp://h:{t}{dp}", megatron_to_pieces(local, a, tp=2, tp_rank=t, pp=1,
                                                                                     pp_rank=0), torch.bfloat16))
    man = build_manifest(entries, a, {"model_type": "qwen3"}, torch.bfloat16)
    assert json.loads(json.dumps(man)) == man
    assert sorted(positions(man)) == ["tp0-pp0", "tp1-pp0"] and all(len(v) == 2 for v in positions(man).values())
    assert manifest_nbytes(man) == 2 * a.num_params()
    with pytest.raises(ValueError, match="does not cover"):
        build_manifest(entries[:1], a, {}, torch.bfloat16)


def test_launcher_splits_its_options_from_the_program():
    from megatron_bridge.launch import _parser, _resolve_layout, _split, _torchrun_argv

    opts, mod, prog = _split(["--nproc-per-node", "2", "--tp", "2", "-m", "rlboost_hpc.cli", "run", "--tp", "x"])
    assert opts == ["--nproc-per-node", "2", "--tp", "2"] and mod == "rlboost_hpc.cli" and prog == ["run", "--tp", "x"]
    opts, mod, prog = _split(["--spmd", "script.py", "--out", "o"])
    assert opts == ["--spmd"] and mod is None and prog == ["script.py", "--out", "o"]
    a = _parser().parse_args(["--nproc-per-node", "2", "--pp", "2"])
    a.module, a.program = "m", ["x"]
    _resolve_layout(a)  # not an rlboost-hpc run: the flags, else 1
    assert (a.tp, a.pp) == (1, 2)
    argv = _torchrun_argv(a)
    assert "--standalone" in argv and argv[-4:] == ["--seed=1234", "-m", "m", "x"] and "--pp=2" in argv
    a.master_port, a.nnodes = 29555, 2
    assert "--standalone" not in _torchrun_argv(a) and "--master-port=29555" in _torchrun_argv(a)


def test_the_launcher_takes_an_rlboost_runs_layout_from_its_config_and_refuses_contradicting_flags():
    """trainer.megatron is the one home of tp / pp: the launcher reads them from the run's --config / --set; its own
    --tp / --pp may only repeat them; a bad config is the run's ConfigError (the launcher exits 2)."""
    from megatron_bridge.launch import _parser, _resolve_layout, main
    from rlboost_hpc.config import ConfigError

    run = ["run", "--out", "o", "--set", "trainer.backend='megatron'", "--set", "trainer.megatron.tp=2"]
    a = _parser().parse_args(["--nproc-per-node", "2"])
    a.module, a.program = "rlboost_hpc.cli", run
    _resolve_layout(a)
    assert (a.tp, a.pp) == (2, 1)
    a = _parser().parse_args(["--tp", "2", "--pp", "1"])
    a.module, a.program = "rlboost_hpc.cli", run
    _resolve_layout(a)  # the same layout said twice is fine
    a = _parser().parse_args(["--tp", "4"])
    a.module, a.program = "rlboost_hpc.cli", run
    with pytest.raises(ConfigError, match="disagrees with the run's trainer.megatron"):
        _resolve_layout(a)
    env_before = dict(os.environ)
    try:
        assert main(["--nproc-per-node", "2", "-m", "rlboost_hpc.cli", "run", "--set", "trainer.megatron.tp=0"]) == 2
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def test_a_megatron_run_with_tp_above_1_and_no_launcher_is_a_config_error():
    from megatron_bridge import parallel
    from megatron_bridge.backend import from_run_config
    from rlboost_hpc.config import ConfigError, load_config

    cfg = load_config(None, ["trainer.backend='megatron'", "trainer.megatron.tp=2"])
    match = "launched with tp = 1" if parallel.is_initialized() else "needs as many processes"
    with pytest.raises(ConfigError, match=match):
        from_run_config(cfg, None, {})


# ------------------------------------------------------------------------------------------------ backend
@pytest.fixture(scope="module")
def single(repo_root, stories260k_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron") / "single.json"
    env = dict(os.environ, PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, SCENARIOS, "single", "--models",
                        str(stories260k_hf_dir.parent), "--out", str(out)], cwd=repo_root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def check_parity(r: dict, *, logprob_tol: float = 1e-4, weight_tol: float = 1e-4, rl_tol: float = 1e-5) -> None:
    """The assertions shared by every layout: see tests/megatron_scenarios.py for what is measured."""
    assert r["logits_shape_ok"] and r["logits_close"], (r["logits_maxabs"], r["logits_scale"])
    assert r["export_names_ok"] and r["export_maxabs"] == 0.0
    if "shards" in r:
        s = r["shards"]
        assert s["names_ok"] and s["dtype_ok"] and s["maxabs"] == 0.0
        assert s["bytes_total"] == s["bytes_full_bf16"]
        L = r["layout"]
        assert s["holders"] == L["tp"] * L["pp"]
        if s["holders"] > 1:  # each holder publishes only its share
            assert max(x["bytes"] for x in s["per_rank"]) < 0.75 * s["bytes_full_bf16"]
    for row in r["steps"]:
        assert row["tokens_ok"]
        assert row["loss_rel"] <= rl_tol and row["grad_norm_rel"] <= rl_tol, row
        assert row["metrics_rel"] <= 10 * rl_tol and row["step_metrics_ok"], row
    assert r["logprobs_policy_lens_ok"] and r["logprobs_reference_lens_ok"]
    assert r["logprobs_policy_maxabs"] <= logprob_tol and r["logprobs_reference_maxabs"] <= 2e-5
    assert r["weights_after_maxabs"] <= weight_tol
    if r.get("resume") is not None:
        assert r["resume"]["exact"], r["resume"]
        assert r["resume"]["extra"] == {"step": len(r["steps"]) - 1, "data_seed": 1000 + len(r["steps"]) - 1}


@pytest.mark.parametrize("model", ["stories", "qwen3", "qwen2-tied", "llama-untied", "stories-objective"])
def test_tp1_matches_the_reference(single, model):
    """Logits vs transformers (≤1e-5 rel+abs, fp32), export round trip, sharded pull, GRPO losses/metrics/grad
    norms vs TorchBackend (stories260K) or the same step on transformers (Qwen3/Qwen2/Llama), resume; with every
    objective option at once (token_mean, clip-higher, low_var_kl, sequence-level TIS, truncation mask) against
    the torch backend's same options: one loss implementation. (There the sequence-level importance weight
    exp(Σ_t Δ logprob) compounds the backends' per-token logprob difference, ≤ 2e-5, over a response: 1e-4.)"""
    check_parity(single[model], rl_tol=1e-4 if model == "stories-objective" else 1e-5)
    if model == "stories-objective":  # bounded staleness: the mismatch per staleness, equal on both backends
        assert all(row["staleness_metrics"] == ["logprob_diff_staleness0", "logprob_diff_staleness1"]
                   for row in single[model]["steps"])


def check_lora_parity(r: dict) -> None:
    """Issue 49: the Megatron backend's LoRA (TP-sharded A/B) equals PEFT's on the torch backend — the published
    adapter (every holder's share, pulled and assembled), logprobs of the policy and of the reference (the base, adapter
    off), GRPO steps, the adapter after them — and resumes exactly from a checkpoint of the adapter alone."""
    s = r["shards"]
    assert s["names_ok"] and s["maxabs"] <= 1e-2 and s["bytes_total"] == s["adapter_bf16_bytes"], s
    assert s["holders"] == r["layout"]["tp"] * r["layout"]["pp"]
    for row in r["steps"]:
        assert row["loss_rel"] <= 1e-5 and row["grad_norm_rel"] <= 1e-5, row
    assert r["logprobs_policy_maxabs"] <= 1e-4 and r["logprobs_reference_maxabs"] <= 2e-5, r
    assert r["export_names_ok"] and r["weights_after_maxabs"] <= 1e-4, r
    assert r["resume"]["exact"] and r["resume"]["extra"] == {"step": len(r["steps"]) - 1}, r["resume"]


def test_tp1_lora_matches_peft_on_the_torch_backend(single):
    check_lora_parity(single["lora"])


def test_tp1_resume_reproduces_the_next_step_exactly(single):
    r = single["stories"]["resume"]
    assert r["losses"] == r["uninterrupted"] and r["weights_maxabs"] == 0.0


def test_bf16_and_distributed_optimizer_stay_close_and_resume_exactly(single):
    r = single["stories-bf16-distopt"]
    assert r["resume"]["exact"], r["resume"]
    assert r["steps"][0]["grad_norm_rel"] < 0.02 and r["steps"][0]["loss_rel"] < 1e-3
    assert r["logits_maxabs"] < 0.5  # bf16 weights: ~2^-8 relative


def test_options_keep_the_numbers(single):
    o = single["options"]
    assert o["recompute_full"]["rel_to_plain"] == 0.0 and o["recompute_selective"]["rel_to_plain"] == 0.0
    assert o["distributed_optimizer"]["rel_to_plain"] < 1e-6
    assert o["micro_batch_2"]["rel_to_plain"] < 1e-6  # streaming split inside one accumulate call
    assert o["bf16"]["rel_to_plain"] < 0.05 and o["bf16_distopt"]["rel_to_plain"] < 0.05
    assert all(math.isfinite(x) for v in o.values() for x in v["losses"] + v["losses_after_step"])


def test_shard_holders_use_the_runs_curve_keys(single):
    assert single["curve"] == {"pulled_with_keys": True, "refused_without": True}


def test_cpu_compatibility_layer_is_scoped(single):
    c = single["compat"]
    assert c["active"] and not c["cuda_available"]
    assert c["in_scope_device"] == "cpu"
    assert c["in_scope_type_from_project"] == "torch.FloatTensor"  # only Megatron's callers see cuda names
    assert c["out_of_scope_cuda_fails"]  # the project's own torch code is untouched outside the scope
