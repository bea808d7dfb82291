"""Decode throughput of TorchEngine vs transformers' ``generate()`` on stories260K or any model directory.

Both generate ``--new`` tokens per sequence from a BOS prompt at temperature 1 (no top-k/top-p truncation, no
stop: ``min_new_tokens`` forces the length in HF) for each batch size, measured side by side in one process
with the same thread count; the figure is generated tokens / wall time (prefill included; best of ``--repeat`` interleaved runs).

Usage: ``.venv/bin/python benchmarks/bench_engine.py [--batches 1 8 32] [--new 128] [--threads 1]
[--model DIR] [--device cuda --dtype bfloat16]`` (a model directory: Llama, Qwen2, Qwen3; default stories260K).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlboost_hpc.models.hf_dir import load_model_dir  # noqa: E402
from rlboost_hpc.models.llama2c import ensure_converted  # noqa: E402
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams  # noqa: E402
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all  # noqa: E402


def engine_runner(cfg, sd, batch: int, new: int, device: str, dtype: torch.dtype = torch.float32):
    """A callable that generates ``batch`` × ``new`` tokens on one TorchEngine and returns the seconds taken."""
    eng = TorchEngine(cfg, sd, max_batch=batch, device=device, dtype=dtype, max_len=new + 8)
    count = [0]

    def run() -> float:
        count[0] += 1
        reqs = [GenRequest(f"{count[0]}-{i}", [1], new,
                           SamplingParams(temperature=1.0, top_p=1.0, seed=i, stop_token_ids=()))
                for i in range(batch)]
        t0 = time.perf_counter()
        out = generate_all(eng, reqs)
        dt = time.perf_counter() - t0
        assert all(len(v[0]) == new for v in out.values())
        return dt

    return run


def hf_runner(hf, batch: int, new: int, device: str):
    """A callable that runs ``hf.generate`` for ``batch`` × ``new`` sampled tokens and returns the seconds taken."""
    ids = torch.ones(batch, 1, dtype=torch.long, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
              max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    def run() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            dt = time.perf_counter() - t0
        assert out.shape == (batch, 1 + new)
        return dt

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per side (best is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", type=Path, help="a model directory (default: stories260K, converted)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.model or ensure_converted(tmp)
        policy = load_model_dir(hf_dir)
        cfg, sd = policy.arch, policy.state_dict
        hf = None
        if not args.no_hf:
            import transformers

            transformers.logging.set_verbosity_error()
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(args.device).eval()
        print(f"{cfg.architecture} ({cfg.num_params() / 1e6:.1f} M parameters, {hf_dir}), {args.new} new "
              f"tokens/sequence, temperature 1, threads={args.threads}, device={args.device}, dtype={args.dtype}, "
              f"torch {torch.__version__}")
        print(f"# fairness: both sides {args.dtype} on {args.device}, {args.threads} torch thread(s), in this one "
              "process; each side's model is loaded once and its load is not timed; the TorchEngine of a batch size "
              "is built once (its KV cache preallocated, the build not timed) and reused by the repeats, as a rollout "
              "engine is; HF generate allocates its KV cache in every call, as generate() does")
        print(f"{'batch':>5} {'TorchEngine tok/s':>18} {'HF generate tok/s':>18} {'ratio':>7}")
        for b in args.batches:
            ours = engine_runner(cfg, sd, b, args.new, args.device, dtype)
            theirs = hf_runner(hf, b, args.new, args.device) if hf is not None else None
            ours()  # warm-up
            if theirs is not None:
                theirs()
            t_ours, t_hf = [], []
            for _ in range(args.repeat):  # interleaved, so background load hits both alike
                t_ours.append(ours())
                if theirs is not None:
                    t_hf.append(theirs())
            a = b * args.new / min(t_ours)
            h = b * args.new / min(t_hf) if t_hf else float("nan")
            print(f"{b:>5} {a:>18,.0f} {h:>18,.0f} {a / h:>6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
