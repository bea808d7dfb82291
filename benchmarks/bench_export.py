"""Benchmark: exporting a weight version (issue 14 item 4, CPU side) vs a plain copy of the same bytes.

The trainer's fp32 master weights become a servable bf16 version: cast-copy into a host buffer plus one xxh3
checksum per chunk. Measured side by side in one run, per size, on a model-shaped state (``--tensors`` 2-D fp32
tensors of equal size, the torch backend's layout):

- ``memcpy``: ``dst.copy_(src)`` of the version's wire bytes (bf16 → a warm uint8 buffer) — the CPU stand-in for
  a pinned ``tensor.to("cpu", non_blocking=True)``: the floor any export pays to move its bytes once;
- ``publish``: ``WeightServer.publish`` of the torch backend's ``FlatState`` as the run does it (one cast-copy
  per chunk in a helper thread overlapped with the checksums, into a buffer reused from an evicted version);
- ablations: the same ``FlatState`` cast then hashed in sequence into a fresh buffer (``flat, fresh, serial``:
  the publish before buffer reuse and overlap), and the per-tensor publish of a plain state dict (``per-tensor``:
  plan, one ``_foreach_copy_`` into views, padding scatter, then the checksums).

Phases of ``publish`` (copy = cast seconds, hash = checksum seconds, each summed over its thread; they overlap)
come from the server's stats. Ratio = memcpy ÷ export time (1.0 = the export moves its bytes as fast as a plain
copy; the goal is ≥ 0.8×). Deltas are off (their encoding is a separate pass, ``bench_delta.py``); one torch
thread (``WeightServer(copy_threads=1)``, as the run sets it). Reps interleaved, medians.

Run: ``.venv/bin/python benchmarks/bench_export.py [--sizes-mib 64 256] [--tensors 300] [--reps 7]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.protocol.weight_msgs import chunk_checksum, num_chunks  # noqa: E402
from rlboost_hpc.weights import WeightServer, layout  # noqa: E402


def model_state(total_bytes_bf16: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of shape (rows, 1024) whose bf16 cast totals about ``total_bytes_bf16``."""
    rows = max(1, total_bytes_bf16 // 2 // 1024 // tensors)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i:04d}.weight": torch.randn(rows, 1024, generator=g) for i in range(tensors)}


def serial_fresh(flat: layout.FlatState, chunk_bytes: int) -> list[int]:
    """The publish's copy and checksums without buffer reuse or overlap: fresh buffer, cast, then hash."""
    buf = layout.host_buffer(flat.nbytes)
    flat.cast_into(buf)
    view = memoryview(buf.numpy())
    return [chunk_checksum(view[i * chunk_bytes:(i + 1) * chunk_bytes])
            for i in range(num_chunks(flat.nbytes, chunk_bytes))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk-mib", type=float, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cb = int(args.chunk_mib * (1 << 20))
    print(f"{'MiB':>6} {'memcpy':>8} {'publish':>8} {'copy':>7} {'hash':>7} {'serial':>8} {'per-tensor':>10}   "
          "ms (medians); ratios = memcpy ÷ export")
    for mib in args.sizes_mib:
        sd = model_state(int(mib * (1 << 20)), args.tensors)
        flat = layout.FlatState.pack(sd)
        src = torch.empty(flat.nbytes, dtype=torch.uint8)
        flat.cast_into(src)
        warm = torch.empty_like(src)
        warm.copy_(src)
        out: dict[str, list[float]] = {k: [] for k in ("memcpy", "publish", "copy", "hash", "serial", "per_tensor")}
        with WeightServer(chunk_bytes=cb, keep_versions=2, delta=False, copy_threads=1) as srv, \
                WeightServer(chunk_bytes=cb, keep_versions=2, delta=False, copy_threads=1) as plain:
            for v in range(args.reps + 3):
                t0 = time.perf_counter()
                warm.copy_(src)
                t1 = time.perf_counter()
                before = srv.stats
                man = srv.publish(v, flat)
                t2 = time.perf_counter()
                after = srv.stats
                digests = serial_fresh(flat, cb)
                t3 = time.perf_counter()
                plain.publish(v, sd)
                t4 = time.perf_counter()
                assert digests == man.chunk_checksums
                if v < 3:
                    continue  # warm-up: keep_versions + 1 buffers rotate through the pool from then on
                out["memcpy"].append(t1 - t0)
                out["publish"].append(t2 - t1)
                out["copy"].append(after["publish_copy_seconds"] - before["publish_copy_seconds"])
                out["hash"].append(after["publish_hash_seconds"] - before["publish_hash_seconds"])
                out["serial"].append(t3 - t2)
                out["per_tensor"].append(t4 - t3)
            reused = srv.stats["publish_buffers_reused"]
        med = {k: statistics.median(v) for k, v in out.items()}
        print(f"{mib:>6g} {med['memcpy'] * 1e3:>8.1f} {med['publish'] * 1e3:>8.1f} {med['copy'] * 1e3:>7.1f} "
              f"{med['hash'] * 1e3:>7.1f} {med['serial'] * 1e3:>8.1f} {med['per_tensor'] * 1e3:>10.1f}")
        print(f"  {mib:g} MiB ({flat.nbytes / 1e6:.0f} MB bf16, {len(sd)} tensors): memcpy ÷ publish "
              f"{med['memcpy'] / med['publish']:.2f}× ({flat.nbytes / med['publish'] / 1e9:.2f} GB/s; "
              f"{reused} of {args.reps + 3} publishes into a reused buffer); ablations: memcpy ÷ flat fresh serial "
              f"{med['memcpy'] / med['serial']:.2f}×, memcpy ÷ per-tensor {med['memcpy'] / med['per_tensor']:.2f}×; "
              f"publish ÷ (copy + hash) {med['publish'] / (med['copy'] + med['hash']):.2f}")


if __name__ == "__main__":
    main()
