"""A week-long run in compressed time: does the rollout manager's memory and scrape time stay bounded? (issue 29 item 4)

Emulated time, real code: one in-process :class:`ManagerCore` (the manager's whole state machine, no sockets) and its
Prometheus collector (:class:`ManagerMetrics`, what the manager's HTTP endpoint serves) are driven with the control
messages of a long run at production churn, as fast as they can be applied: ``--instances`` live rollout instances;
per step a new weight version (SetVersion), ``--pulls-per-step`` verified pulls (WeightsLoaded from instances in
turn), the trainer's StepTimes, and ``--churn`` preemptions (a Deregister with cause ``preempted`` and the requeued
job's next attempt registering). Defaults: 10^5 steps and 10^6 pulls, 10^5 preemptions — a week of ~6 s steps.
No tokens are streamed (``bench_scale.py`` measures the token path); the clock advances 6 s per step.

At each checkpoint (steps 10^2 … 10^5) it prints: the process's resident memory (MiB, psutil); the mean
time of one ``tick`` (liveness + dispatch, what the manager runs every 20 ms) over 200 ticks; one scrape's time
(``refresh`` + ``generate_latest``) and size; the number of instance records the core keeps. Bounded means: flat
after the first checkpoint.

Usage: python benchmarks/bench_week.py [--steps 100000] [--instances 256] [--pulls-per-step 10] [--churn 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import psutil
from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.manager.core import ManagerCore  # noqa: E402
from rlboost_hpc.observe.metrics import ManagerMetrics  # noqa: E402
from rlboost_hpc.protocol import messages as M  # noqa: E402

TRAINER = b"trainer"
STEP_S = 6.0


class Clock:
    """The manager's injected clock: compressed time, advanced by the driver (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def measure(core: ManagerCore) -> dict:
    mm = ManagerMetrics("week")
    reg = CollectorRegistry()
    reg.register(mm)
    t0 = time.perf_counter()
    mm.refresh(core)
    text = generate_latest(reg)
    scrape_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(200):
        core.tick()
    tick_s = (time.perf_counter() - t0) / 200
    core.outbox.clear()
    return dict(mem_mib=psutil.Process().memory_info().rss / 2**20, tick_us=tick_s * 1e6, scrape_ms=scrape_s * 1e3, scrape_kib=len(text) / 1024,
                records=len(core.fleet.instances))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--instances", type=int, default=256)
    ap.add_argument("--pulls-per-step", type=int, default=10)
    ap.add_argument("--churn", type=int, default=1, help="preemptions (and requeued attempts) per step")
    a = ap.parse_args()
    clock = Clock()
    core = ManagerCore(clock=clock)
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    attempt = [0] * a.instances
    peer = [f"p{j}.0".encode() for j in range(a.instances)]
    for j in range(a.instances):
        core.on_message(peer[j], M.Register(job_id=f"job{j}", attempt=0, kind="preemptible", max_batch=64))
        core.on_message(peer[j], M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=0.5, load_s=0.1))
    checkpoints = {10 ** k for k in range(2, 8)} | {a.steps}
    print(f"{a.instances} instances, {a.pulls_per_step} pulls and {a.churn} preemptions per step, {STEP_S:.0f} s "
          f"steps (compressed)")
    print("| steps | pulls | preemptions | RSS MiB | tick µs | scrape ms | scrape KiB | instance records |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    pulls = preempted = 0
    wall0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        clock.t += STEP_S
        core.on_message(TRAINER, M.SetVersion(version=step))
        for k in range(a.pulls_per_step):
            j = (step * a.pulls_per_step + k) % a.instances
            core.on_message(peer[j], M.WeightsLoaded(version=step, checksum=0, nbytes=1, pull_s=0.5 + k * 0.01,
                                                     load_s=0.1))
            pulls += 1
        for k in range(a.churn):
            j = (step * a.churn + k) % a.instances
            core.on_message(peer[j], M.Deregister(reason="preempted", tokens_generated=0, cause="preempted"))
            attempt[j] += 1
            peer[j] = f"p{j}.{attempt[j]}".encode()
            core.on_message(peer[j], M.Register(job_id=f"job{j}", attempt=attempt[j], kind="preemptible",
                                                max_batch=64))
            preempted += 1
        for j in range(a.instances):  # everyone alive speaks once per step (its heartbeats, compressed)
            core.on_message(peer[j], M.Heartbeat(version=step, active=0, tokens_generated=0))
        core.on_message(TRAINER, M.StepTimes(step=step, wall_s=STEP_S, phases={"rollout": 4.0, "train": 2.0},
                                             fixed_overhead_s=0.1))
        core.tick()
        core.outbox.clear()
        if step in checkpoints:
            r = measure(core)
            print(f"| {step:,} | {pulls:,} | {preempted:,} | {r['mem_mib']:.1f} | {r['tick_us']:.0f} | "
                  f"{r['scrape_ms']:.1f} | {r['scrape_kib']:.1f} | {r['records']:,} |", flush=True)
    print(f"driven in {time.perf_counter() - wall0:.0f} s of wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
