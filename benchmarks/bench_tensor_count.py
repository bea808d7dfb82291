"""Benchmark: does a weight version's cost depend on its tensor count at equal bytes?

For each size, two state dicts of the same bytes: one fp32 tensor, and ``--tensors`` small 2-D fp32 tensors
(an MoE layer list looks like this: Qwen3-30B-A3B has ~18,000 expert tensors). Each is published as bf16
(``WeightServer.publish``: plan + cast-copy + chunk checksums), pulled over loopback TCP (``WeightPuller.pull``:
manifest + transfer + verification) into a fresh buffer and, as a rollout instance does, into the buffer of the
version it held before (``pull(base=...)``; deltas off, so every byte moves), then loaded into an engine's bf16
weights. Two ways, side by side in one run:

- ``flat`` (what the run does): the trainer's weights live in a ``FlatState`` (the torch backend's parameters),
  so publish is one cast-copy; the engine's weights live in one laid out alike (the torch rollout engine after
  its first load), so the load is one copy of the pulled ``FlatState``.
- ``per-tensor`` (a backend or engine whose tensors are separate, e.g. an HF module): the publish plans and
  copies tensor by tensor (one ``torch._foreach_copy_``), the load is ``layout.copy_tensors`` into the engine's
  own tensors; ablation of that load: ``torch.nn.Module.load_state_dict``.

Reps interleaved; medians; ratios are many-tensors ÷ one-tensor at equal bytes (1.0 = independent of tensor
count; the goal is ≤ 1.2× for publish + pull into the base's buffer + load).

Run: ``.venv/bin/python benchmarks/bench_tensor_count.py [--sizes-mib 4 40] [--tensors 10000] [--reps 5]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.weights import WeightPuller, WeightServer  # noqa: E402
from rlboost_hpc.models.layout import FlatState, copy_tensors  # noqa: E402


def state(n: int, total_bytes_bf16: int) -> dict[str, torch.Tensor]:
    """``n`` fp32 tensors of shape (4, k) whose bf16 cast totals ``total_bytes_bf16`` bytes (one tensor: 1-D)."""
    elems = total_bytes_bf16 // 2
    if n == 1:
        return {"t00000": torch.randn(elems)}
    k = max(1, elems // n // 4)
    return {f"t{i:05d}": torch.randn(4, k) for i in range(n)}


def measure(sd: dict[str, torch.Tensor], reps: int, flat: bool) -> dict[str, float]:
    """Median seconds of publish, pull (and its phases), pull into the base's buffer, load and (per-tensor only)
    load_state_dict. ``flat``: publish from a FlatState and load into one (else tensor by tensor)."""
    names = sorted(sd)
    source = FlatState.pack(sd) if flat else sd
    dst = [torch.empty(sd[k].shape, dtype=torch.bfloat16) for k in names]
    engine = FlatState.pack(dict(zip(names, dst))) if flat else None
    module = torch.nn.Module()
    for k, t in zip(names, dst):
        module.register_parameter(k, torch.nn.Parameter(t.clone(), requires_grad=False))
    out: dict[str, list[float]] = {k: [] for k in ("publish", "pull", "manifest", "transfer", "assemble", "pull_base",
                                                   "assemble_base", "load", "load_state_dict")}
    with WeightServer(delta=False, copy_threads=1, keep_versions=2) as srv:
        puller = WeightPuller(srv.endpoint)
        held = None
        for v in range(reps + 1):
            t0 = time.perf_counter()
            srv.publish(v, source)
            t1 = time.perf_counter()
            got = puller.pull()
            t2 = time.perf_counter()
            held = puller.pull(base=held)
            t_base = time.perf_counter() - t2
            t2 = time.perf_counter()
            if flat:
                assert engine.copy_from(held.state_dict)
            else:
                copy_tensors(dst, [held.state_dict[k] for k in names])
            t3 = time.perf_counter()
            if not flat:
                module.load_state_dict(held.state_dict, strict=True)
            t4 = time.perf_counter()
            if v == 0:
                continue  # warm-up
            out["publish"].append(t1 - t0)
            out["pull"].append(t2 - t1)
            out["manifest"].append(got.phases["manifest_s"])
            out["transfer"].append(got.phases["transfer_s"] + got.phases["verify_s"])
            out["assemble"].append(got.phases["assemble_s"])
            out["pull_base"].append(t_base)
            out["assemble_base"].append(held.phases["assemble_s"])
            out["load"].append(t3 - t2)
            out["load_state_dict"].append(t4 - t3)
        loaded = engine if flat else dict(zip(names, dst))
        assert all(torch.equal(loaded[k], sd[k].to(torch.bfloat16)) for k in names)
    med = {k: statistics.median(v) for k, v in out.items()}
    med["total"] = med["publish"] + med["pull_base"] + med["load"]
    med["total_load_state_dict"] = med["publish"] + med["pull"] + med["load_state_dict"]
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 40])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cols = ("publish", "pull", "manifest", "transfer", "assemble", "pull_base", "assemble_base", "load",
            "load_state_dict", "total")
    print(f"{'MiB':>5} {'tensors':>8} " + " ".join(f"{c:>15}" for c in cols) + "   (ms, medians; total = publish + "
          "pull_base + load)")
    for mib in args.sizes_mib:
        nbytes = int(mib * (1 << 20))
        states = {1: state(1, nbytes), args.tensors: state(args.tensors, nbytes)}
        for flat in (True, False):
            how = "flat" if flat else "per-tensor"
            one, many = (measure(states[n], args.reps, flat) for n in (1, args.tensors))
            for n, r in ((1, one), (args.tensors, many)):
                print(f"{mib:>5g} {n:>8} " + " ".join(f"{r[c] * 1e3:>15.2f}" for c in cols) + f"   {how}")
            ratio = {c: many[c] / one[c] for c in ("publish", "pull", "pull_base", "load", "total",
                                                   "total_load_state_dict")}
            extra = "" if flat else f" (fresh pull + load_state_dict: {ratio['total_load_state_dict']:.2f}×)"
            print(f"  {how}: ratio {args.tensors} ÷ 1 tensor at {mib:g} MiB: publish {ratio['publish']:.2f}×, pull "
                  f"{ratio['pull']:.2f}× (into the base's buffer {ratio['pull_base']:.2f}×), load "
                  f"{ratio['load']:.2f}×, publish+pull+load {ratio['total']:.2f}×{extra}; per tensor "
                  f"{(many['total'] - one['total']) / args.tensors * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
