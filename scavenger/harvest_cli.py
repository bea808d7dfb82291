"""rlboost-hpc harvest: the cluster admin's commands (check, serve, report).

- ``harvest check [--partition P] [--json]``: can this cluster's idle GPUs be harvested, partition by partition
  (:mod:`scavenger.check`);
- ``harvest serve --policy FILE [--spool DIR] [--once] [--status FILE]``: the cluster's one harvest service
  (:mod:`scavenger.harvest`): runs that pass ``--harvest-dir SPOOL`` to their scavenger share the idle GPUs under
  the site policy (:mod:`scavenger.harvest_policy`);
- ``harvest report [--since T | --days D] [--json] [--plot PNG] [--run-dir DIR ...]``: what harvesting cost the
  owners of the capacity (their jobs' delay) and what each account and run harvested, from ``sacct``, with the
  tokens of the runs whose directories are given (:mod:`scavenger.harvest_report`).

Exit codes: 0 success; 1 Slurm did not answer (``check``, ``report``; ``serve --once``: the cycle failed); 2 bad usage, a bad
site policy (the message names the file and key), or a partition that cannot be harvested (``check``).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

import msgspec

__all__ = ["harvest_main"]


def _parser() -> argparse.ArgumentParser:
    from rlboost_hpc.clihelp import DefaultsHelpFormatter, StrictParser

    p = StrictParser(prog="rlboost-hpc harvest", description=__doc__.splitlines()[0],
                     formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="say, per partition, whether and how rollout jobs can harvest it",
                       description="Say, per partition, whether and how rollout jobs can harvest it: preemption "
                                   "type and mode, the requeue partition, whether a preemption warning reaches the "
                                   "job (preempt_send_user_signal), grace time, GRES; and what is missing. Exit 0: "
                                   "harvestable; 2 (with --partition): that partition cannot be harvested.",
                       formatter_class=DefaultsHelpFormatter)
    c.add_argument("--partition", help="judge this partition only (exit 2 when it cannot be harvested)")
    c.add_argument("--json", action="store_true", help="machine-readable findings")
    s = sub.add_parser("serve", help="run the cluster's harvest service: share idle GPUs between runs",
                       description="Run the cluster's harvest service: every cycle, share the idle GPUs between "
                                   "the runs that ask for them (the site policy's share rule, limits and blackouts) "
                                   "and tell each run's scavenger its share through the spool directory.",
                       formatter_class=DefaultsHelpFormatter)
    s.add_argument("--policy", help="the site policy (TOML; [harvest] table or top level); none: the defaults")
    s.add_argument("--spool", help="spool directory (overrides the policy's spool_dir)")
    s.add_argument("--poll-s", type=float, help="seconds between cycles (overrides the policy's poll_s)")
    s.add_argument("--once", action="store_true", help="one cycle; print its result as JSON; exit")
    s.add_argument("--status", help="write each cycle's result (JSON) to this file")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    s.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="level of the JSON log lines")
    r = sub.add_parser("report", help="what harvesting cost the owners (their delay) and what the runs harvested",
                       description="What harvesting cost the owners of the capacity (how long their jobs waited "
                                   "behind rollout jobs) and what the runs harvested (GPU-hours, tokens), over a "
                                   "window of Slurm's accounting (sacct).",
                       formatter_class=DefaultsHelpFormatter)
    r.add_argument("--policy", help="the site policy (rollout job prefix, prices); none: the defaults")
    r.add_argument("--since", help="start of the window (sacct --starttime, e.g. 2026-12-01T00:00:00)")
    r.add_argument("--days", type=float, default=1.0, help="window length back from now when --since is not given")
    r.add_argument("--json", action="store_true", help="the report as JSON")
    r.add_argument("--plot", metavar="PNG", help="draw the owners' delays and the harvested GPU-hours")
    r.add_argument("--run-dir", action="append", default=[], metavar="RUN_DIR",
                   help="add the tokens this run produced on harvested capacity (repeatable)")
    return p


def _report(a: argparse.Namespace) -> int:
    import datetime as dt

    from scavenger.harvest import HarvestService
    from scavenger.harvest_policy import HarvestPolicyError, load_site_policy
    from rlboost_hpc.errors import BadInput
    from scavenger.harvest_report import add_run_tokens, format_report
    from scavenger.slurm import SlurmClient, SlurmCommandError

    try:
        policy = load_site_policy(a.policy)
    except HarvestPolicyError as e:
        print(f"rlboost-hpc harvest report: {e}", file=sys.stderr)
        return 2
    if a.since is not None:
        try:
            since = dt.datetime.fromisoformat(a.since).strftime("%Y-%m-%dT%H:%M:%S")
        except ValueError:
            print(f"rlboost-hpc harvest report: --since {a.since!r}: not a time (use YYYY-MM-DD[THH:MM[:SS]])",
                  file=sys.stderr)
            return 2
    elif not (0 < a.days < 36500):
        print(f"rlboost-hpc harvest report: --days {a.days:g}: must be a number of days > 0", file=sys.stderr)
        return 2
    else:
        since = (dt.datetime.now() - dt.timedelta(days=a.days)).strftime("%Y-%m-%dT%H:%M:%S")
    try:
        rep = HarvestService(policy, SlurmClient(timeout_s=policy.command_timeout_s)).owners_report(since)
    except SlurmCommandError as e:
        print(f"rlboost-hpc harvest report: {e}", file=sys.stderr)
        return 1
    try:
        add_run_tokens(rep, a.run_dir)
    except (OSError, BadInput) as e:
        print(f"rlboost-hpc harvest report: --run-dir: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep.to_json(), indent=1) if a.json else format_report(rep))
    if a.plot:
        from scavenger.harvest_report import plot_report

        plot_report(rep, a.plot)
    return 0


def _serve(a: argparse.Namespace) -> int:
    from rlboost_hpc.observe.logs import setup_logging
    from scavenger.harvest import HarvestService, HarvestSpool, SpoolBusy
    from scavenger.harvest_policy import HarvestPolicyError, load_site_policy, unknown_names
    from scavenger.slurm import SlurmClient, SlurmCommandError

    try:
        policy = load_site_policy(a.policy, spool_dir=a.spool, poll_s=a.poll_s)
    except HarvestPolicyError as e:
        print(f"rlboost-hpc harvest serve: {e}", file=sys.stderr)
        return 2
    setup_logging("harvest", level=a.log_level)
    spool = HarvestSpool(policy.spool_dir)
    try:  # first of all: one service per spool
        spool.claim()
    except SpoolBusy as e:
        print(f"rlboost-hpc harvest serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"rlboost-hpc harvest serve: spool_dir {policy.spool_dir}: {e}", file=sys.stderr)
        return 2
    client = SlurmClient(timeout_s=policy.command_timeout_s)
    try:  # a policy naming what Slurm does not know would harvest nothing there, silently: refuse it
        problems = unknown_names(policy, client.partition_names(), client.accounting_names("qos"),
                                 client.accounting_names("account"))
    except SlurmCommandError as e:
        print(f"rlboost-hpc harvest serve: Slurm did not answer: {e}", file=sys.stderr)
        return 1
    if problems:
        where = a.policy or "the default site policy"
        print("\n".join(f"rlboost-hpc harvest serve: {where}: {x}" for x in problems), file=sys.stderr)
        return 2
    service = HarvestService(policy, client, spool=spool)
    try:
        spool.create()
    except OSError as e:
        print(f"rlboost-hpc harvest serve: spool_dir {policy.spool_dir}: {e}", file=sys.stderr)
        return 2
    if a.once:
        res = service.run_cycle()
        print(json.dumps(msgspec.to_builtins(res)))
        return 0 if res.ok else 1
    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("scavenger.harvest").info("harvest: %s received; stopping after this cycle (the runs keep "
                                                    "their jobs and submit nothing new until a service is back)",
                                                    signal.Signals(signum).name)
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    metrics = None
    if a.metrics_port is not None:
        from rlboost_hpc.observe.metrics import serve_metrics
        from scavenger.metrics import HarvestMetrics

        metrics = HarvestMetrics()
        host, port = serve_metrics(metrics, host=a.metrics_host, port=a.metrics_port)
        logging.getLogger("scavenger.harvest").info("harvest: metrics at http://%s:%d/metrics", host, port)
    return service.serve(status_path=Path(a.status) if a.status else None, metrics=metrics)


def harvest_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rlboost-hpc harvest``; returns the exit code (module docstring)."""
    a = _parser().parse_args(list(argv) if argv is not None else None)
    if a.cmd == "check":
        from scavenger.check import check_main

        return check_main(a.partition, a.json)
    return _report(a) if a.cmd == "report" else _serve(a)


if __name__ == "__main__":
    sys.exit(harvest_main())
