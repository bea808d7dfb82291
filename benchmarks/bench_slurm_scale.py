"""The scavenger against a 64-node local Slurm cluster: reconciliation time and Slurm commands per cycle at 16, 64
and 128 rollout jobs (issue 29, items 3 and 4).

Brings up the project's local cluster with ``RLBOOST_SLURM_NODE_COUNT`` nodes (default 64 × 2 fake GPUs = 128 GPU
slots) in its own directory and port base (beside, never instead of, the 4-node cluster the tests use), then for
each J: the real :class:`scavenger.daemon.Scavenger` on a fresh run directory whose ``target.json`` asks for J
jobs, reconciling back to back until J run; then ``--steady`` cycles with nothing to change (what a run pays every
``poll_s``); then a second daemon on the same run directory (a restarted scavenger) adopts them — its first cycle
must submit nothing; then the target goes inactive and the jobs are cancelled until none is left.

The jobs are **stand-ins**: the rollout script is replaced by a batch script that sleeps until signalled. What is
measured is the scavenger's own Slurm traffic and time (``squeue``, ``sinfo``, ``sbatch``, ``scancel`` through
:class:`scavenger.slurm.SlurmClient`, counted per cycle), which does not depend on what the job runs; rollout jobs
with emulated instances at this scale are not run here.

Printed per J: cycles and seconds until J run, per steady cycle the median / max seconds and the Slurm commands by
kind, the adopting daemon's first cycle (seconds, commands, jobs submitted), and the drain (cycles, seconds); then
each steady cost's growth exponent in J.

Usage: python benchmarks/bench_slurm_scale.py [--nodes 64] [--jobs 16 64 128] [--steady 5] [--keep]
(as root: it starts Slurm daemons; ``--keep`` leaves the cluster up, else it is stopped and purged).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlboost_hpc.rundir import RunDir  # noqa: E402
from scavenger.config import ScavengerConfig  # noqa: E402
from scavenger.daemon import Scavenger  # noqa: E402
from scavenger.slurm import SlurmClient  # noqa: E402

STAND_IN = """#!/bin/bash
# bench_slurm_scale stand-in for a rollout job: sleeps until signalled
trap 'exit 0' USR2 TERM
sleep 86400 &
wait
"""


class CountingClient(SlurmClient):
    """A :class:`SlurmClient` that counts the commands it runs, by program name."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: Counter[str] = Counter()

    def run(self, argv, *a, **kw):
        self.calls[Path(argv[0]).name] += 1
        return super().run(argv, *a, **kw)


def cluster_env(nodes: int, slurm_dir: Path, port_base: int) -> dict[str, str]:
    return {**os.environ, "RLBOOST_SLURM_DIR": str(slurm_dir), "RLBOOST_SLURM_PORT_BASE": str(port_base),
            "RLBOOST_SLURM_NODE_COUNT": str(nodes), "RLBOOST_SLURM_UP_TIMEOUT": "300"}


def cycle(d: Scavenger, client: CountingClient):
    """One reconciliation: (result, seconds, commands run)."""
    client.calls.clear()
    t0 = time.perf_counter()
    res = d.reconcile_once()
    dt = time.perf_counter() - t0
    if not res.ok:
        raise SystemExit(f"reconcile failed: {res.error}")
    return res, dt, Counter(client.calls)


def one_point(j: int, work: Path, script: Path, conf: str, steady: int) -> dict:
    run_dir = work / f"run-j{j}"
    run_dir.mkdir()
    cfg = ScavengerConfig(max_jobs=j, gpus_per_job=1, cpus_per_job=1, script=str(script), run_id=f"bench-j{j}",
                          max_submit_per_cycle=16, grace_s=5)
    client = CountingClient(env={"SLURM_CONF": conf})
    d = Scavenger(cfg, run_dir, slurm=client)
    RunDir(run_dir).write_target(j, active=True, step=0)
    t0, cycles, deadline = time.perf_counter(), 0, time.monotonic() + 300
    while True:
        res, _, _ = cycle(d, client)
        cycles += 1
        if res.running >= j:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"J={j}: {res.running} of {j} jobs running after 300 s")
        time.sleep(0.2)
    up_s = time.perf_counter() - t0
    times, cmds = [], Counter()
    for _ in range(steady):
        res, dt, calls = cycle(d, client)
        times.append(dt)
        cmds += calls
    times.sort()
    adopter = CountingClient(env={"SLURM_CONF": conf})
    res, adopt_s, adopt_calls = cycle(Scavenger(cfg, run_dir, slurm=adopter), adopter)
    adopted = (res.live, len(res.submitted))
    RunDir(run_dir).write_target(j, active=False, step=1)
    t0, drain_cycles = time.perf_counter(), 0
    while True:
        res, _, _ = cycle(d, client)
        drain_cycles += 1
        if res.live == 0:
            break
        if time.perf_counter() - t0 > 300:
            raise SystemExit(f"J={j}: {res.live} jobs still live 300 s after the target went inactive")
        time.sleep(0.2)
    return {"J": j, "cycles_to_J": cycles, "s_to_J": up_s, "steady_ms_p50": 1e3 * times[len(times) // 2],
            "steady_ms_max": 1e3 * times[-1], "cmds_per_cycle": sum(cmds.values()) / steady,
            "by_kind": " ".join(f"{k} {v / steady:g}" for k, v in sorted(cmds.items())),
            "adopt_ms": 1e3 * adopt_s, "adopt_cmds": sum(adopt_calls.values()),
            "adopted/submitted": f"{adopted[0]}/{adopted[1]}", "drain_cycles": drain_cycles,
            "drain_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--jobs", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--steady", type=int, default=5, help="reconciliations timed with nothing to change")
    ap.add_argument("--port-base", type=int, default=18800)
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    a = ap.parse_args()
    slurm_dir = Path(f"/tmp/rlboost-slurm{a.nodes}")
    env = cluster_env(a.nodes, slurm_dir, a.port_base)
    t0 = time.perf_counter()
    subprocess.run([str(ROOT / "sbatch/local-cluster/up"), "--quiet"], env=env, check=True)
    print(f"{a.nodes}-node local cluster up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-scale-"))
    script = work / "stand-in.sbatch"
    script.write_text(STAND_IN)
    rows = []
    try:
        for j in a.jobs:
            rows.append(one_point(j, work, script, str(slurm_dir / "etc/slurm.conf"), a.steady))
            print(f"J={j}: done", file=sys.stderr, flush=True)
    finally:
        if not a.keep:
            subprocess.run([str(ROOT / "sbatch/local-cluster/down"), "--purge"], env=env, check=False,
                           stderr=subprocess.DEVNULL)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        print(f"\ngrowth exponent in J (J = {lo['J']} → {hi['J']}; 0 = flat, 1 = linear):")
        for c in ("steady_ms_p50", "cmds_per_cycle", "adopt_ms"):
            if lo[c] > 0 and hi[c] > 0:
                print(f"  {c:16} {math.log(hi[c] / lo[c]) / math.log(hi['J'] / lo['J']):+.2f}")


if __name__ == "__main__":
    main()
