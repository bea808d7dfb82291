"""Benchmark: pull-based weight transfer vs a raw loopback TCP copy of the same bytes.

For each size:
(a) raw: one TCP stream, a sender thread ``sendall`` of a memoryview of the published buffer, the
    receiver ``recv_into`` either a preallocated, already faulted-in buffer (``raw warm``: the TCP
    ceiling, the headline baseline) or a fresh ``torch.empty`` buffer (``raw fresh``: 4 KiB page faults
    included, as a naive receiver pays them); timed from allocation + connect to the last byte;
(b) ``WeightPuller.pull`` (manifest + transfer + per-chunk xxh3 + whole-version check + views) with
    streams = 1, 2, 4, into a fresh buffer (the default, so earlier pulls stay valid; it is a
    MADV_HUGEPAGE mapping) and into a reused, faulted-in staging buffer (``pull(into=...)``, the
    like-for-like comparison with ``raw warm``).
Same process layout for both (holder thread and receiver in one process). Reps are interleaved; the table
shows median and best GB/s (1 GB = 1e9 bytes), ratios of medians, and process CPU seconds per GB (all
threads, both ends — less sensitive to other load on a shared machine than wall time). Also publish()
seconds per GB of output (fp32 → bf16 cast-copy + chunk checksums) with torch's default intra-op threads
and with one thread (``WeightServer(copy_threads=1)``; on a small shared machine the OpenMP team waits for
descheduled threads, and torchrun ranks default to 1 thread anyway).

``--ablate-retain N`` alternates N pairs of child runs with the receive buffers retained (what the puller does:
``layout.retain_frame_buffers``) and with glibc's default malloc thresholds (``--no-retain``).

Run: ``.venv/bin/python benchmarks/bench_weights.py [--sizes-mib 64 256] [--reps 7] [--chunk-mib 4]``
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.weights import WeightPuller, WeightServer  # noqa: E402
from rlboost_hpc.weights.pull_streams import auto_streams, usable_cores  # noqa: E402
from rlboost_hpc.models import layout  # noqa: E402


class RawSender:
    """Loopback TCP server: every accepted connection gets ``sendall(view)`` then close."""

    def __init__(self, view: memoryview):
        self.view = view
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.port = self.ls.getsockname()[1]
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            with c:
                c.sendall(self.view)

    def close(self) -> None:
        self.ls.close()


def raw_once(port: int, n: int, warm: torch.Tensor | None = None) -> float:
    """One raw TCP copy; into ``warm`` (already faulted-in, the TCP ceiling) or a fresh ``torch.empty``."""
    t0 = time.perf_counter()
    dst = warm if warm is not None else torch.empty(n, dtype=torch.uint8)
    mv = memoryview(dst.numpy())
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < n:
            r = s.recv_into(mv[got:], n - got)
            if not r:
                raise RuntimeError("raw sender closed early")
            got += r
    return time.perf_counter() - t0


def make_state(total_bytes_bf16: int) -> dict[str, torch.Tensor]:
    """fp32 tensors (~8 MiB-ish and a few small ones) whose bf16 cast totals about ``total_bytes_bf16``."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    remaining = total_bytes_bf16 // 2  # elements
    i = 0
    while remaining > 0:
        numel = min(remaining, 4 << 20)
        sd[f"layers.{i}.weight"] = torch.randn(numel, generator=g)
        sd[f"layers.{i}.norm"] = torch.randn(64, generator=g)
        remaining -= numel
        i += 1
    return sd


