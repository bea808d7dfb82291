"""Benchmark: the weight pull vs a ``torch.distributed`` broadcast of the same bytes between two processes.

Issue 14 item 3's comparison: SGLang's ``update_weights_from_distributed`` path (the trainer broadcasts each
tensor to the rollout engines over a process group) against this project's pull (a rollout instance fetches the
version over ZeroMQ, checks every chunk's xxh3 and the whole version). Two processes in every arm, one run, per
size:

- ``broadcast gloo``: rank 0 broadcasts a uint8 tensor of the version's bytes to rank 1 (CPU tensors, TCP over
  loopback) — the collective the tests use for SGLang's NCCL path on CPU;
- ``broadcast nccl`` (two or more CUDA devices; NCCL refuses two ranks on one device): GPU to GPU with NCCL's
  default transports (NVLink / PCIe peer-to-peer), and ``nccl socket`` with peer-to-peer and shared memory off
  (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket``) — what NCCL does between nodes without an RDMA
  fabric, the frontend-network case of preemptible rollout instances;
- ``pull``: a ``WeightServer`` in this process publishes the same bytes (bf16); a child process pulls them into a
  reused staging buffer (pinned on CUDA) with the default streams, plain; ``pull sealed`` the run's default for a
  secured run (CURVE manifest, AES-256-GCM-sealed chunks on a plain port);
- ``pull + H2D`` (CUDA): the pull followed by the staging buffer's ``non_blocking`` copy to the GPU, synchronised
  — what a GPU rollout engine needs before it can load, end to end.

Rank 1 / the puller times each transfer from a barrier (the collective) or the call (the pull) to the last byte
in its memory (CUDA synchronised); one warm-up per arm; GB/s of medians (1 GB = 1e9 bytes) and each arm's ratio
to ``broadcast gloo`` (and to ``broadcast nccl`` when measured). Loopback: the wire itself costs little, so this
compares the two software stacks' per-byte costs, not a network.

Run: ``.venv/bin/python benchmarks/bench_nccl.py [--sizes-mib 64 256] [--reps 5] [--device cpu|cuda]``
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.protocol.auth import RunKeys  # noqa: E402
from rlboost_hpc.weights import WeightPuller, WeightServer  # noqa: E402

NCCL_SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
                   "NCCL_SOCKET_IFNAME": "lo"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pattern(n: int, device: torch.device) -> torch.Tensor:
    """n bytes of a fixed pseudo-random pattern (both ranks can check it without moving it)."""
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def collective_rank(rank: int, port: int, backend: str, env: dict[str, str], sizes: list[int], reps: int,
                    q) -> None:
    """One rank of the broadcast arm: ``reps`` + 1 broadcasts per size; rank 1 puts ``(bytes, seconds)``."""
    os.environ.update(env)
    cuda = backend == "nccl"
    dev = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), **({"device_id": dev} if cuda else {}))
    try:
        for n in sizes:
            buf = _pattern(n, dev) if rank == 0 else torch.zeros(n, dtype=torch.uint8, device=dev)
            times = []
            for r in range(reps + 1):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
                dist.broadcast(buf, src=0)
                if cuda:
                    torch.cuda.synchronize(dev)
                if r:
                    times.append(time.perf_counter() - t)
            if rank == 1:
                if not torch.equal(buf.cpu(), _pattern(n, torch.device("cpu"))):
                    raise RuntimeError("broadcast delivered other bytes")
                q.put((n, times))
    finally:
        dist.destroy_process_group()


def broadcast_arm(backend: str, env: dict[str, str], sizes: list[int], reps: int) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=collective_rank, args=(r, port, backend, env, sizes, reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = {}
    for _ in sizes:
        n, times = q.get(timeout=600)
        out[n] = times
    for p in procs:
        p.join(120)
        if p.exitcode != 0:
            raise RuntimeError(f"{backend} rank exited with {p.exitcode}")
    return out


def puller_proc(endpoint: str, keys, n: int, checksum: str, reps: int, device: str, q) -> None:
    """The pull arm's child: ``reps`` + 1 pulls into one staging buffer; puts pull and pull + H2D seconds."""
    cuda = device == "cuda"
    staging = torch.empty(n, dtype=torch.uint8)
    staging = staging.pin_memory() if cuda else staging.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device) if cuda else None
    p = WeightPuller(endpoint, keys=keys)
    pull_s, h2d_s = [], []
    for r in range(reps + 1):
        t = time.perf_counter()
        got = p.pull(into=staging)
        t1 = time.perf_counter()
        if got.checksum != checksum or got.nbytes != n:
            raise RuntimeError("pulled other bytes")
        if cuda:
            dst.copy_(staging[:n], non_blocking=True)
            torch.cuda.synchronize()
        if r:
            pull_s.append(t1 - t)
            h2d_s.append(time.perf_counter() - t)
        del got
    q.put((pull_s, h2d_s))


