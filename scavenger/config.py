"""Scavenger daemon configuration (pydantic, strict: unknown keys are errors).

Invariants: every knob has a unit in its name or description; the warning signal is never USR1 (NCCL
installs its own SIGUSR1 handler); :meth:`ScavengerConfig.sbatch_args` is the only place the
submission command line is built, so what the daemon submits is what the tests check.
"""
from __future__ import annotations

import hashlib

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from rlboost_hpc.errors import BadInput
from rlboost_hpc.rundir import RunDir
from scavenger.slurm_records import signal_number


_M = TypeVar("_M", bound=BaseModel)


class ScavengerConfigError(BadInput, ValueError):
    """The scavenger configuration is invalid (bad value, unknown key, unreadable file)."""


class ScavengerConfig(BaseModel):
    """What the daemon submits and how many. Defaults fit the local cluster of ``sbatch/local-cluster/up``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    partition: str = Field("scavenger", min_length=1, description="low-priority, preemptible partition")
    qos: str | None = Field(None, description="sbatch --qos (optional)")
    account: str | None = Field(None, description="sbatch --account (optional)")
    gpus_per_job: int = Field(1, ge=0, description="GPUs per rollout job (--gres=gpu:N); 0 = CPU-only job")
    cpus_per_job: int = Field(1, ge=1, description="CPUs per rollout job (--cpus-per-task)")
    time_limit: str = Field("1:00:00", description="sbatch --time ([D-]HH:MM:SS or minutes)")
    max_jobs: int = Field(4, ge=0, description="upper bound on live rollout jobs (target when no target.json)")
    grace_s: int = Field(15, ge=1, description=(
        "seconds of warning: --signal=B:<signal>@<grace_s> before the time limit, and how long a surplus job "
        "has between the drain signal and a plain scancel"))
    signal: str = Field("USR2", description="warning signal sent to the batch shell (never USR1: NCCL takes it)")
    requeue: bool = Field(True, description="submit with --requeue (preempted jobs come back)")
    script: str = Field("sbatch/rollout.sbatch", description="the rollout sbatch script (relative: from the cwd, "
                                                             "else the one rlboost-hpc ships)")
    job_name_prefix: str = Field("rlboost-rollout-", description="job name = prefix + run id")
    run_id: str | None = Field(None, description=(
        "run id in job names, metrics and logs (default: the run's own id, as the trainer has it: $RLBOOST_RUN_ID, "
        "else the run directory's name)"))
    tag: str | None = Field(None, description=(
        "--comment tag that marks our jobs (default rlboost:<run_id>@<hash of the run directory's path>)"))
    log_dir: str | None = Field(None, description="job stdout/stderr directory (default RUN_DIR/scavenger/logs)")
    extra_sbatch_args: list[str] = Field(default_factory=list, description="appended to every sbatch call")
    poll_s: float = Field(5.0, gt=0, description="seconds between reconciliations")
    command_timeout_s: float = Field(15.0, gt=0, description="timeout of each Slurm command, seconds")
    max_backoff_s: float = Field(60.0, gt=0, description="longest wait after repeated command failures, s")
    max_submit_per_cycle: int = Field(16, ge=1, description="most sbatch calls in one reconciliation")
    failed_job_backoff_s: float = Field(30.0, ge=0, description=(
        "base pause of submissions after a rollout job FAILED soon after starting (doubles per consecutive "
        "failure, up to max_backoff_s) — stops a crash loop from hammering the scheduler"))
    metrics_port: int | None = Field(None, ge=0, le=65535, description=(
        "serve Prometheus metrics on this port (0: a free one; the URL goes to RUN_DIR/scavenger-metrics.json); "
        "None: off"))
    metrics_host: str = Field("127.0.0.1", description="address the metrics endpoint binds")
    slurm_api: Literal["auto", "cli", "pyslurm"] = Field("auto", description=(
        "how the daemon talks to Slurm: 'cli' (sinfo/squeue/sbatch/scancel, every release ≥ 21.08), 'pyslurm' "
        "(queries and signals in-process; needs a pyslurm built for the cluster's Slurm release), 'auto' "
        "(pyslurm when it imports and matches `sinfo --version`, else the CLI)"))
    harvest_dir: str | None = Field(None, description=(
        "spool directory of the cluster's harvest service (`rlboost-hpc harvest serve`): post this run's demand "
        "there and keep at most the share it grants; None: harvest alone (every idle slot of the partition)"))
    harvest_max_age_s: float = Field(60.0, gt=0, description=(
        "a share the harvest service has not renewed for this many seconds is stale: submit nothing new"))
    trainer_job: str | None = Field(None, description=(
        "Slurm job id of the run's trainer (sbatch/launch and submit_run pass it): once that job has ended while "
        "target.json still says the run is active (the trainer failed or was cancelled), the run is over — cancel "
        "its rollout jobs (and, with --exit-when-done, exit) instead of waiting for a target that never comes"))
    trainer_pending_release_s: float = Field(120.0, ge=0, description=(
        "with trainer_job: once the trainer job has waited this many seconds (requeued after a preemption or a node "
        "failure, pending or held), its rollout jobs have no manager to serve: cancel them (none is submitted while "
        "it waits) and submit again when it runs; 0 releases them at the first listing that shows it waiting"))
    spot_price_per_gpu_hour: float = Field(0.0, ge=0, description=(
        "price of one harvested (preemptible) GPU-hour, for cost per token (e.g. the cluster's internal charge)"))
    on_demand_price_per_gpu_hour: float = Field(0.0, ge=0, description=(
        "price of one reserved GPU-hour, for the saving reported next to the harvested cost"))

    @field_validator("signal")
    @classmethod
    def _no_usr1(cls, v: str) -> str:
        s = v.strip().upper().removeprefix("SIG")
        if s in ("USR1", "10"):
            raise ValueError("USR1 is taken by NCCL's own handler; use USR2 (the default)")
        signal_number(s)  # a signal of this platform, else ValueError naming it
        return s

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str) -> str:
        v = str(v).strip()
        if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE", v, flags=re.I):
            raise ValueError(f"time_limit {v!r}: use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
        return v

    @field_validator("trainer_job")
    @classmethod
    def _job_id(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\d+(_\d+)?", str(v).strip()):
            raise ValueError(f"{v!r} is not a Slurm job id (digits, e.g. 4711)")
        return None if v is None else str(v).strip()

    @field_validator("job_name_prefix", "tag", "run_id")
    @classmethod
    def _no_commas(cls, v: str | None) -> str | None:
        if v is not None and ("," in v or "\n" in v):
            raise ValueError("must not contain commas or newlines")
        return v

    @model_validator(mode="after")
    def _harvest_needs_the_default_tag(self) -> "ScavengerConfig":
        if self.harvest_dir and self.tag:
            raise ValueError("tag: leave it unset with harvest_dir (the harvest service serves a run's own tag, "
                             "rlboost:<run id>@<hash>, only)")
        return self

    # -- derived ------------------------------------------------------------------------------------
    def resolved_run_id(self, run_dir: str | os.PathLike[str]) -> str:
        """``run_id``, or the run's own id (:meth:`rlboost_hpc.rundir.RunDir.run_id`: the one the trainer, the
        manager and the rollout jobs label everything with)."""
        return self.run_id or RunDir(Path(run_dir)).run_id()

    def resolved_tag(self, run_dir: str | os.PathLike[str]) -> str:
        """The ``--comment`` that marks this run's jobs: ``tag``, or ``rlboost:<run_id>@<8 hex digits of the run
        directory's absolute path>`` — two runs in directories of the same name never adopt each other's jobs."""
        path = str(Path(run_dir).resolve())
        return self.tag or f"rlboost:{self.resolved_run_id(run_dir)}@{hashlib.sha1(path.encode()).hexdigest()[:8]}"

    def job_name(self, run_dir: str | os.PathLike[str]) -> str:
        return f"{self.job_name_prefix}{self.resolved_run_id(run_dir)}"

    def resolved_script(self) -> Path:
        """The script path: absolute as given; relative from the cwd if it exists there, else the shipped file of
        that name (the checkout's, or the installed ``share/rlboost-hpc/``). Raises :class:`ScavengerConfigError`
        when it is in none of them."""
        from rlboost_hpc.paths import ShippedFileMissing, shipped

        p = Path(self.script).expanduser()
        if p.is_absolute() or (Path.cwd() / p).is_file():
            if p.is_file():
                return p.resolve()
            raise ScavengerConfigError(f"rollout script {self.script!r} not found; pass --script PATH")
        try:
            return shipped(str(p))
        except ShippedFileMissing as e:
            raise ScavengerConfigError(f"rollout script {self.script!r} not found in {Path.cwd()} ({e}); "
                                       "pass --script PATH") from None

    def sbatch_args(self, run_dir: str | os.PathLike[str]) -> list[str]:
        """The sbatch options of one rollout job (without ``--parsable`` and the script).

        Exports the whole environment plus ``RLBOOST_RUN_DIR`` (absolute) and ``RLBOOST_RUN_ID`` to the
        job. Raises :class:`ScavengerConfigError` if the run directory's path contains a comma (``--export``
        could not carry it)."""
        rd = str(Path(run_dir).resolve())
        if "," in rd:
            raise ScavengerConfigError(f"run directory {rd!r} contains a comma; sbatch --export cannot pass it")
        log_dir = Path(self.log_dir) if self.log_dir else Path(rd) / "scavenger" / "logs"
        args = [
            f"--job-name={self.job_name(run_dir)}",
            f"--comment={self.resolved_tag(run_dir)}",
            f"--partition={self.partition}",
        ]
        if self.qos:
            args.append(f"--qos={self.qos}")
        if self.account:
            args.append(f"--account={self.account}")
        if self.gpus_per_job > 0:
            args.append(f"--gres=gpu:{self.gpus_per_job}")
        args += [
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={self.cpus_per_job}",
            f"--time={self.time_limit}",
            "--requeue" if self.requeue else "--no-requeue",
            f"--signal=B:{self.signal}@{self.grace_s}",
            f"--export=ALL,RLBOOST_RUN_DIR={rd},RLBOOST_RUN_ID={self.resolved_run_id(run_dir)}",
            f"--output={log_dir}/%x-%j.out",
            "--open-mode=append",
            *self.extra_sbatch_args,
        ]
        return args


def time_limit_seconds(value: str) -> float | None:
    """Seconds of an ``sbatch --time`` value, as sbatch reads it: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``; ``None`` for ``UNLIMITED``/``INFINITE``. Raises ValueError for anything else."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?", v)
    if m is None:
        raise ValueError(f"time limit {value!r}: use minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]")
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, se = (nums + [0, 0])[:3]
        return float(int(days) * 86400 + h * 3600 + mi * 60 + se)
    if len(nums) == 1:  # minutes
        return float(nums[0] * 60)
    if len(nums) == 2:  # minutes:seconds
        return float(nums[0] * 60 + nums[1])
    return float(nums[0] * 3600 + nums[1] * 60 + nums[2])


