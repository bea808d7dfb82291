"""Benchmark: simulator speed — events per second and wall time to simulate a 12-hour spot trace on one core.

For each model profile (``--models``) and trace (``--traces``), RLBoost replays ``--hours`` hours of the
half-sampled trace; the co-located baseline runs the same simulated time. Reported per run: simulated steps,
events processed, wall seconds, events/s and the simulated-to-wall speed-up. Goal (issue 6): a 12-hour trace
in under a minute on one core. ``--table`` also times the full paper table (``--jobs`` processes).

Run: ``.venv/bin/python benchmarks/bench_sim.py [--models 8b 14b 32b] [--traces p3 g4dn] [--hours 12]
[--repeat 3] [--table] [--jobs 1] [--json]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.sim.profiles import profile  # noqa: E402
from rlboost_hpc.sim.simulator import simulate  # noqa: E402
from rlboost_hpc.sim.systems import COLOCATED, RLBOOST  # noqa: E402
from rlboost_hpc.sim.workload import availability  # noqa: E402

GOAL_S = 60.0


def bench_run(model: str, trace: str | None, hours: float, repeat: int) -> dict:
    p = profile(model)
    dur = hours * 3600.0
    av = availability(trace, 0.0, dur) if trace else None
    system = RLBOOST if trace else COLOCATED
    walls = []
    res = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = simulate(p, system, av, duration_s=dur)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    return {"model": model, "system": system.name, "trace": trace or "none", "hours": hours, "steps": res.steps,
            "events": res.events, "wall_s": wall, "events_per_s": res.events / wall,
            "speedup": res.wall_s / wall, "meets_goal": wall < GOAL_S,
            "throughput_tokens_per_s": res.throughput}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["8b", "14b", "32b"])
    ap.add_argument("--traces", nargs="+", default=["p3", "g4dn"])
    ap.add_argument("--hours", type=float, default=12.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--table", action="store_true", help="also time the whole paper table")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for m in args.models:
        for tr in [None, *args.traces]:
            rows.append(bench_run(m, tr, args.hours, args.repeat))
            r = rows[-1]
            if not args.json:
                print(f"{r['model']:>4s} {r['system']:10s} {r['trace']:5s} {r['hours']:.0f} h: {r['steps']:4d} steps "
                      f"{r['events']:7d} events in {r['wall_s']:6.2f} s = {r['events_per_s']:8.0f} events/s, "
                      f"{r['speedup']:7.0f}x real time {'OK' if r['meets_goal'] else 'SLOW'}")
    out = {"runs": rows}
    if args.table:
        from rlboost_hpc.sim.table import paper_table

        t0 = time.perf_counter()
        paper_table(jobs=args.jobs)
        out["paper_table_wall_s"] = time.perf_counter() - t0
        if not args.json:
            print(f"paper table (3 models × all systems, jobs={args.jobs}): {out['paper_table_wall_s']:.1f} s")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0 if all(r["meets_goal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