def ablate_retain(rounds: int, argv: list[str]) -> None:
    """Alternate child runs with and without ``--no-retain``; print each run's pull-into ÷ raw-warm ratios."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for label, extra in (("retained", []), ("glibc default", ["--no-retain"])):
            out = subprocess.run([sys.executable, __file__, *argv, *extra], capture_output=True, text=True,
                                 check=True).stdout
            for line in out.splitlines():
                f = line.split()
                if len(f) > 5 and f[1] == "pull" and f[3] == "into":
                    ratios.setdefault((f"{f[0]} {f[2]}", label), []).append(float(f[7]))
                    cpu = f[8:11]
                    print(f"round {r}: {label:>13} {f[0]} {f[2]} into ÷ raw warm {f[7]}  {' '.join(cpu)}")
    print("# pull into a reused buffer ÷ raw socket copy into a warm buffer, medians over rounds")
    for (row, label), rs in sorted(ratios.items()):
        print(f"{row:>16} {label:>13}: {statistics.median(rs):.2f}  ({' '.join(f'{x:.2f}' for x in rs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk-mib", type=float, default=4)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--io-threads", type=int, default=None, help="puller libzmq I/O threads (default min(streams,4))")
    ap.add_argument("--server-io-threads", type=int, default=1)
    ap.add_argument("--no-retain", action="store_true",
                    help="ablation: leave glibc's malloc thresholds alone (layout.retain_frame_buffers off)")
    ap.add_argument("--ablate-retain", type=int, default=0, metavar="ROUNDS",
                    help="run ROUNDS alternated pairs of child runs, with and without --no-retain, and print the "
                         "pull-into ÷ raw ratios side by side (the setting is process-wide, hence children)")
    args = ap.parse_args()
    if args.ablate_retain:
        ablate_retain(args.ablate_retain, [a for a in sys.argv[1:] if a != "--ablate-retain"
                                           and a != str(args.ablate_retain)])
        return
    if args.no_retain:
        layout.retain_frame_buffers = lambda *a: False  # the puller calls it through the module

    print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}, chunk {args.chunk_mib} MiB, window {args.window}, "
          f"reps {args.reps} (median / best)")
    print("# fairness: the same bytes both ways, no dtype conversion on either side; 'x warm' compares both sides "
          "receiving into a reused, faulted-in buffer, 'x same-buf' the same kind of buffer on both sides (fresh vs "
          "fresh); the raw copy is one TCP stream on one thread, the pull uses its streams (one thread each) and "
          "libzmq's I/O thread, and checks every chunk's xxh3 and the whole version, which the raw copy does not")
    rows = []
    t_start = time.perf_counter()
    for size_mib in args.sizes_mib:
        sd = make_state(size_mib << 20)
        with WeightServer(chunk_bytes=int(args.chunk_mib * (1 << 20)), keep_versions=2,
                          io_threads=args.server_io_threads) as srv:
            pub: dict[str, list[float]] = {"default": [], "1thr": []}
            threads = torch.get_num_threads()
            for v in range(10):  # the first 4 fill the buffer pool (fresh pages); then the two kinds alternate
                kind = "default" if v % 2 == 0 else "1thr"
                srv.store._copy_threads = None if kind == "default" else 1  # the copy_threads= setting
                t = time.perf_counter()
                m = srv.publish(v, sd, dtype=torch.bfloat16)
                if v >= 4:
                    pub[kind].append(time.perf_counter() - t)
            n = m.total_bytes
            held_view = memoryview(srv.store._held[m.version].view)  # (private) the exact bytes a pull moves
            raw = RawSender(held_view)
            pullers = {s: WeightPuller(srv.endpoint, streams=s, window=args.window, io_threads=args.io_threads)
                       for s in args.streams}
            # warm-up (page cache of the allocator, connections, code paths)
            warm = torch.ones(n, dtype=torch.uint8)  # receive buffer already faulted in
            staging = torch.ones(n, dtype=torch.uint8)  # reusable staging buffer for pull(into=...)
            raw_once(raw.port, n)
            raw_once(raw.port, n, warm)
            for p in pullers.values():
                p.pull()
                p.pull(into=staging)
            times: dict[str, list[float]] = {"raw warm": [], "raw fresh": []}
            cpu: dict[str, list[float]] = {"raw warm": [], "raw fresh": []}
            hash_frac: dict[str, list[float]] = {}
            for s in args.streams:
                times[f"pull s={s} fresh"] = []
                times[f"pull s={s} into"] = []
                cpu[f"pull s={s} fresh"] = []
                cpu[f"pull s={s} into"] = []
            for _ in range(args.reps):
                c0 = time.process_time()
                times["raw warm"].append(raw_once(raw.port, n, warm))
                c1 = time.process_time()
                times["raw fresh"].append(raw_once(raw.port, n))
                cpu["raw warm"].append(c1 - c0)
                cpu["raw fresh"].append(time.process_time() - c1)
                for s, p in pullers.items():
                    for kind, into in (("fresh", None), ("into", staging)):
                        c0 = time.process_time()
                        r = p.pull(into=into)
                        cpu[f"pull s={s} {kind}"].append(time.process_time() - c0)
                        assert r.nbytes == n and r.checksum == m.checksum
                        key = f"pull s={s} {kind}"
                        times[key].append(r.seconds)
                        hash_frac.setdefault(key, []).append(r.phases["chunk_hash_s"] / r.seconds)
                        del r
            raw.close()
            base = {"warm": statistics.median(times["raw warm"]), "fresh": statistics.median(times["raw fresh"])}
            for name, ts in times.items():
                med, best = statistics.median(ts), min(ts)
                kind = "warm" if name.endswith(("warm", "into")) else "fresh"
                extra = f"cpu {statistics.median(cpu[name]) / (n / 1e9):5.3f} s/GB"
                if name in hash_frac:
                    extra += f"  hash {100 * statistics.median(hash_frac[name]):4.1f}% of wall"
                rows.append((size_mib, name, n / med / 1e9, n / best / 1e9, base[kind] / med,
                             base["warm"] / med, extra))
            for kind, label in (("default", f"publish {threads}thr"), ("1thr", "publish 1thr")):
                spg = statistics.median(pub[kind]) / (n / 1e9)
                rows.append((size_mib, label, 1 / spg, None, None, None,
                             f"{spg:.3f} s/GB of bf16 output (fp32->bf16 cast-copy + xxh3), torch threads"))
    print("x same-buf: ratio of medians to raw into the same kind of buffer (pull fresh vs raw fresh — "
          "ours uses huge pages; pull into vs raw warm); x warm: to the raw TCP ceiling; cpu: process CPU "
          "seconds (all threads, both ends) per GB moved")
    print(f"{'size':>8} {'method':>17} {'GB/s med':>9} {'GB/s best':>9} {'x same-buf':>10} {'x warm':>7}  notes")
    for size_mib, name, med, best, ratio, ratio_w, extra in rows:
        b = f"{best:9.2f}" if best is not None else " " * 9
        r = f"{ratio:10.2f}" if ratio is not None else " " * 10
        w = f"{ratio_w:7.2f}" if ratio_w is not None else " " * 7
        print(f"{size_mib:>5}MiB {name:>17} {med:9.2f} {b} {r} {w}  {extra}")
    print(f"# the default weights.streams = 0 pulls with {auto_streams()} stream(s) here ({usable_cores()} usable cores): "
          f"its rows are s={auto_streams()}")
    print(f"# total {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
