"""``rlboost-hpc scavenger RUN_DIR [flags]``: run the scavenger daemon (or one step with ``--once``).

Exit codes: 0 success (``--once``: the step succeeded); 1 ``--once`` step failed (a Slurm command failed —
the message says which and why); 2 bad usage or configuration.
``rlboost-hpc stats`` lives in :mod:`scavenger.stats` (:func:`stats_main`, re-exported here).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from rlboost_hpc.errors import BadInput
from rlboost_hpc.observe.logs import setup_logging
from rlboost_hpc.rundir import RunDir
from scavenger.config import ScavengerConfig, load_scavenger_config
from scavenger.stats import stats_main  # noqa: F401  (re-exported for the main CLI)

_FIELDS = ScavengerConfig.model_fields


def _help(name: str) -> str:
    f = _FIELDS[name]
    return f"{f.description} (default: {f.default if f.default_factory is None else '[]'})"


def build_parser(prog: str = "rlboost-hpc scavenger") -> argparse.ArgumentParser:
    from rlboost_hpc.clihelp import DefaultsHelpFormatter, StrictParser

    p = StrictParser(prog=prog, description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory: target.json in, events.jsonl out")
    p.add_argument("--config", help="TOML file ([scavenger] table or top level); flags override it")
    p.add_argument("--partition", help=_help("partition"))
    p.add_argument("--qos", help=_help("qos"))
    p.add_argument("--account", help=_help("account"))
    p.add_argument("--gpus-per-job", type=int, help=_help("gpus_per_job"))
    p.add_argument("--cpus-per-job", type=int, help=_help("cpus_per_job"))
    p.add_argument("--time-limit", help=_help("time_limit"))
    p.add_argument("--max-jobs", type=int, help=_help("max_jobs"))
    p.add_argument("--grace-s", type=int, help=_help("grace_s"))
    p.add_argument("--signal", help=_help("signal"))
    rq = p.add_mutually_exclusive_group()
    rq.add_argument("--requeue", dest="requeue", action="store_true", default=None, help=_help("requeue"))
    rq.add_argument("--no-requeue", dest="requeue", action="store_false", default=None,
                    help="submit with --no-requeue (preempted jobs do not come back)")
    p.add_argument("--script", help=_help("script"))
    p.add_argument("--job-name-prefix", help=_help("job_name_prefix"))
    p.add_argument("--run-id", help=_help("run_id"))
    p.add_argument("--tag", help=_help("tag"))
    p.add_argument("--log-dir", help=_help("log_dir"))
    p.add_argument("--sbatch-arg", action="append", dest="extra_sbatch_args", metavar="ARG",
                   help="extra sbatch argument, e.g. --sbatch-arg=--mem=8G (repeatable)")
    p.add_argument("--poll-s", type=float, help=_help("poll_s"))
    p.add_argument("--command-timeout-s", type=float, help=_help("command_timeout_s"))
    p.add_argument("--max-backoff-s", type=float, help=_help("max_backoff_s"))
    p.add_argument("--max-submit-per-cycle", type=int, help=_help("max_submit_per_cycle"))
    p.add_argument("--failed-job-backoff-s", type=float, help=_help("failed_job_backoff_s"))
    p.add_argument("--metrics-port", type=int, help=_help("metrics_port"))
    p.add_argument("--metrics-host", help=_help("metrics_host"))
    p.add_argument("--slurm-api", choices=["auto", "cli", "pyslurm"], help=_help("slurm_api"))
    p.add_argument("--harvest-dir", help=_help("harvest_dir"))
    p.add_argument("--harvest-max-age-s", type=float, help=_help("harvest_max_age_s"))
    p.add_argument("--trainer-job", help=_help("trainer_job"))
    p.add_argument("--trainer-pending-release-s", type=float, help=_help("trainer_pending_release_s"))
    p.add_argument("--spot-price-per-gpu-hour", type=float, help=_help("spot_price_per_gpu_hour"))
    p.add_argument("--on-demand-price-per-gpu-hour", type=float, help=_help("on_demand_price_per_gpu_hour"))
    p.add_argument("--once", action="store_true", help="run one reconciliation, print its result as JSON, exit")
    p.add_argument("--check", action="store_true",
                   help="check the flags, the config, the rollout script, the run directory and the harvest spool, "
                        "then exit (0: all good; 2: the first problem, named) without talking to Slurm — what "
                        "sbatch/launch and submit_run run before they submit anything")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once target.json says active=false and no rollout job is left")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="level of the JSON log lines on stderr")
    return p


_KNOBS = ("partition", "qos", "account", "gpus_per_job", "cpus_per_job", "time_limit", "max_jobs", "grace_s",
          "signal", "requeue", "script", "job_name_prefix", "run_id", "tag", "log_dir", "extra_sbatch_args",
          "poll_s", "command_timeout_s", "max_backoff_s", "max_submit_per_cycle", "failed_job_backoff_s",
          "metrics_port", "metrics_host", "slurm_api", "harvest_dir", "harvest_max_age_s", "trainer_job",
          "trainer_pending_release_s",
          "spot_price_per_gpu_hour", "on_demand_price_per_gpu_hour")


#: Each knob's flag, to name a bad value as the command line spelt it.
_FLAGS = {k: "--" + k.replace("_", "-") for k in _KNOBS} | {"extra_sbatch_args": "--sbatch-arg",
                                                           "requeue": "--requeue / --no-requeue"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rlboost-hpc scavenger``; returns the exit code."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        cfg = load_scavenger_config(args.config, _FLAGS, **{k: getattr(args, k) for k in _KNOBS})
        script = cfg.resolved_script()
        RunDir(Path(args.run_dir)).require("the scavenger")  # a mistyped path must not become an empty run
        if cfg.harvest_dir:
            from scavenger.harvest import HarvestSpool

            marker = HarvestSpool(cfg.harvest_dir).require()  # only a spool the cluster's service made
            idle_s = time.time() - marker.cycle_ts
            if idle_s > cfg.harvest_max_age_s:  # (not an error: the service may be restarting)
                print(f"rlboost-hpc scavenger: warning: the harvest service of {cfg.harvest_dir} (pid {marker.pid} "
                      f"on {marker.host}) has run no cycle for "
                      f"{'ever' if not marker.cycle_ts else f'{idle_s:.0f} s'}: is it stopped? The run harvests "
                      "nothing until it is back", file=sys.stderr)
    except BadInput as e:
        print(f"rlboost-hpc scavenger: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"rlboost-hpc scavenger: ok (run {cfg.resolved_run_id(args.run_dir)}, script {script}"
              + (f", harvest spool {cfg.harvest_dir}" if cfg.harvest_dir else "") + ")")
        return 0
    setup_logging("scavenger", level=args.log_level.upper(), run_id=cfg.resolved_run_id(args.run_dir))
    from scavenger.daemon import Scavenger

    from scavenger.pyslurm_api import PyslurmUnavailable

    try:
        daemon = Scavenger(cfg, args.run_dir, script=script)
    except PyslurmUnavailable as e:
        print(f"rlboost-hpc scavenger: {e} (set slurm_api = 'auto' or 'cli')", file=sys.stderr)
        return 2
    if args.once:
        res = daemon.reconcile_once()
        out = {"ok": res.ok, "error": res.error, "desired": res.desired, "live": res.live,
               "pending": res.pending, "running": res.running, "leaving": res.draining,
               "free_slots": res.free_slots, "submitted": res.submitted, "cancelled": res.cancelled,
               "signalled": res.signalled,
               "target": None if res.target is None else {"n_prem": res.target.n, "active": res.target.active,
                                                          "source": res.target.source}}
        print(json.dumps(out))
        if not res.ok:
            print(f"rlboost-hpc scavenger: {res.error}", file=sys.stderr)
        return 0 if res.ok else 1

    def _on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("scavenger").info("scavenger: %s received; stopping (jobs are left running)",
                                            signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if cfg.metrics_port is not None:
        daemon.start_metrics()
    try:
        return daemon.run_forever(exit_when_done=args.exit_when_done)
    finally:
        daemon.close()  # what is queued for the run's experiment trackers


if __name__ == "__main__":
    sys.exit(main())
