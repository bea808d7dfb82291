"""``rlboost-hpc`` command line: ``run`` (the main job), ``worker``, ``scavenger``, ``stats``, ``simulate``.

Exit codes: 0 success; 1 the run failed (rollout unrecoverable, a service died); 2 bad usage or config.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from rlboost_hpc.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set + (["trainer.resume='require'"] if args.resume else []))
    except ConfigError as e:
        print(f"rlboost-hpc: {e}", file=sys.stderr)
        return 2
    from rlboost_hpc.observe.logs import setup_logging
    from rlboost_hpc.observe.report import print_summary
    from rlboost_hpc.cluster.traces import TraceFormatError
    from rlboost_hpc.models.arch import ModelFormatError
    from rlboost_hpc.models.device import DeviceError
    from rlboost_hpc.paths import DataFileMissing
    from rlboost_hpc.rundir import RunDir
    from rlboost_hpc.run import run
    from rlboost_hpc.trainer.client import ManagerError
    from rlboost_hpc.trainer.loop import RolloutFailed
    from rlboost_hpc.manager.journal import JournalError
    from rlboost_hpc.trainer.checkpoint import CheckpointError

    import os

    out = Path(args.out)
    run_id = os.environ.get("RLBOOST_RUN_ID") or out.resolve().name
    setup_logging("trainer", level=args.log_level, run_id=run_id)
    try:
        report = run(cfg, out, progress=not args.no_progress, run_id=run_id)
    except (ConfigError, DataFileMissing, ModelFormatError, DeviceError, TraceFormatError, CheckpointError,
            JournalError) as e:
        print(f"rlboost-hpc: {e}", file=sys.stderr)
        return 2
    except (RolloutFailed, ManagerError) as e:
        print(f"rlboost-hpc: rollout failed unrecoverably: {e} (see {RunDir(out).report})", file=sys.stderr)
        return 1
    print_summary(report)
    rd = RunDir(out)
    print(f"report: {rd.report}  metrics: {rd.metrics}  plot: {rd.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlboost-hpc", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run RL training with rollout on (local) preemptible workers")
    r.add_argument("--config", help="TOML config (default: the built-in defaults of rlboost_hpc/config.py; the demo "
                                    "is configs/local.toml: 60 steps, Θ = 32, T_seed = 0.2 s)")
    r.add_argument("--out", default="runs/latest", help="output directory for report.json, metrics.jsonl, run.png")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set trainer.steps=10 (repeatable)")
    r.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--resume", action="store_true",
                   help="resume from the last checkpoint in --out and fail if there is none (= trainer.resume=require)")
    passthrough = {
        "worker": ("run one preemptible rollout instance", "rlboost_hpc.rollout.worker", "main"),
        "scavenger": ("keep preemptible rollout jobs on idle Slurm capacity", "scavenger.cli", "main"),
        "stats": ("preemption and harvesting statistics of a run directory", "scavenger.stats", "stats_main"),
        "simulate": ("discrete-event simulation of RLBoost vs baselines on spot traces", "rlboost_hpc.sim.cli", "main"),
        "chaos": ("run the demo under random preemptions and kills, check the invariants", "rlboost_hpc.chaos",
                  "chaos_main"),
    }
    for name, (help_, _, _) in passthrough.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.cmd in passthrough:
        import importlib

        _, module, func = passthrough[args.cmd]
        return getattr(importlib.import_module(module), func)(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return _cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