def pull_arm(sizes: list[int], reps: int, device: str, sealed: bool) -> dict[int, tuple[list[float], list[float]]]:
    ctx = mp.get_context("spawn")
    keys = RunKeys.generate() if sealed else None
    out = {}
    with WeightServer(keep_versions=1, keys=keys, delta=False) as srv:
        for v, n in enumerate(sizes):
            m = srv.publish(v, {"w": _pattern(n, torch.device("cpu")).view(torch.bfloat16)}, dtype=torch.bfloat16)
            q = ctx.Queue()
            child = ctx.Process(target=puller_proc, args=(srv.endpoint, keys.client_view() if keys else None,
                                                          m.total_bytes, m.checksum, reps, device, q))
            child.start()
            out[n] = q.get(timeout=600)
            child.join(60)
            if child.exitcode != 0:
                raise RuntimeError(f"puller exited with {child.exitcode}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    sizes = [s << 20 for s in a.sizes_mib]
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}, device {a.device} ({gpus} GPUs), reps {a.reps}, "
          f"GB/s of medians (1 GB = 1e9 B)")
    print("# fairness: the same bytes in every arm (published as bf16 for the pull, no conversion on the wire); each "
          "arm receives into one buffer allocated before its timed transfers and reused by all of them; torch's "
          "default threads in every process; the pull also checks every chunk's xxh3 and the whole version, the "
          "broadcast checks nothing")
    rows: dict[str, dict[int, list[float]]] = {"broadcast gloo": broadcast_arm("gloo", {"GLOO_SOCKET_IFNAME": "lo"},
                                                                               sizes, a.reps)}
    if gpus >= 2:
        rows["broadcast nccl"] = broadcast_arm("nccl", {}, sizes, a.reps)
        rows["broadcast nccl socket"] = broadcast_arm("nccl", NCCL_SOCKET_ENV, sizes, a.reps)
    elif a.device == "cuda":
        print(f"# broadcast nccl: not measured — NCCL needs one device per rank, this machine has {gpus}")
    for label, sealed in (("pull", False), ("pull sealed", True)):
        res = pull_arm(sizes, a.reps, a.device, sealed)
        rows[label] = {n: r[0] for n, r in res.items()}
        if a.device == "cuda":
            rows[f"{label} + H2D"] = {n: r[1] for n, r in res.items()}
    refs = [r for r in ("broadcast gloo", "broadcast nccl") if r in rows]
    print(f"{'size':>7} {'method':>24} {'GB/s':>7} {'best':>7}  " + "  ".join(f"÷ {r}" for r in refs))
    for n in sizes:
        for label, by_size in rows.items():
            med, best = statistics.median(by_size[n]), min(by_size[n])
            ratios = "  ".join(f"{statistics.median(rows[r][n]) / med:>{len(r) + 2}.2f}" for r in refs)
            print(f"{n >> 20:>4}MiB {label:>24} {n / med / 1e9:7.2f} {n / best / 1e9:7.2f}  {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
