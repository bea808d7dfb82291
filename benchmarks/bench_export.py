"""Benchmark: exporting a weight version (issue 14 item 4, CPU side) vs a plain copy of the same bytes.

The trainer's fp32 master weights become a servable bf16 version: cast-copy into a host buffer plus one xxh3
checksum per chunk. Measured side by side in one run, per size, on a model-shaped state (``--tensors`` 2-D fp32
tensors of equal size, the torch backend's layout):

- ``memcpy``: ``dst.copy_(src)`` of the version's wire bytes (bf16 → a warm uint8 buffer) — the CPU stand-in for
  a pinned ``tensor.to("cpu", non_blocking=True)`` (that one with ``--device cuda``): the floor any export pays to
  move its bytes once;
- ``source copy`` (CPU only): a copy of the fp32 master weights' own bytes into a warm tensor — what reading
  the source once costs: a cast from fp32 must read twice the wire bytes, so on a CPU this, not ``memcpy``, is the
  floor of an export from fp32 weights (on a GPU the cast runs on the device and only wire bytes cross the link);
- ``publish``: ``WeightServer.publish`` of the torch backend's ``FlatState`` as the run does it (one cast-copy
  per chunk in a helper thread overlapped with the checksums, into a buffer reused from an evicted version);
- ablations: the same ``FlatState`` cast then hashed in sequence into a fresh buffer (``flat, fresh, serial``:
  the publish before buffer reuse and overlap), and the per-tensor publish of a plain state dict (``per-tensor``:
  plan, one ``_foreach_copy_`` into views, padding scatter, then the checksums).

Phases of ``publish`` (copy = cast seconds, hash = checksum seconds, each summed over its thread; they overlap)
come from the server's stats. Ratio = memcpy ÷ export time (1.0 = the export moves its bytes as fast as a plain
copy; the goal is ≥ 0.8×). Deltas are off (their encoding is a separate pass, ``bench_delta.py``); one torch
thread (``WeightServer(copy_threads=1)``, as the run sets it). Each arm runs its reps in a block (the fresh-buffer
ablation last: its new mappings make the kernel compact memory, which slows what runs beside it); medians after
3 warm-up reps.

With ``--device cuda`` the weights live on the GPU: the export is a device-to-host cast-copy and the baseline a
pinned ``non_blocking`` copy of the bf16 bytes (the issue's comparison); the publish writes pinned buffers (the
pool's mappings registered with CUDA once, as the run does for weights on a GPU), and an ablation repeats it into
pageable buffers.

Run: ``.venv/bin/python benchmarks/bench_export.py [--sizes-mib 64 256] [--tensors 300] [--reps 7] [--device cpu]``
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
from rlboost_hpc.models import layout  # noqa: E402
from rlboost_hpc.weights import WeightServer  # noqa: E402


def model_state(total_bytes_bf16: int, tensors: int, device: str) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of shape (rows, 1024) on ``device`` whose bf16 cast totals about
    ``total_bytes_bf16``."""
    rows = max(1, total_bytes_bf16 // 2 // 1024 // tensors)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i:04d}.weight": torch.randn(rows, 1024, generator=g).to(device) for i in range(tensors)}


def plain_copy(device: str, flat: layout.FlatState):
    """The baseline: a function moving the version's wire bytes once — ``dst.copy_(src)`` into a warm host
    buffer on CPU; on CUDA a ``non_blocking`` device-to-host copy into a pinned buffer, synchronised."""
    src = torch.empty(flat.nbytes, dtype=torch.uint8, device=device)
    flat.cast_into(src)
    dst = torch.empty(flat.nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    dst.copy_(src)

    def copy() -> None:
        dst.copy_(src, non_blocking=device != "cpu")
        if device != "cpu":
            torch.cuda.synchronize()
    return copy


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
    ap.add_argument("--device", default="cpu", help="where the fp32 weights live (cuda: a GPU's export)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cb = int(args.chunk_mib * (1 << 20))
    print(f"{'MiB':>6} {'memcpy':>8} {'publish':>8} {'copy':>7} {'hash':>7} {'serial':>8} {'per-tensor':>10}   "
          "ms (medians); ratios = memcpy ÷ export")
    for mib in args.sizes_mib:
        sd = model_state(int(mib * (1 << 20)), args.tensors, args.device)
        flat = layout.FlatState.pack(sd)
        memcpy = plain_copy(args.device, flat)
        out: dict[str, list[float]] = {k: [] for k in ("memcpy", "publish", "copy", "hash", "serial", "per_tensor",
                                                       "pageable", "source")}
        warmup = 3  # keep_versions + 1 buffers rotate through a server's pool from then on
        for _ in range(args.reps + warmup):
            t0 = time.perf_counter()
            memcpy()
            out["memcpy"].append(time.perf_counter() - t0)
        if args.device == "cpu":
            master = torch.empty_like(flat.flat)
            for _ in range(args.reps + warmup):
                t0 = time.perf_counter()
                master.copy_(flat.flat)
                out["source"].append(time.perf_counter() - t0)
            del master
        # each arm in its own block: fresh mappings (the serial ablation, last) make the kernel compact memory for
        # huge pages, which slows whatever runs next to them
        cuda = args.device != "cpu"
        with WeightServer(chunk_bytes=cb, keep_versions=2, delta=False, copy_threads=1, pin_memory=cuda) as srv:
            for v in range(args.reps + warmup):
                before = srv.stats
                t0 = time.perf_counter()
                man = srv.publish(v, flat)
                out["publish"].append(time.perf_counter() - t0)
                after = srv.stats
                out["copy"].append(after["publish_copy_seconds"] - before["publish_copy_seconds"])
                out["hash"].append(after["publish_hash_seconds"] - before["publish_hash_seconds"])
            reused, pinned = srv.stats["publish_buffers_reused"], srv.stats["publish_buffers_pinned"]
        if cuda:  # ablation: the same publish into pageable buffers (what the run did before pinning them)
            with WeightServer(chunk_bytes=cb, keep_versions=2, delta=False, copy_threads=1) as pageable:
                for v in range(args.reps + warmup):
                    t0 = time.perf_counter()
                    pageable.publish(v, flat)
                    out["pageable"].append(time.perf_counter() - t0)
        with WeightServer(chunk_bytes=cb, keep_versions=2, delta=False, copy_threads=1) as plain:
            for v in range(args.reps + warmup):
                t0 = time.perf_counter()
                plain.publish(v, sd)
                out["per_tensor"].append(time.perf_counter() - t0)
        for _ in range(args.reps + warmup):
            t0 = time.perf_counter()
            digests = serial_fresh(flat, cb)
            out["serial"].append(time.perf_counter() - t0)
        assert digests == man.chunk_checksums
        out = {k: v[warmup:] for k, v in out.items() if v}
        med = {k: statistics.median(v) for k, v in out.items()}
        print(f"{mib:>6g} {med['memcpy'] * 1e3:>8.1f} {med['publish'] * 1e3:>8.1f} {med['copy'] * 1e3:>7.1f} "
              f"{med['hash'] * 1e3:>7.1f} {med['serial'] * 1e3:>8.1f} {med['per_tensor'] * 1e3:>10.1f}")
        print(f"  {mib:g} MiB ({flat.nbytes / 1e6:.0f} MB bf16, {len(sd)} tensors): memcpy ÷ publish "
              f"{med['memcpy'] / med['publish']:.2f}× ({flat.nbytes / med['publish'] / 1e9:.2f} GB/s; "
              f"{reused} of {args.reps + warmup} publishes into a reused buffer); ablations: memcpy ÷ flat fresh "
              f"serial "
              f"{med['memcpy'] / med['serial']:.2f}×, memcpy ÷ per-tensor {med['memcpy'] / med['per_tensor']:.2f}×; "
              f"publish ÷ (copy + hash) {med['publish'] / (med['copy'] + med['hash']):.2f}")
        if not cuda:
            print(f"  source copy of the fp32 weights {med['source'] * 1e3:.1f} ms: source copy ÷ publish "
                  f"{med['source'] / med['publish']:.2f}× (the cast reads {flat.flat.element_size() // 2}× the wire "
                  f"bytes)")
        if cuda:
            print(f"  pinned buffers ({pinned} pinned): memcpy ÷ publish {med['memcpy'] / med['publish']:.2f}×; "
                  f"ablation, pageable buffers: memcpy ÷ publish {med['memcpy'] / med['pageable']:.2f}× "
                  f"({flat.nbytes / med['pageable'] / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
