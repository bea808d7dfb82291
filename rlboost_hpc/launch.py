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

Both check everything on the submitting host before they submit anything (:func:`preflight`): the run config with
the trainer's overrides (exit 2 naming the file or key), the run directory, and the scavenger's flags (its own
``--check``: flags, rollout script, harvest spool); nothing is submitted and nothing is left running when one is
wrong. The trainer's job is named ``rlboost-train-<run id>``, as the rollout jobs carry the run id, and the scavenger
is told its job id (``--trainer-job``): a trainer that fails ends the run's harvesting at the next reconciliation.

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

from rlboost_hpc.errors import BadInput
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


#: Name of the trainer's Slurm job; the run id follows (the rollout jobs are ``rlboost-rollout-<run id>``).
TRAIN_JOB_PREFIX = "rlboost-train-"


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found: the config file as it will be read (absolute; ``None``: the built-in
    defaults), the run directory (absolute, created) and the run id its jobs carry."""

    config: Path | None
    run_dir: Path
    run_id: str


def preflight(config: str | os.PathLike | None, out_dir: str | os.PathLike,
              overrides: Sequence[str] = ()) -> Preflight:
    """Check a run on the submitting host before anything is submitted: the config file (a relative path that is
    not a file here is the shipped config of that name, as for ``rlboost-hpc run``), loaded with the Slurm run's
    overrides and ``overrides`` (``key=value``) and validated; the run directory (created).

    Raises:
        BadInput: the config (ConfigError: the file, or the key and where its value came from) or the run
            directory (RunDirError) is wrong — exit status 2, nothing submitted.
    """
    from rlboost_hpc.config import load_config, resolve_config_file

    path = None if config is None else resolve_config_file(Path(config)).resolve()
    load_config(path, [*SLURM_RUN, *overrides])
    rd = RunDir(Path(out_dir)).create()
    return Preflight(path, rd.root.resolve(), rd.run_id())


def scavenger_command(run_dir: str | os.PathLike, args: Sequence[str] = ()) -> list[str]:
    """The scavenger a launch starts: ``rlboost-hpc scavenger RUN_DIR`` with the shipped rollout script, logs in
    ``RUN_DIR/logs``, ``--exit-when-done`` and ``args``, run by this interpreter."""
    rd = RunDir(Path(run_dir))
    return [sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(rd.root), "--script",
            str(shipped("sbatch/rollout.sbatch")), "--log-dir", str(rd.logs), "--exit-when-done", *args]


def check_scavenger(run_dir: str | os.PathLike, args: Sequence[str] = ()) -> None:
    """Run the scavenger's own ``--check`` with the flags a launch will start it with (its flags, config, rollout
    script, run directory and harvest spool; no Slurm call). Raises BadInput with its one-line message."""
    p = subprocess.run([*scavenger_command(run_dir, args), "--check"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        raise BadInput(f"scavenger flags {' '.join(args) or '(none)'}: {lines[-1] if lines else p.returncode}")


def start_scavenger(run_dir: str | os.PathLike, args: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``rlboost-hpc scavenger RUN_DIR --exit-when-done ARGS`` (:func:`scavenger_command`) in the background,
    in its own session (it outlives this process, as ``sbatch/launch --detach`` does), with this interpreter for the
    rollout jobs (``RLBOOST_PYTHON``); output appended to ``RUN_DIR/logs/scavenger.log``, pid in
    ``RUN_DIR/scavenger.pid``."""
    rd = RunDir(Path(run_dir))
    rd.logs.mkdir(parents=True, exist_ok=True)
    cmd = scavenger_command(rd.root, args)
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

    Everything is checked before anything is submitted (:func:`preflight` and the scavenger's ``--check``); the
    trainer's job is named ``rlboost-train-<run id>`` and the scavenger watches it (``--trainer-job``).

    Raises:
        BadInput: the config (ConfigError, naming the file or key), ``out_dir`` (RunDirError) or a scavenger flag
            is wrong — nothing was submitted.
        submitit.core.utils.FailedJobError: sbatch refused the trainer job (message from Slurm).
    """
    pre = preflight(config, out_dir, overrides)
    scav_args = None if scavenger is False else [] if scavenger is True else list(scavenger)
    if scav_args is not None:
        check_scavenger(pre.run_dir, scav_args)
    rd = RunDir(pre.run_dir)
    ex = submitit.AutoExecutor(folder=rd.root / SUBMITIT_DIR, cluster="slurm")
    params: dict[str, Any] = dict(name=TRAIN_JOB_PREFIX + pre.run_id, timeout_min=timeout_min,
                                  slurm_signal_delay_s=signal_delay_s,
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
    job = ex.submit(TrainerJob(None if pre.config is None else str(pre.config), str(rd.root),
                               [*SLURM_RUN, *overrides]))
    scav = None
    if scav_args is not None:
        scav = start_scavenger(rd.root, ["--trainer-job", str(job.job_id), *scav_args])
    return LaunchedRun(job=job, scavenger=scav, run_dir=rd.root)


def launch_main(argv: Sequence[str]) -> int:
    """``rlboost-hpc launch RUN_DIR CONFIG [options] [-- scavenger options]``: the shipped ``sbatch/launch`` (its
    usage with no arguments), run with this interpreter for the jobs unless ``RLBOOST_PYTHON`` says otherwise.
    Replaces this process; returns only if the script cannot be started."""
    script = shipped("sbatch/launch")
    env = {**os.environ, "RLBOOST_PYTHON": os.environ.get("RLBOOST_PYTHON", sys.executable)}
    os.execve("/bin/bash", ["/bin/bash", str(script), *argv], env)
    return 1  # (not reached)


def _preflight_main(argv: Sequence[str]) -> int:
    """``python -m rlboost_hpc.launch preflight RUN_DIR CONFIG``, what ``sbatch/launch`` runs before it submits: the
    trainer's overrides come from ``RLBOOST_TRAIN_ARGS`` (``--set key=value`` words, as ``train.sbatch`` splits
    them). Prints ``config=<path>`` and ``run_id=<id>``; bad input: one line on stderr, exit 2."""
    if len(argv) != 2:
        print("usage: python -m rlboost_hpc.launch preflight RUN_DIR CONFIG", file=sys.stderr)
        return 2
    words = os.environ.get("RLBOOST_TRAIN_ARGS", "").split()
    overrides = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    try:
        pre = preflight(argv[1], argv[0], overrides)
    except BadInput as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    print(f"config={pre.config}\nrun_id={pre.run_id}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["preflight"]:
        print("usage: python -m rlboost_hpc.launch preflight RUN_DIR CONFIG (use `rlboost-hpc launch` to launch)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_preflight_main(sys.argv[2:]))
