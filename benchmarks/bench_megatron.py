"""Benchmark: the Megatron-core trainer backend — RL step time, MFU, backend ratio, weight export per rank.

Measures, on one model and one fixed batch of GRPO samples (``--responses`` per micro-batch ×
``--micro-batches`` per RL step, prompts of ``--prompt-len`` and responses of ``--response-len`` tokens, no
padding), after ``--warmup`` steps, the median over ``--steps`` RL steps of:

Steps are interleaved between the two backends of the ratio pair, so load from other processes hits both.

1. **Megatron step** — ``accumulate`` of every micro-batch (1F1B schedule, vocab-parallel logprobs, GRPO loss)
   + ``optimizer_step`` (finalize grads, clip, Adam) — tokens/s, model TFLOP/s and MFU (model FLOPs =
   3 × forward: 2·params_matmul + 2·hidden·vocab per token, causal attention 2·seq·q_dim per token and layer;
   recompute not counted; ``--peak-tflops`` or the GPU's dense bf16 peak);
2. **torch/Megatron ratio** — the project's ``TorchBackend`` on the same Llama-shaped model (fp32) and the same
   batch vs ``MegatronBackend`` fp32 (the torch backend implements Llama only; for a Qwen3 primary model the
   ratio pair is a Llama model of the same hidden/intermediate/layers/vocab);
3. **weight export** — ``publish_shards`` (each rank publishes its own bf16 pieces into its own
   ``WeightServer``): seconds and bytes per rank vs the full bf16 model; and the single-holder path the run uses
   today (``WeightServer.publish(export_weights())``).

Presets: ``tiny`` (CPU default: Llama-shaped, hidden 256, 4 layers, vocab 2048, 2 × 8 responses × 128 tokens)
and ``qwen3-0.6b`` (GPU default: Qwen3-0.6B dimensions, random weights, bf16, 4 × 16 responses × 1024 tokens).

Run::

    .venv/bin/python benchmarks/bench_megatron.py                          # CPU, tiny, world of one
    python -m megatron_bridge.launch --nproc-per-node 2 --tp 2 benchmarks/bench_megatron.py   # TP=2
    python benchmarks/bench_megatron.py --preset qwen3-0.6b --json out.json                    # one GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bridge.arch import ModelArch, arch_from_hf  # noqa: E402
from rlboost_hpc.trainer.backends.base import Sample  # noqa: E402

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
             "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
PRESETS = {
    "tiny": dict(model={"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
                        "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
                        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True},
                 responses=8, micro_batches=2, prompt_len=64, response_len=64, bf16=False),
    "qwen3-0.6b": dict(model=QWEN3_06B, responses=16, micro_batches=4, prompt_len=256, response_len=768, bf16=True),
}
# Dense bf16 peak TFLOP/s by GPU name fragment (datasheet values, no sparsity).
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def llama_twin(model: dict) -> dict:
    """A Llama-shaped config with the model's hidden/intermediate/layers/heads/vocab (head_dim = hidden/heads),
    which the torch backend can run."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model["vocab_size"],
            "hidden_size": model["hidden_size"], "intermediate_size": model["intermediate_size"],
            "num_hidden_layers": model["num_hidden_layers"], "num_attention_heads": model["num_attention_heads"],
            "num_key_value_heads": model["num_key_value_heads"],
            "max_position_embeddings": model["max_position_embeddings"], "rms_norm_eps": model["rms_norm_eps"],
            "rope_theta": model["rope_theta"], "tie_word_embeddings": model["tie_word_embeddings"]}


def samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                   response_ids=torch.randint(0, vocab, (response_len,), generator=g).tolist(),
                   behaviour_logprobs=[-1.0] * response_len, advantage=float(torch.randn(1, generator=g)))
            for _ in range(n)]


def step_flops(arch: ModelArch, seqs: int, seq_len: int) -> float:
    """Model FLOPs of one training pass (forward + backward = 3 × forward) over ``seqs`` sequences."""
    D, F, V, L = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.num_hidden_layers
    mm = L * (D * (arch.q_dim + 2 * arch.kv_dim) + arch.q_dim * D + 3 * D * F)
    per_token = 2 * mm + 2 * D * V + L * 2 * seq_len * arch.q_dim  # causal attention: half of 4·S·q_dim
    return 3.0 * per_token * seq_len * seqs


