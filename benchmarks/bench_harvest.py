"""The harvest service on a local Slurm cluster: Slurm commands per cycle with the service vs one scavenger per run,
and what the idle share left free buys the capacity's owners (issue 30, item 5).

Brings up the project's local cluster with ``--nodes`` nodes (2 fake GPUs each) in its own directory and port base
(beside, never instead of, the 4-node cluster the tests use).

**Part A — Slurm traffic.** For R runs (``--runs``), each wanting one rollout job: R standalone scavengers, then R
scavengers under one harvest service, reconcile until every job runs, then ``--cycles`` steady cycles are counted
(every sinfo / squeue / sbatch / scancel through :class:`scavenger.slurm.SlurmClient`) and timed (the sum of one
cycle of every process).

**Part B — the owners.** One run wants every GPU, under a service whose policy leaves ``idle_share_free`` = f of the
harvestable GPUs idle (``--shares``). A replayed arrival trace of priority jobs (``train`` partition, which preempts
``scavenger``; seeded: exponential inter-arrivals, 1 or 2 GPUs, 10–25 s each) runs for ``--trace-s`` seconds while
the service and the run's scavenger cycle every ``--poll-s``. Printed per f: the owners' wait (start − submit, from
``sacct``: mean, p50, max) — the added wait is the wait beyond what an empty cluster gives (f = 1 would be no
harvesting) — and the GPU-hours the run harvested in the trace window (sacct: elapsed × GPUs of rollout attempts,
clipped to the window) as a share of the cluster's GPU-hours.

**Part C — the share rule against the open anchor** (issue 45). The same recorded trace — four runs arriving at
0, 0, 25 and 50 s with a demand per 12-s step (two large, one medium, one small run; each step's demand is what its
trainer's N_prem law asks for, emulated), and the priority jobs of part B — is replayed once per rule
(``--rules``): ours, weighted max-min, and RLix's demand-proportional split (``share_rule``). Each run's emulated
trainer writes its target at every step boundary as the real one does (keep min(demand, capacity seen), ask for the
demand). Printed per rule: tokens per harvested GPU-hour — an instance produces ``--tokens-per-s`` once it has
warmed up (``--startup-s``: its weight pull) and only while its run has demand for it (emulated instances), so the
figure counts GPU-hours lost to drains, restarts and shares beyond demand —, the owners' wait p50/p99 (sacct start −
eligible), and each late run's wait for its first rollout job (its first attempt's start − its arrival).

The rollout jobs are **stand-ins**: a batch script that, warned (USR2) at a preemption, takes ``--handoff-s``
seconds (an emulated token hand-off) and requeues itself, and drains (exits) when its drain marker exists, as the
real worker does. The owners' jobs sleep for their duration.

Usage: python benchmarks/bench_harvest.py [--nodes 8] [--runs 1 4 16] [--cycles 5] [--shares 0 0.1 0.25]
       [--trace-s 90] [--handoff-s 3] [--rules weighted_max_min demand_proportional] [--rules-trace-s 150]
       [--skip-traffic] [--skip-owners] [--keep]      (starts Slurm daemons: as root)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlboost_hpc.rundir import RunDir  # noqa: E402
from scavenger.config import ScavengerConfig  # noqa: E402
from scavenger.daemon import Scavenger  # noqa: E402
from scavenger.harvest import HarvestService  # noqa: E402
from scavenger.harvest_policy import SitePolicy  # noqa: E402
from bench_slurm_scale import CountingClient  # noqa: E402  (the same counting client)

STAND_IN = """#!/bin/bash
# bench_harvest stand-in rollout job: drain when marked, else hand off for HANDOFF_S seconds and requeue
M="$RLBOOST_RUN_DIR/scavenger/drain/$SLURM_JOB_ID"
on_usr2() {
  if [ -e "$M" ]; then exit 0; fi
  sleep "${HANDOFF_S:-3}"
  scontrol requeue "$SLURM_JOB_ID"
}
trap on_usr2 USR2
while :; do sleep 300 & wait $!; done
"""

OWNER = """#!/bin/bash
sleep "$1"
"""


def _scavenger(work: Path, name: str, n: int, script: Path, conf: str, spool: Path | None,
               handoff_s: float) -> tuple[Scavenger, CountingClient]:
    run_dir = work / name
    run_dir.mkdir()
    cfg = ScavengerConfig(max_jobs=n, gpus_per_job=1, cpus_per_job=1, script=str(script), run_id=name, grace_s=5,
                          max_submit_per_cycle=32, harvest_dir=str(spool) if spool else None,
                          log_dir=str(work / "logs"))
    os.environ["HANDOFF_S"] = str(handoff_s)  # exported to the jobs (--export=ALL)
    client = CountingClient(env={"SLURM_CONF": conf})
    RunDir(run_dir).write_target(n, active=True, step=0)
    return Scavenger(cfg, run_dir, slurm=client), client


def _end(scs: list[Scavenger]) -> None:
    for sc in scs:
        RunDir(sc.run_dir).write_target(0, active=False, step=1)
    deadline = time.monotonic() + 120
    while any(sc.reconcile_once().live for sc in scs):
        if time.monotonic() > deadline:
            raise SystemExit("rollout jobs still live 120 s after their runs ended")
        time.sleep(0.5)


def traffic(r: int, work: Path, script: Path, conf: str, cycles: int, with_service: bool) -> dict:
    """Part A for R runs: Slurm commands and seconds per steady cycle, all processes together."""
    spool = work / f"spool-{r}" if with_service else None
    svc, svc_client = None, None
    if with_service:
        svc_client = CountingClient(env={"SLURM_CONF": conf})
        svc = HarvestService(SitePolicy(spool_dir=str(spool), partitions=["scavenger"]), svc_client)
        svc.spool.create()
    pairs = [_scavenger(work, f"{'svc' if with_service else 'solo'}{r}-{i}", 1, script, conf, spool, 3.0)
             for i in range(r)]
    scs = [s for s, _ in pairs]

    def one_cycle() -> tuple[float, int, int]:
        for _, c in pairs:
            c.calls.clear()
        if svc_client:
            svc_client.calls.clear()
        t0 = time.perf_counter()
        if svc:
            svc.run_cycle()
        running = sum(sc.reconcile_once().running for sc in scs)
        cmds = sum(sum(c.calls.values()) for _, c in pairs) + (sum(svc_client.calls.values()) if svc_client else 0)
        return time.perf_counter() - t0, cmds, running

    deadline = time.monotonic() + 180
    while one_cycle()[2] < r:
        if time.monotonic() > deadline:
            raise SystemExit(f"R={r}: not every run's job running after 180 s")
        time.sleep(0.3)
    steady = [one_cycle() for _ in range(cycles)]
    _end(scs)
    secs = sorted(s for s, _, _ in steady)
    return {"runs": r, "mode": "service" if with_service else "one scavenger per run",
            "slurm_cmds_per_cycle": sum(c for _, c, _ in steady) / cycles, "cycle_ms_p50": 1e3 * secs[len(secs) // 2]}


def trace(seed: int, trace_s: float) -> list[tuple[float, int, float]]:
    """(offset s, GPUs, duration s) of the priority jobs: exponential inter-arrivals (mean 8 s)."""
    rng, t, out = random.Random(seed), 2.0, []
    while t < trace_s:
        out.append((t, rng.choice((1, 2)), rng.uniform(10, 25)))
        t += rng.expovariate(1 / 8)
    return out


def owners(f: float, work: Path, script: Path, conf: str, gpus: int, trace_s: float, poll_s: float,
           handoff_s: float, seed: int) -> dict:
    """Part B at idle share f: the owners' wait and the harvested share of GPU-hours."""
    spool = work / f"spool-f{f}"
    svc = HarvestService(SitePolicy(spool_dir=str(spool), partitions=["scavenger"], idle_share_free=f),
                         CountingClient(env={"SLURM_CONF": conf}))
    svc.spool.create()
    sc, client = _scavenger(work, f"owners-f{int(100 * f)}", gpus, script, conf, spool, handoff_s)
    want = int((1 - f) * gpus + 1e-9)
    deadline = time.monotonic() + 120
    while True:
        svc.run_cycle()
        if sc.reconcile_once().running >= want:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"f={f}: fewer than {want} rollout jobs running after 120 s")
        time.sleep(poll_s)
    owner_script = work / "owner.sh"
    owner_script.write_text(OWNER)
    t_start, ids = time.time(), []
    pending = trace(seed, trace_s)
    while pending or time.time() - t_start < trace_s:
        now = time.time() - t_start
        while pending and pending[0][0] <= now:
            _, g, d = pending.pop(0)
            ids.append(client.run(["sbatch", "--parsable", "--partition=train", f"--gres=gpu:{g}", "--nodes=1",
                                   "--time=5", "--output=/dev/null", f"--job-name=owner-f{f}", str(owner_script),
                                   f"{d:.1f}"]).strip().split(";")[0])
        svc.run_cycle()
        sc.reconcile_once()
        time.sleep(poll_s)
    t_end = time.time()
    while any(j.state != "COMPLETED" for j in
              client.sacct_records(job_ids=ids) if j.step is None) and time.time() - t_end < 90:
        svc.run_cycle()
        sc.reconcile_once()
        time.sleep(poll_s)
    _end([sc])
    time.sleep(2)
    rows = [r for r in client.sacct_records(job_ids=ids) if r.step is None]
    waits = sorted(r.start - r.eligible for r in rows if r.start and r.eligible)
    rollout_ids = [e["job_id"] for e in _events(sc.run_dir) if e["event"] == "submitted"]
    attempts = [r for r in client.sacct_records(job_ids=rollout_ids) if r.step is None and r.start]
    harvested = sum(max(0.0, min(r.end or t_end, t_end) - max(r.start, t_start)) * r.gpus for r in attempts)
    return {"idle_share_free": f, "owner_jobs": len(waits), "owner_wait_mean_s": statistics.fmean(waits),
            "owner_wait_p50_s": waits[len(waits) // 2], "owner_wait_max_s": waits[-1],
            "harvested_gpu_h": harvested / 3600, "harvested_share": harvested / (gpus * (t_end - t_start))}


#: Part C's runs: name, arrival (s), demand range per step (rollout instances), seeded per step.
RULE_RUNS = (("large1", 0.0, (6, 12)), ("large2", 0.0, (6, 12)), ("medium", 25.0, (3, 8)), ("small", 50.0, (1, 2)))
STEP_S = 12.0


def rules_trace(seed: int, trace_s: float) -> dict:
    """The recorded trace of part C: per run its arrival and its demand at every step; the priority jobs."""
    rng = random.Random(seed)
    steps = int(trace_s // STEP_S) + 1
    runs = [{"name": n, "arrive_s": a, "demands": [rng.randint(lo, hi) for _ in range(steps)]}
            for n, a, (lo, hi) in RULE_RUNS]
    return {"step_s": STEP_S, "runs": runs, "owners": trace(seed, trace_s)}


def _demand(run: dict, t: float, step_s: float) -> int:
    """A run's demand at trace time ``t`` (0 before it arrives)."""
    if t < run["arrive_s"]:
        return 0
    return run["demands"][min(len(run["demands"]) - 1, int((t - run["arrive_s"]) // step_s))]


def share_rule(rule: str, tr: dict, work: Path, script: Path, conf: str, trace_s: float, poll_s: float,
               handoff_s: float, startup_s: float, tokens_per_s: float) -> dict:
    """Part C for one rule: replay ``tr``; tokens per harvested GPU-hour, owners' wait, late runs' first-job wait."""
    from rlboost_hpc.rundir import RunDir

    spool = work / f"spool-{rule}"
    svc = HarvestService(SitePolicy(spool_dir=str(spool), partitions=["scavenger"], idle_share_free=0.1,
                                    share_rule=rule), CountingClient(env={"SLURM_CONF": conf}))
    svc.spool.create()
    owner_script = work / "owner.sh"
    owner_script.write_text(OWNER)
    scs: dict[str, Scavenger] = {}
    client = CountingClient(env={"SLURM_CONF": conf})
    step_s, pending, owners_ids = tr["step_s"], list(tr["owners"]), []
    t0, last_step = time.time(), {}
    while time.time() - t0 < trace_s:
        now = time.time() - t0
        for run in tr["runs"]:
            name = f"{rule[:4]}-{run['name']}"
            if now < run["arrive_s"]:
                continue
            if name not in scs:
                scs[name], _ = _scavenger(work, name, 16, script, conf, spool, handoff_s)
                RunDir(scs[name].run_dir).write_target(0, active=True, step=0, wanted=0)
            k = int((now - run["arrive_s"]) // step_s)
            if last_step.get(name) != k:  # a step boundary: the emulated trainer's new target
                last_step[name] = k
                rd, want = RunDir(scs[name].run_dir), _demand(run, now, step_s)
                cap = rd.read_capacity()
                seen = want if cap is None else cap.live_jobs + cap.idle_slots
                rd.write_target(min(want, seen), active=True, step=k, wanted=want, gpus_per_instance=1)
        while pending and pending[0][0] <= now:
            _, g, d = pending.pop(0)
            owners_ids.append(client.run(["sbatch", "--parsable", "--partition=train", f"--gres=gpu:{g}",
                                          "--nodes=1", "--time=5", "--output=/dev/null", f"--job-name=owner-{rule}",
                                          str(owner_script), f"{d:.1f}"]).strip().split(";")[0])
        svc.run_cycle()
        for sc in scs.values():
            sc.reconcile_once()
        time.sleep(poll_s)
    t_end = time.time()
    _end(list(scs.values()))
    time.sleep(2)
    rows = [r for r in client.sacct_records(job_ids=owners_ids) if r.step is None]
    waits = sorted(r.start - r.eligible for r in rows if r.start and r.eligible)
    gpu_s = useful_s = 0.0
    first_wait = {}
    for run in tr["runs"]:
        name = f"{rule[:4]}-{run['name']}"
        ids = [e["job_id"] for e in _events(scs[name].run_dir) if e["event"] == "submitted"] if name in scs else []
        attempts = [r for r in client.sacct_records(job_ids=ids) if r.step is None and r.start] if ids else []
        spans = [(max(r.start, t0), min(r.end or t_end, t_end)) for r in attempts]
        gpu_s += sum(max(0.0, b - a) for a, b in spans)
        dt_ = 0.25
        for i in range(int(trace_s / dt_)):
            t = t0 + i * dt_
            warm = sum(1 for a, b in spans if a + startup_s <= t < b)
            useful_s += min(warm, _demand(run, t - t0, step_s)) * dt_
        if run["arrive_s"] > 0:
            starts = [r.start for r in attempts]
            first_wait[run["name"]] = min(starts) - (t0 + run["arrive_s"]) if starts else float("nan")
    return {"rule": rule, "tokens_per_harvested_gpu_h": tokens_per_s * useful_s / max(gpu_s / 3600, 1e-9),
            "useful_share_of_harvested": useful_s / max(gpu_s, 1e-9), "harvested_gpu_h": gpu_s / 3600,
            "owner_wait_p50_s": waits[len(waits) // 2] if waits else float("nan"),
            "owner_wait_p99_s": waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)] if waits else float("nan"),
            **{f"first_job_wait_{k}_s": v for k, v in first_wait.items()}}


def _events(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    ap.add_argument("--trace-s", type=float, default=90.0)
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--handoff-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--port-base", type=int, default=18900)
    ap.add_argument("--skip-traffic", action="store_true")
    ap.add_argument("--skip-owners", action="store_true")
    ap.add_argument("--rules", nargs="*", default=["weighted_max_min", "demand_proportional"])
    ap.add_argument("--rules-trace-s", type=float, default=150.0)
    ap.add_argument("--startup-s", type=float, default=5.0, help="part C: an instance's warm-up (weight pull)")
    ap.add_argument("--tokens-per-s", type=float, default=2000.0, help="part C: an emulated instance's decode rate")
    ap.add_argument("--save-trace", help="part C: write the recorded trace (JSON) here")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    a = ap.parse_args()
    slurm_dir = Path(f"/tmp/rlboost-slurm-harvest{a.nodes}")
    env = {**os.environ, "RLBOOST_SLURM_DIR": str(slurm_dir), "RLBOOST_SLURM_PORT_BASE": str(a.port_base),
           "RLBOOST_SLURM_NODE_COUNT": str(a.nodes), "RLBOOST_SLURM_UP_TIMEOUT": "300"}
    subprocess.run([str(ROOT / "sbatch/local-cluster/up"), "--quiet"], env=env, check=True)
    conf = str(slurm_dir / "etc/slurm.conf")
    os.environ["SLURM_CONF"] = conf
    work = Path(tempfile.mkdtemp(prefix="bench-harvest-"))
    script = work / "stand-in.sbatch"
    script.write_text(STAND_IN)
    print(f"{a.nodes}-node local cluster ({2 * a.nodes} GPUs), {dt.datetime.now():%Y-%m-%d %H:%M}", flush=True)
    try:
        if not a.skip_traffic:
            rows = []
            for r in a.runs:
                for with_service in (False, True):
                    rows.append(traffic(r, work, script, conf, a.cycles, with_service))
                    print(f"R={r} {'service' if with_service else 'solo'}: done", file=sys.stderr, flush=True)
            print("\nPart A: Slurm commands per steady cycle (every process of the cycle together)")
            _table(rows)
        if not a.skip_owners:
            rows = [owners(f, work, script, conf, 2 * a.nodes, a.trace_s, a.poll_s, a.handoff_s, a.seed)
                    for f in a.shares]
            print(f"\nPart B: the owners' wait and the harvest, {len(trace(a.seed, a.trace_s))} priority jobs in "
                  f"{a.trace_s:.0f} s, hand-off {a.handoff_s:.0f} s (GraceTime 10 s)")
            _table(rows)
        if a.rules:
            tr = rules_trace(a.seed, a.rules_trace_s)
            if a.save_trace:
                Path(a.save_trace).write_text(json.dumps(tr, indent=1))
            rows = [share_rule(r, tr, work, script, conf, a.rules_trace_s, a.poll_s, a.handoff_s, a.startup_s,
                               a.tokens_per_s) for r in a.rules]
            print(f"\nPart C: the share rule on one recorded trace ({len(tr['runs'])} runs, demand per "
                  f"{tr['step_s']:.0f}-s step; {len(tr['owners'])} priority jobs in {a.rules_trace_s:.0f} s; "
                  f"idle share 10 %; emulated instances: {a.tokens_per_s:.0f} tokens/s after a {a.startup_s:.0f}-s "
                  f"warm-up)")
            _table(rows)
    finally:
        if not a.keep:
            subprocess.run([str(ROOT / "sbatch/local-cluster/down"), "--purge"], env=env, check=False,
                           stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
