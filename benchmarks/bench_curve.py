"""Benchmark: what ZeroMQ CURVE (issue 7 §1: authenticated, encrypted sockets) costs, measured side by side.

1. Weight pull: the same version (bf16 bytes of ``--sizes-mib``) pulled from a :class:`WeightServer` by a
   :class:`WeightPuller` (``--streams`` parallel streams) three ways, pulls interleaved: without keys (plain),
   with the run's CURVE keys and every chunk encrypted + authenticated by libsodium on libzmq's I/O threads
   (``sealed=False``: what every pull did before sealed chunks), and with CURVE keys and the chunks sealed with
   AES-256-GCM on the holder's sealed port (the default). GB/s, median of ``--reps``; ratios to plain.
2. Token ingest: the live part of ``bench_manager_ingest.py`` (a manager process, fake rollout instances in a
   load-generator process streaming real ``Tokens`` frames, a trainer client), without and with CURVE on every
   socket. tokens/s (best of ``--reps``) and tokens per manager CPU-second.

Prints the ratios (with / without). Goal (issue 7): ≤ 10 % loss on token ingest.
Run: ``.venv/bin/python benchmarks/bench_curve.py [--sizes-mib 64 256] [--ks 4 16] [--instances 4]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_manager_ingest import run_live  # noqa: E402
from bench_weights import make_state  # noqa: E402

from rlboost_hpc.protocol.auth import RunKeys  # noqa: E402
from rlboost_hpc.weights.puller import WeightPuller  # noqa: E402
from rlboost_hpc.weights.server import WeightServer  # noqa: E402


MODES = ("plain", "curve", "sealed")


def pull_gbps(size_mib: int, streams: int, reps: int, keys: RunKeys, io_threads: int | None = None
              ) -> tuple[dict[str, float], int]:
    """GB/s of a pull into a warm buffer for each of :data:`MODES` (pulls interleaved, each from its own holder);
    ``io_threads``: libzmq I/O threads of the servers and of the pullers (None: their defaults)."""
    sd = make_state(size_mib << 20)
    servers = {"plain": WeightServer(chunk_bytes=4 << 20, io_threads=io_threads),
               "curve": WeightServer(chunk_bytes=4 << 20, keys=keys, io_threads=io_threads, sealed=False),
               "sealed": WeightServer(chunk_bytes=4 << 20, keys=keys, io_threads=io_threads)}
    try:
        pullers, staging, times = {}, {}, {m: [] for m in MODES}
        for mode, srv in servers.items():
            srv.start()
            man = srv.publish(0, sd, dtype=torch.bfloat16)
            assert (man.sealed is not None) == (mode == "sealed")
            pullers[mode] = WeightPuller(srv.endpoint, streams=streams, window=4, io_threads=io_threads,
                                         keys=None if mode == "plain" else keys.client_view())
            staging[mode] = torch.ones(man.total_bytes, dtype=torch.uint8)
            pullers[mode].pull(into=staging[mode])  # warm-up
        for _ in range(reps):
            for mode in MODES:
                got = pullers[mode].pull(into=staging[mode])
                assert (got.phases["sealed_bytes"] > 0) == (mode == "sealed")
                times[mode].append(got.seconds)
    finally:
        for srv in servers.values():
            srv.close()
    return {m: man.total_bytes / statistics.median(t) / 1e9 for m, t in times.items()}, man.total_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=[64, 256], help="weight sizes (none: skip the pull part)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 16], help="tokens per delta (stream_every_tokens)")
    ap.add_argument("--instances", type=int, nargs="+", default=[4])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--loadgen-procs", type=int, default=1)
    ap.add_argument("--min-run-s", type=float, default=1.5)
    ap.add_argument("--max-steps", type=int, default=50)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=4.0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--ingest-reps", type=int, default=3)
    ap.add_argument("--io-threads", type=int, nargs="+", default=[1, 2, 4], help="I/O thread counts to compare")
    ap.add_argument("--skip-ingest", action="store_true", help="only the weight-pull parts")
    args = ap.parse_args()
    os.environ.setdefault("RLBOOST_LOG_LEVEL", "WARNING")
    ncpu = len(os.sched_getaffinity(0))
    keys = RunKeys.generate()
    print(f"# {ncpu} CPU cores, torch {torch.__version__}; CURVE = libzmq's curve25519 + xsalsa20-poly1305; "
          f"sealed = CURVE for the manifest, AES-256-GCM chunks on a plain port")
    head = f"{'plain GB/s':>10} {'CURVE GB/s':>10} {'sealed GB/s':>11} {'CURVE/plain':>11} {'sealed/plain':>12}"

    def row(g: dict[str, float]) -> str:
        return (f"{g['plain']:>10.3f} {g['curve']:>10.3f} {g['sealed']:>11.3f} {g['curve'] / g['plain']:>11.2f} "
                f"{g['sealed'] / g['plain']:>12.2f}")

    print(f"\n== weight pull, {args.streams} streams, median of {args.reps} (defaults' I/O threads) ==")
    print(f"{'MiB':>5} {head}")
    for size in args.sizes_mib:
        g, n = pull_gbps(size, args.streams, args.reps, keys)
        print(f"{n / 2**20:>5.0f} {row(g)}", flush=True)
    print(f"\n== weight pull by libzmq I/O threads (servers and pullers each), {args.streams} streams ==")
    print(f"{'MiB':>5} {'io':>3} {head}")
    for size in args.sizes_mib:
        for io in args.io_threads:
            g, n = pull_gbps(size, args.streams, args.reps, keys, io)
            print(f"{n / 2**20:>5.0f} {io:>3} {row(g)}", flush=True)
    if args.skip_ingest:
        return
    with tempfile.TemporaryDirectory() as d:
        keys.save(d)
        print(f"\n== manager token ingest (best of {args.ingest_reps}; alternating plain/CURVE runs) ==")
        print(f"{'inst':>4} {'k':>3} {'plain tok/s':>12} {'CURVE tok/s':>12} {'ratio':>6} "
              f"{'plain tok/mgrCPUs':>17} {'CURVE tok/mgrCPUs':>17} {'ratio':>6} {'check':>5}")
        for n_inst in args.instances:
            for k in args.ks:
                plain, curve = [], []
                for _ in range(args.ingest_reps):  # interleaved, so drifting machine load hits both alike
                    plain.append(run_live(n_inst, k, args))
                    curve.append(run_live(n_inst, k, args, keys_dir=d))
                bp = max(plain, key=lambda r: r["tok_s"])
                bc = max(curve, key=lambda r: r["tok_s"])
                cp = max(r["tok_per_mgr_cpu_s"] for r in plain)
                cc = max(r["tok_per_mgr_cpu_s"] for r in curve)
                ok = all(r["ok"] for r in plain + curve)
                print(f"{n_inst:>4} {k:>3} {bp['tok_s']:>12,.0f} {bc['tok_s']:>12,.0f} {bc['tok_s'] / bp['tok_s']:>6.2f} "
                      f"{cp:>17,.0f} {cc:>17,.0f} {cc / cp:>6.2f} {'ok' if ok else 'FAIL':>5}", flush=True)
    print("\nratio = CURVE / plain (1.00 = free). Goal: ingest ratio ≥ 0.90. tok/mgrCPUs = tokens per CPU-second of "
          "the manager process (least sensitive to other load on this 2-core machine).")


if __name__ == "__main__":
    main()