def time_steps(backend, batches: list[list[Sample]], responses_in_step: int, warmup: int, steps: int) -> list[float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        for b in batches:
            backend.accumulate(b, responses_in_step)
        backend.optimizer_step()
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def random_hf_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    from rlboost_hpc.models.arch import arch_from_hf as read_arch
    from rlboost_hpc.models.llama import LlamaModel

    torch.manual_seed(seed)
    m = LlamaModel(read_arch(cfg))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b" if gpu else "tiny")
    p.add_argument("--responses", type=int, help="responses per micro-batch (m_b)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per RL step")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--response-len", type=int)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--recompute", choices=["full", "selective"], default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch-backend ratio")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: known GPU's bf16)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    pre = dict(PRESETS[a.preset])
    for k in ("responses", "micro_batches", "prompt_len", "response_len", "bf16"):
        if getattr(a, k) is not None:
            pre[k] = getattr(a, k)
    torch.set_num_threads(a.threads)

    from megatron_bridge.backend import MegatronBackend
    from rlboost_hpc.weights.server import WeightServer

    model = pre["model"]
    arch = arch_from_hf(model)
    n, mbn, P, R = pre["responses"], pre["micro_batches"], pre["prompt_len"], pre["response_len"]
    batches = [samples(n, P, R, arch.vocab_size, seed=i) for i in range(mbn)]
    seqs, S = n * mbn, P + R
    dev = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores, {a.threads} torch threads)"
    res: dict = {"preset": a.preset, "device": dev, "model": {k: model[k] for k in model if k != "architectures"},
                 "params": arch.num_params(), "batch": {"responses": seqs, "micro_batches": mbn, "seq_len": S},
                 "bf16": pre["bf16"], "distributed_optimizer": a.distributed_optimizer, "recompute": a.recompute}
    kw = dict(lr=1e-5, kl_coef=0.0, temperature=1.0)

    # 1. Megatron step on the primary model (+ MFU) and sharded export
    t0 = time.perf_counter()
    weights = None if arch.family != "llama" else random_hf_state(model, 0)
    mb = MegatronBackend(model, weights, bf16=pre["bf16"], distributed_optimizer=a.distributed_optimizer,
                         recompute=a.recompute, shard_export=True, **kw)
    res["build_s"] = time.perf_counter() - t0
    L = mb.layout
    res["layout"] = {"tp": L.tp, "pp": L.pp, "dp": L.dp}
    ts = time_steps(mb, batches, seqs, a.warmup, a.steps)
    med = statistics.median(ts)
    flops = step_flops(arch, seqs, S)
    peak = a.peak_tflops or next((v for k, v in PEAKS.items() if gpu and k in dev), None)
    res["megatron"] = {"step_s": med, "steps_s": ts, "tokens_per_s": seqs * S / med,
                       "model_tflops_per_s": flops / med / 1e12, "gpus": L.world,
                       "mfu": (flops / med / 1e12) / (peak * L.world) if peak else None, "peak_tflops": peak}
    full_bytes = 2 * arch.num_params()
    pubs = []
    for v in range(3):
        pubs.append(mb.publish_shards(v + 1))
    last = pubs[-1]
    res["export"] = {"full_model_bf16_bytes": full_bytes,
                     "publish_shards_s": statistics.median(x["publish_s"] for x in pubs),
                     "per_rank": last["per_rank"],
                     "max_rank_fraction_of_full": max(r["bytes"] for r in last["per_rank"]) / full_bytes}
    with WeightServer(copy_threads=1) as server:  # the single-holder path run.py uses today
        sp = []
        for v in range(3):
            t = time.perf_counter()
            server.publish(v, mb.export_weights(), dtype=torch.bfloat16)
            sp.append(time.perf_counter() - t)
        res["export"]["single_holder_export_and_publish_s"] = statistics.median(sp)
    mb.close()
    del mb

    # 2. torch backend vs Megatron (fp32) on the same Llama-shaped model and batch
    if not a.no_torch:
        from rlboost_hpc.models.arch import arch_from_hf as read_arch
        from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

        twin = model if arch.family == "llama" else llama_twin(model)
        sd = random_hf_state(twin, 1)
        lc = read_arch(twin)
        if gpu:
            res["ratio"] = {"skipped": "measured on CPU with the tiny preset (fp32 on both sides)"}
        else:
            tb = TorchBackend(lc, sd, **kw)
            m2 = MegatronBackend(twin, sd, **kw)
            tt, tm = [], []
            for _ in range(a.warmup + a.steps):  # interleaved, so machine noise hits both alike
                tt += time_steps(tb, batches, seqs, 0, 1)
                tm += time_steps(m2, batches, seqs, 0, 1)
            t_torch, t_meg = statistics.median(tt[a.warmup:]), statistics.median(tm[a.warmup:])
            m2.close()
            del tb
            res["ratio"] = {"model": "llama twin" if twin is not model else "same", "torch_step_s": t_torch,
                            "megatron_fp32_step_s": t_meg, "megatron_over_torch": t_meg / t_torch}

    # report
    m = res["megatron"]
    print(f"device: {dev}   model: {a.preset} ({arch.num_params() / 1e6:.1f} M params, {arch.family})   "
          f"layout tp={L.tp} pp={L.pp} dp={L.dp}   bf16={pre['bf16']}")
    print(f"batch: {seqs} responses × {S} tokens in {mbn} micro-batches")
    mfu = "n/a (no peak known for this device)" if m["mfu"] is None else f"{m['mfu']:.1%}"
    print(f"megatron RL step: {m['step_s'] * 1e3:.1f} ms median  ({m['tokens_per_s']:.0f} tokens/s, "
          f"{m['model_tflops_per_s']:.3f} model TFLOP/s, MFU {mfu})")
    if "ratio" in res and "megatron_over_torch" in res["ratio"]:
        r = res["ratio"]
        print(f"torch backend step {r['torch_step_s'] * 1e3:.1f} ms vs megatron fp32 {r['megatron_fp32_step_s'] * 1e3:.1f} ms"
              f"  → megatron/torch = {r['megatron_over_torch']:.2f}  ({r['model']} model, same batch)")
    elif "ratio" in res:
        print(f"torch ratio: {res['ratio']['skipped']}")
    e = res["export"]
    print(f"weight export: full model bf16 {e['full_model_bf16_bytes'] / 1e6:.2f} MB; publish_shards "
          f"{e['publish_shards_s'] * 1e3:.2f} ms (slowest rank); single-holder export+publish "
          f"{e['single_holder_export_and_publish_s'] * 1e3:.2f} ms")
    for r in e["per_rank"]:
        print(f"  rank {r['rank']}: {r['bytes'] / 1e6:.3f} MB ({r['bytes'] / e['full_model_bf16_bytes']:.1%} of full) "
              f"in {r['seconds'] * 1e3:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
