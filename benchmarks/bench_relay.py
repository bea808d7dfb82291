"""Benchmark: trainer egress per weight version with peer relay on vs off, at 1 and N pullers.

Real processes' pieces in one process: the trainer's ``WeightServer``, N pullers (``RemoteWeights``, each with
its relay server, one thread each) and the manager's relay policy (``RelayTree``, fan-out 4, trainer fan-out 2)
deciding who serves whom, exactly as the manager applies it (waiting pullers are handed to holders as they
finish). Per configuration: bytes the trainer sent for one full version (every puller starts empty), and wall
seconds until all N hold it. Loopback and 2 cores: the wall time is CPU-bound here; the bytes are what a
trainer's NIC would carry.

Run: ``.venv/bin/python benchmarks/bench_relay.py [--size-mib 32] [--pullers 1 16]``
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlboost_hpc.policy.relay import RelayTree  # noqa: E402
from rlboost_hpc.rollout.remote_weights import RemoteWeights  # noqa: E402
from rlboost_hpc.weights import WeightServer  # noqa: E402


def one_version(trainer: WeightServer, n: int, relay: bool) -> tuple[int, float, int]:
    """All ``n`` pullers fetch version 0 once. Returns (trainer bytes sent, wall seconds, peer failovers)."""
    tree = RelayTree(fanout=4 if relay else 0, trainer_fanout=2)
    lock = threading.Condition()
    ready: dict[str, tuple[str, ...]] = {}
    pullers = [RemoteWeights(2, 4, 30.0, peer_timeout_s=5.0) for _ in range(n)]
    eps = [p.serve_relay("127.0.0.1", "127.0.0.1") if relay else "" for p in pullers]
    failovers = [0]
    before = trainer.stats["bytes_served"]

    def run(i: int) -> None:
        key = f"p{i}"
        with lock:
            s = tree.want(key)
            if s.wait:
                lock.wait_for(lambda: key in ready)
                peers = ready.pop(key)
            else:
                peers = s.peers
        got = pullers[i].pull(trainer.endpoint, 0, peers=list(peers))
        with lock:
            failovers[0] += int(got.phases.get("peer_failovers", 0))
            for k, src in tree.done(key, eps[i]):
                ready[k] = src.peers
            lock.notify_all()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for p in pullers:
        p.close()
    return trainer.stats["bytes_served"] - before, wall, failovers[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--pullers", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args()
    torch.set_num_threads(1)
    sd = {f"w{i}": torch.randn(a.size_mib * (1 << 20) // 2 // 8) for i in range(8)}
    rows = {}
    with WeightServer(chunk_bytes=1 << 20, copy_threads=1) as trainer:
        trainer.publish(0, sd)
        full = trainer.manifest(0).total_bytes
        for relay in (False, True):
            for n in a.pullers:
                sent, wall, fo = one_version(trainer, n, relay)
                rows[(relay, n)] = sent
                print(f"relay {'on ' if relay else 'off'} pullers {n:3d}: trainer sent {sent / full:5.2f} versions "
                      f"({sent / 2**20:7.1f} MiB), all hold it after {wall:6.2f} s, peer failovers {fo}")
    lo, hi = min(a.pullers), max(a.pullers)
    for relay in (False, True):
        print(f"trainer egress at {hi} pullers / at {lo}: relay {'on' if relay else 'off'} "
              f"{rows[(relay, hi)] / rows[(relay, lo)]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