def load_toml_model(path: str | os.PathLike[str] | None, table: str, model: type[_M], error: type[Exception],
                    what: str, overrides: dict[str, Any], flags: dict[str, str] | None = None) -> _M:
    """``model`` of TOML file ``path`` (its ``[table]`` if present, else the top level; None: the defaults) with
    ``overrides`` (None values ignored) on top. Raises ``error`` naming ``what``, the file and every bad key — as the
    file spells it (``harvest.idle_share_free`` when the file has a ``[harvest]`` table), or an override as the
    command line spelt it (``flags``: key → flag, e.g. ``--max-jobs (max_jobs)``)."""
    data: dict[str, Any] = {}
    prefix = ""
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise error(f"cannot read {what} {path}: {e}") from None
        prefix = f"{table}." if isinstance(raw.get(table), dict) else ""
        data = dict(raw.get(table, raw))
    given = {k: v for k, v in overrides.items() if v is not None}
    data.update(given)
    try:
        return model(**data)
    except ValidationError as e:
        def name(loc: tuple) -> str:
            key = ".".join(str(x) for x in loc)
            flag = (flags or {}).get(key) if key in given else None
            return f"{flag} ({key})" if flag else f"{prefix}{key}"

        lines = [f"{name(err['loc'])}: {err['msg']}" if err["loc"]
                 else f"{prefix.rstrip('.') or '(top level)'}: {err['msg']}" for err in e.errors()]
        where = f" {path}" if path is not None else ""
        raise error(f"invalid {what}{where}: " + "; ".join(lines)) from None


def load_scavenger_config(path: str | os.PathLike[str] | None = None, flags: dict[str, str] | None = None,
                          **overrides: Any) -> ScavengerConfig:
    """Config from an optional TOML file (its ``[scavenger]`` table if present, else the top level) with
    ``overrides`` (``None`` values ignored) on top; ``flags``: the command line's flag of each override, to name a bad
    one as typed. Raises :class:`ScavengerConfigError`."""
    return load_toml_model(path, "scavenger", ScavengerConfig, ScavengerConfigError, "scavenger config", overrides,
                           flags)
