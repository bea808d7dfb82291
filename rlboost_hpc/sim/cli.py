"""``rlboost-hpc simulate``: the discrete-event simulator from the command line.

Modes:

* ``--paper-table`` — every system × model (segments A/B/C of the half-sampled p3 trace); prints the table,
  or JSON with ``--json`` (keys: model → system → ``throughput_ratio_vs_colocated``,
  ``cost_efficiency_ratio_vs_colocated``, ...; see :mod:`rlboost_hpc.sim.table`).
* ``--experiment preemption|lengths`` — migration vs recompute overhead; throughput vs response length.
* default — one run: ``--model``, ``--system``, and either ``--trace`` (+ ``--start``/``--duration``) or
  ``--fixed N``; prints a summary (or ``--json``), ``--timeline FILE`` writes per-step JSON lines.

``--plot FILE`` writes a PNG (table bars or the run's timeline). Exit codes: 0 ok, 2 bad usage or input.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _parser() -> argparse.ArgumentParser:
    from rlboost_hpc.clihelp import DefaultsHelpFormatter, number

    p = argparse.ArgumentParser(prog="rlboost-hpc simulate", description="RLBoost discrete-event simulator",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--paper-table", action="store_true", help="run the paper's table (all systems and models)")
    p.add_argument("--experiment", choices=("preemption", "lengths"), help="run a smaller paper experiment")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--models", default="8b,14b,32b", help="paper table: comma-separated models")
    p.add_argument("--segments", default="A,B,C", help="paper table: comma-separated trace segments")
    p.add_argument("--jobs", type=number(int, at_least=1), default=1, help="paper table: worker processes (results are identical)")
    p.add_argument("--model", default="8b", help="8b | 14b | 32b")
    p.add_argument("--system", default="rlboost", help="colocated | verl_2x | disaggregated | rlboost | rlboost_*")
    p.add_argument("--trace", default="p3", help="p3 | g4dn | parcae-hh|hl|lh|ll | a trace file")
    p.add_argument("--start", type=number(float, at_least=0), default=0.0, help="trace window start, seconds")
    p.add_argument("--duration", type=number(float, above=0), default=None,
                   help="seconds of simulated time (none: 7200 for the table, 43200 for a run)")
    p.add_argument("--fixed", type=number(int, at_least=0), default=None, help="use N never-preempted instances instead of a trace")
    p.add_argument("--keep-every", type=number(int, at_least=1), default=2, help="sample every k-th trace instance (paper: half)")
    p.add_argument("--seed", type=int, default=0, help="seed of response lengths and preemption draws")
    p.add_argument("--timeline", help="write per-step records (JSON lines) to this file")
    p.add_argument("--plot", help="write a PNG plot to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.sim.profiles import profile
    from rlboost_hpc.sim.systems import SYSTEMS

    try:
        if args.paper_table:
            from rlboost_hpc.sim.table import format_table, paper_table

            models = tuple(m.strip().lower() for m in args.models.split(",") if m.strip())
            for m in models:
                profile(m)
            from rlboost_hpc.observe.report import Bar

            t0 = time.perf_counter()
            with Bar(0, "simulated runs", enabled=sys.stdout.isatty(), transient=True) as bar:
                table = paper_table(models, tuple(s.strip() for s in args.segments.split(",") if s.strip()),
                                    duration_s=args.duration or 7200.0, seed=args.seed, jobs=max(1, args.jobs),
                                    on_run=lambda done, total: bar.set(done, total=total))
            table["meta"]["wall_s"] = time.perf_counter() - t0
            if args.plot:
                from rlboost_hpc.sim.plots import plot_table

                plot_table(table, args.plot)
            print(json.dumps(table, indent=2, sort_keys=False) if args.json else format_table(table))
            return 0
        if args.experiment:
            from rlboost_hpc.sim.experiments import length_sweep, preemption_overhead

            profile(args.model)
            res = preemption_overhead(args.model, seed=args.seed) if args.experiment == "preemption" \
                else length_sweep(args.model, seed=args.seed)
            if args.json:
                print(json.dumps(res, indent=2))
            else:
                for k, v in res.items():
                    print(k, {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()})
            return 0
        # single run
        from rlboost_hpc.sim.simulator import simulate
        from rlboost_hpc.sim.workload import Availability, availability

        if args.system not in SYSTEMS:
            print(f"rlboost-hpc simulate: unknown system {args.system!r} (one of: {', '.join(SYSTEMS)})",
                  file=sys.stderr)
            return 2
        prof = profile(args.model)
        if args.system == "verl_2x":
            prof = prof.doubled()
        duration = args.duration or 43200.0
        spec = SYSTEMS[args.system]
        if spec.colocated:
            av = None
        elif args.fixed is not None:
            av = Availability.fixed(args.fixed)
        else:
            av = availability(args.trace, args.start, duration, keep_every=args.keep_every)
        t0 = time.perf_counter()
        res = simulate(prof, spec, av, duration_s=duration, seed=args.seed, model_name=args.model)
        wall = time.perf_counter() - t0
        if args.timeline:
            with open(args.timeline, "w") as fh:
                for rec in res.timeline:
                    fh.write(json.dumps(rec) + "\n")
        if args.plot:
            from rlboost_hpc.sim.plots import plot_timeline

            plot_timeline(res, args.plot)
        if args.json:
            d = res.to_dict(timeline=False)
            d["sim_wall_s"] = wall
            print(json.dumps(d, indent=2))
        else:
            print(f"{res.model} {res.system} on {res.availability}: {res.steps} steps in {res.wall_s / 3600:.2f} h "
                  f"simulated ({wall:.2f} s, {res.events / max(wall, 1e-9):.0f} events/s)")
            print(f"  throughput {res.throughput:.0f} tokens/s, {res.tokens_per_dollar:.0f} tokens/$, "
                  f"${res.cost_usd:.2f} (reserved ${res.reserved_usd:.2f} + remote ${res.remote_usd:.2f}), "
                  f"mean remote instances {res.mean_remote_held:.2f}")
            print(f"  preemptions {res.counters['preemptions']:.0f}, responses migrated "
                  f"{res.counters['responses_migrated']:.0f}, seeds {res.counters['seeds']:.0f}, "
                  f"balancer moves {res.counters['moves_queued'] + res.counters['moves_running']:.0f}")
        return 0
    except (BadInput, ValueError) as e:
        print(f"rlboost-hpc simulate: {e}", file=sys.stderr)
        return BadInput.exit_status


if __name__ == "__main__":
    sys.exit(main())
