"""Launch the trainer from Python as a Slurm job with submitit.

:func:`submit_run` submits :class:`TrainerJob` — ``rlboost_hpc.run.run`` of a config and run directory — through a
``submitit.AutoExecutor``. The job is requeueable: Slurm's own requeue (``scontrol requeue``, a node failure,
preemption) restarts it with the same job id, and submitit's preemption/timeout signal (USR2) makes it requeue
itself (:meth:`TrainerJob.checkpoint`). Each start runs the same :class:`TrainerJob`, which resumes from the newest
verified checkpoint in the run directory (``trainer.resume = "auto"``), so a requeue loses nothing and trains
nothing twice. The returned ``submitit.Job``'s ``result()`` is the run's report.

Rollout jobs are not submitted here: they stay on the scavenger's ``sbatch`` path (``sbatch/rollout.sbatch``), whose
batch shell traps Slurm's preemption warning and hands unfinished responses over within the grace time — a
pickled Python callable cannot do that from the batch shell, and thousands of short, requeued rollout attempts do
not need submitit's result files.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import submitit

from rlboost_hpc.rundir import RunDir

log = logging.getLogger("rlboost.launch")

SUBMITIT_DIR = "submitit"  # in the run directory: submitit's pickles and the job's stdout/stderr


class TrainerJob(submitit.helpers.Checkpointable):
    """One RLBoost run, callable in a Slurm job: ``config`` (a TOML path, None: built-in defaults) plus
    ``overrides`` (``key=value``, as ``--set``) into ``out_dir``. Returns the report (dict).

    Raises (in the job, surfaced by ``Job.result()``): ConfigError and the run's own errors (``rlboost_hpc.run``).
    """

    def __init__(self, config: str | None, out_dir: str, overrides: list[str] | tuple[str, ...] = ()) -> None:
        self.config, self.out_dir, self.overrides = config, str(out_dir), list(overrides)

    def __call__(self) -> dict:
        """Run (or resume) the run. When Slurm terminates the job (SIGTERM: ``scontrol requeue``, a cancel, the
        end of the grace time) the run's failure that follows — its processes are being killed — is not its
        outcome: the process exits (143) without a result, so a requeued start continues and the client never
        reads a stale failure."""
        from rlboost_hpc.config import load_config
        from rlboost_hpc.observe.logs import setup_logging
        from rlboost_hpc.run import run

        out = Path(self.out_dir)
        run_id = RunDir(out).run_id()
        setup_logging("trainer", run_id=run_id, log_dir=RunDir(out).logs)
        cfg = load_config(self.config, self.overrides)
        terminated = threading.Event()
        before = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame) -> None:
            terminated.set()
            if callable(before):  # submitit's own handler
                before(signum, frame)

        signal.signal(signal.SIGTERM, on_term)
        try:
            return run(cfg, out, progress=False, run_id=run_id)
        except BaseException as e:  # noqa: BLE001 - re-raised unless Slurm is terminating the job
            if not terminated.is_set():
                raise
            log.warning("Slurm terminated the job (%s: %s); exiting without a result: a requeued start resumes "
                        "from the last checkpoint", type(e).__name__, e)
            logging.shutdown()
            os._exit(143)
        finally:
            signal.signal(signal.SIGTERM, before)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on preemption or timeout: requeue the same run (it resumes from its checkpoint)."""
        return submitit.helpers.DelayedSubmission(TrainerJob(self.config, self.out_dir, self.overrides))


def submit_run(config: str | os.PathLike | None, out_dir: str | os.PathLike, *, overrides: list[str] = (),
               partition: str | None = None, timeout_min: int = 24 * 60, cpus_per_task: int | None = None,
               mem_gb: float | None = None, gpus_per_node: int | None = None, signal_delay_s: int = 120,
               slurm_additional_parameters: dict | None = None, **executor_params: Any) -> submitit.Job:
    """Submit the trainer of one run as a requeueable Slurm job; returns the ``submitit.Job`` (``result()``: the
    report). submitit's files and the job's output go to ``out_dir/submitit/``.

    ``timeout_min``: the job's time limit in minutes; submitit sends USR2 ``signal_delay_s`` seconds before it (and
    at preemption), the job requeues itself and resumes. ``gpus_per_node``: the trainer's GPUs (GRES). Further
    ``executor_params`` go to ``AutoExecutor.update_parameters`` (e.g. ``slurm_account``, ``slurm_qos``).

    Raises:
        submitit.core.utils.FailedJobError: sbatch refused the job (message from Slurm).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ex = submitit.AutoExecutor(folder=RunDir(out).root / SUBMITIT_DIR, cluster="slurm")
    params: dict[str, Any] = dict(name="rlboost-train", timeout_min=timeout_min, slurm_signal_delay_s=signal_delay_s,
                                  slurm_additional_parameters={"requeue": True, **(slurm_additional_parameters or {})})
    if partition:
        params["slurm_partition"] = partition
    if cpus_per_task:
        params["cpus_per_task"] = cpus_per_task
    if mem_gb:
        params["mem_gb"] = mem_gb
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    ex.update_parameters(**params, **executor_params)
    return ex.submit(TrainerJob(None if config is None else str(config), str(out), list(overrides)))
