"""Launch a run on Slurm — the trainer job and the scavenger that keeps rollout jobs on idle capacity — from the
shell or from Python; both give the same run.

From the shell, ``rlboost-hpc launch RUN_DIR CONFIG [options] [-- scavenger options]`` (:func:`launch_main`) runs
the shipped ``sbatch/launch`` with the interpreter it runs in, so an installed wheel or an unactivated virtual
environment launches jobs that can import the project.

From Python, :func:`submit_run` submits :class:`TrainerJob` — ``rlboost_hpc.run.run`` of a config and run
directory, as a Slurm run (:data:`SLURM_RUN`, what ``sbatch/train.sbatch`` sets) — through a
``submitit.AutoExecutor``, then starts the scavenger in the background (its log ``RUN_DIR/logs/scavenger.log``,
its pid ``RUN_DIR/scavenger.pid``). The job is requeueable: Slurm's own requeue (``scontrol requeue``, a node failure,
preemption) restarts it with the same job id, and submitit's preemption/timeout signal (USR2) makes it requeue
itself (:meth:`TrainerJob.checkpoint`). Each start runs the same :class:`TrainerJob`, which resumes from the newest
verified checkpoint in the run directory (``trainer.resume = "auto"``), so a requeue loses nothing and trains
nothing twice. The returned :class:`LaunchedRun`'s ``result()`` is the run's report.

Rollout jobs are the scavenger's to submit, on its ``sbatch`` path (``sbatch/rollout.sbatch``), whose
batch shell traps Slurm's preemption warning and hands unfinished responses over within the grace time — a
pickled Python callable cannot do that from the batch shell, and thousands of short, requeued rollout attempts do
not need submitit's result files.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import submitit

from rlboost_hpc.paths import shipped
from rlboost_hpc.rundir import RunDir

log = logging.getLogger("rlboost.launch")

SUBMITIT_DIR = "submitit"  # in the run directory: submitit's pickles and the job's stdout/stderr
#: The overrides that make a config a Slurm run (``sbatch/train.sbatch`` sets the same two): rollout capacity comes
#: from the scavenger's jobs, and the trainer's sockets listen on every interface for rollout nodes to dial. A
#: user's own overrides come after them, so either can still be changed.
SLURM_RUN = ("cluster.kind='slurm'", "network.bind_host='0.0.0.0'")


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


@dataclass
class LaunchedRun:
    """A run started by :func:`submit_run`: the trainer's submitit ``job`` (``job_id``, ``done()``, ``result()`` =
    the report) and the ``scavenger`` process keeping rollout jobs on the scavenger partition (``None`` when
    :func:`submit_run` was told not to start one)."""

    job: submitit.Job
    scavenger: subprocess.Popen | None
    run_dir: Path

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def done(self) -> bool:
        return self.job.done()

    def result(self) -> dict:
        """The run's report (blocks until the trainer job ends). Raises what the run raised (submitit's
        ``FailedJobError`` carries it)."""
        return self.job.result()

    def wait_scavenger(self, timeout_s: float | None = None) -> int | None:
        """Wait for the scavenger to exit (it does once the run is over and its rollout jobs are gone); its exit
        status, ``None`` without one. Raises ``subprocess.TimeoutExpired`` after ``timeout_s``."""
        return None if self.scavenger is None else self.scavenger.wait(timeout_s)

    def cancel(self) -> None:
        """Cancel the trainer job and end the harvesting: ``target.json`` says the run is over, so the scavenger
        drains its rollout jobs and exits on its own."""
        self.job.cancel(check=False)
        RunDir(self.run_dir).write_target(0, active=False, step=-1)


def start_scavenger(run_dir: str | os.PathLike, args: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``rlboost-hpc scavenger RUN_DIR --exit-when-done ARGS`` in the background, in its own session (it
    outlives this process, as ``sbatch/launch --detach`` does), with this interpreter for the rollout jobs
    (``RLBOOST_PYTHON``); output appended to ``RUN_DIR/logs/scavenger.log``, pid in ``RUN_DIR/scavenger.pid``."""
    rd = RunDir(Path(run_dir))
    rd.logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(rd.root), "--script",
           str(shipped("sbatch/rollout.sbatch")), "--log-dir", str(rd.logs), "--exit-when-done", *args]
    with open(rd.scavenger_log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "RLBOOST_PYTHON": os.environ.get("RLBOOST_PYTHON", sys.executable)},
                                start_new_session=True)
    rd.scavenger_pid.write_text(f"{proc.pid}\n")
    return proc


def submit_run(config: str | os.PathLike | None, out_dir: str | os.PathLike, *, overrides: Sequence[str] = (),
               scavenger: bool | Sequence[str] = True, partition: str | None = None, timeout_min: int = 24 * 60,
               cpus_per_task: int | None = None, mem_gb: float | None = None, gpus_per_node: int | None = None,
               signal_delay_s: int = 120, slurm_additional_parameters: dict | None = None,
               **executor_params: Any) -> LaunchedRun:
    """Submit one run as ``sbatch/launch`` does: the trainer as a requeueable Slurm job (a Slurm run:
    :data:`SLURM_RUN`, then ``overrides``) and the scavenger, which keeps rollout jobs on idle capacity of the
    scavenger partition. submitit's files and the trainer's output go to ``out_dir/submitit/``.

    ``scavenger``: ``True`` starts it with its defaults, a sequence of ``rlboost-hpc scavenger`` flags starts it
    with those (e.g. ``["--partition", "scavenger", "--max-jobs", "8"]``), ``False`` starts none (run one yourself:
    ``rlboost-hpc scavenger RUN_DIR``). ``timeout_min``: the trainer's time limit in minutes; submitit sends USR2
    ``signal_delay_s`` seconds before it (and at preemption), the job requeues itself and resumes.
    ``gpus_per_node``: the trainer's GPUs (GRES). Further ``executor_params`` go to
    ``AutoExecutor.update_parameters`` (e.g. ``slurm_account``, ``slurm_qos``).

    Raises:
        submitit.core.utils.FailedJobError: sbatch refused the trainer job (message from Slurm).
        RunDirError: ``out_dir`` cannot be a run directory.
    """
    rd = RunDir(Path(out_dir)).create()
    ex = submitit.AutoExecutor(folder=rd.root / SUBMITIT_DIR, cluster="slurm")
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
    job = ex.submit(TrainerJob(None if config is None else str(config), str(rd.root), [*SLURM_RUN, *overrides]))
    scav = None
    if scavenger is not False:
        scav = start_scavenger(rd.root, () if scavenger is True else list(scavenger))
    return LaunchedRun(job=job, scavenger=scav, run_dir=rd.root)


def launch_main(argv: Sequence[str]) -> int:
    """``rlboost-hpc launch RUN_DIR CONFIG [options] [-- scavenger options]``: the shipped ``sbatch/launch`` (its
    usage with no arguments), run with this interpreter for the jobs unless ``RLBOOST_PYTHON`` says otherwise.
    Replaces this process; returns only if the script cannot be started."""
    script = shipped("sbatch/launch")
    env = {**os.environ, "RLBOOST_PYTHON": os.environ.get("RLBOOST_PYTHON", sys.executable)}
    os.execve("/bin/bash", ["/bin/bash", str(script), *argv], env)
    return 1  # (not reached)
