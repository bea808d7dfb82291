"""``rlboost-hpc`` command line: ``run`` (the main job), ``task check``, ``worker``, ``scavenger``, ``stats``,
``simulate``.

Exit codes: 0 success; 1 the run failed (rollout unrecoverable, a service died: :class:`~rlboost_hpc.errors.RunFailed`);
2 bad usage, config or input file (:class:`~rlboost_hpc.errors.BadInput`); 130 interrupted (Ctrl-C); 141 the output
pipe closed before the command wrote everything (``rlboost-hpc stats RUN --json | head -1``), as for any command a
closed pipe ends — quietly, no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: The exit status of a command whose output pipe closed early (128 + SIGPIPE, what a shell reports for a process a
#: closed pipe ended).
EXIT_PIPE_CLOSED = 141


def _cmd_run(args: argparse.Namespace) -> int:
    from rlboost_hpc.config import load_config
    from rlboost_hpc.errors import RunFailed
    from rlboost_hpc.observe.logs import setup_logging
    from rlboost_hpc.observe.report import print_summary
    from rlboost_hpc import interrupts
    from rlboost_hpc.rundir import RunDir
    from rlboost_hpc.run import run

    interrupts.install()  # a Ctrl-C stops the run even when Python swallows it in a finalizer
    cfg = load_config(args.config, args.set + (["trainer.resume='require'"] if args.resume else []))
    rd = RunDir(Path(args.out)).create()
    run_id = rd.run_id()  # set before logging starts: every line carries it
    # on a terminal the progress bar owns the screen: JSON lines (trainer and manager) go to RUN_DIR/logs/ only
    terminal = not args.no_progress and sys.stdout.isatty()
    setup_logging("trainer", level=args.log_level, run_id=run_id, log_dir=rd.logs, console=not terminal)
    try:
        report = run(cfg, rd.root, progress=not args.no_progress, run_id=run_id)
    except RunFailed as e:
        raise RunFailed(f"rollout failed unrecoverably: {e} (see {rd.report})") from None
    print_summary(report)
    for why in report.get("quality_gate_failures", []):  # the run finished; its policy may have collapsed
        print(f"quality gate failed: {why}", file=sys.stderr)
    print(f"report: {rd.report}  metrics: {rd.metrics}  plot: {rd.plot}  logs: {rd.logs}/")
    nothing = _nothing_trained(report)
    if nothing:
        print(f"rlboost-hpc run: {nothing}", file=sys.stderr)
        return 1
    return 0


def _nothing_trained(report: dict) -> str:
    """Why a run that finished its steps trained no response (a failed run, exit 1: every GRPO group was left out
    because a reward component failed on it), with each component's failed calls; "" when it trained."""
    if not report.get("steps") or report.get("responses_trained"):
        return ""
    failed = "; ".join(f"{name}: {t.get('failed', 0)} of {t.get('calls', 0)} calls failed"
                       for name, t in (report.get("reward_functions") or {}).items() if t.get("failed"))
    n = report["steps"]
    return (f"the run trained no response in {n} step{'s' * (n != 1)}: {report.get('responses_left_out', 0)} were left "
            f"out, their GRPO groups' reward components failed (task.rewards.errors = skip){': ' if failed else ''}"
            f"{failed}")


#: What a user interrupting a command (Ctrl-C) can do next, by command.
_AFTER_INTERRUPT = {
    "run": "run the same command again to resume from the last checkpoint",
    "chaos": "the run directory keeps what was done; rerun with --fresh to start over",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlboost-hpc")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from rlboost_hpc import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """The ``rlboost-hpc`` entry point; returns the exit status.

    Every command runs inside one error boundary: :class:`~rlboost_hpc.errors.BadInput` → one line on stderr and
    exit 2, :class:`~rlboost_hpc.errors.RunFailed` → one line and exit 1, Ctrl-C → one line saying what to do next
    and exit 130, a closed output pipe (``| head``) → exit 141 and nothing more — never a traceback for any of them.
    """
    try:
        try:
            return _main(argv)
        finally:  # (also on SystemExit: `--help | head`) a reader that went away shows here, not at the exit
            sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_PIPE_CLOSED


def _main(argv: list[str] | None) -> int:
    """:func:`main` without the closed pipe's handling."""
    from rlboost_hpc.clihelp import DefaultsHelpFormatter
    from rlboost_hpc.errors import BadInput, RunFailed

    p = argparse.ArgumentParser(prog="rlboost-hpc", description="RL training of LLMs with rollout on harvested, "
                                "preemptible cluster capacity (RLBoost).")
    p.add_argument("--version", action="version", version=f"rlboost-hpc {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           help="`rlboost-hpc COMMAND --help` describes each command's flags and their defaults")
    r = sub.add_parser("run", help="run RL training with rollout on (local) preemptible workers",
                       description="Run RL training (GRPO) with rollout on the reserved engine and on preemptible "
                                   "instances; writes report.json, metrics.jsonl, run.png and logs/ into --out.",
                       formatter_class=DefaultsHelpFormatter)
    r.add_argument("--config", help="TOML config; without it, the built-in defaults of rlboost_hpc/config.py (the "
                                    "demo is configs/local.toml: 60 steps, Θ = 32, T_seed = 0.2 s)")
    r.add_argument("--out", default="runs/latest", help="output directory for report.json, metrics.jsonl, run.png")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set trainer.steps=10 (repeatable)")
    r.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="level of the JSON log lines (trainer and manager), always appended to <out>/logs/; on stderr "
                        "too unless a progress bar owns the terminal")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar (JSON log lines go to stderr as well as to <out>/logs/)")
    r.add_argument("--resume", action="store_true",
                   help="resume from the last checkpoint in --out and fail if there is none (= trainer.resume=require)")
    passthrough = {
        "worker": ("run one preemptible rollout instance", "rlboost_hpc.rollout.worker", "main"),
        "scavenger": ("keep preemptible rollout jobs on idle Slurm capacity", "scavenger.cli", "main"),
        "stats": ("preemption and harvesting statistics of a run directory", "scavenger.stats", "stats_main"),
        "simulate": ("discrete-event simulation of RLBoost vs baselines on spot traces", "rlboost_hpc.sim.cli", "main"),
        "chaos": ("run the demo under random preemptions and kills, check the invariants", "rlboost_hpc.chaos",
                  "chaos_main"),
        "launch": ("submit a run to Slurm: the trainer job and the scavenger (sbatch/launch)", "rlboost_hpc.launch",
                   "launch_main"),
        "task": ("`task check --config X`: dry-run your own task (data, prompts, rewards, tools)",
                 "rlboost_hpc.tasks.check", "task_main"),
        "harvest": ("for cluster admins: `harvest check` (can it be harvested), `harvest serve` (the service), "
                    "`harvest report` (what harvesting cost the owners, what the runs got)",
                    "scavenger.harvest_cli", "harvest_main"),
    }
    for name, (help_, _, _) in passthrough.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.cmd not in passthrough and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    prog = f"rlboost-hpc {args.cmd}"
    try:
        if args.cmd in passthrough:
            import importlib

            _, module, func = passthrough[args.cmd]
            return getattr(importlib.import_module(module), func)(rest)
        return _cmd_run(args)
    except BadInput as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return BadInput.exit_status
    except RunFailed as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return RunFailed.exit_status
    except KeyboardInterrupt:
        hint = _AFTER_INTERRUPT.get(args.cmd)
        print(f"\n{prog}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null, so nothing written or flushed later (the interpreter
    flushes at exit) raises again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
