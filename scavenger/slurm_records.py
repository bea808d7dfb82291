"""What Slurm reports, as typed records: nodes, jobs and accounting rows, with the state vocabulary that classifies
them.

This module owns the records the rest of the scavenger reads — :class:`NodeInfo` (a node as sinfo reports it),
:class:`JobInfo` (a job as squeue reports it), :class:`SacctRecord` (one accounting row) — and the names they are
judged by: the job and node state sets, :class:`JobClass` with :func:`classify_job`, :func:`select_jobs` (our side
of squeue's filters) and :func:`signal_number` (signal names as Slurm takes them). The records are built from the
CLI's output by :mod:`scavenger.slurm_parsing` and from pyslurm by :mod:`scavenger.pyslurm_api`; advance
reservations have their own module, :mod:`scavenger.slurm_reservations`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterable

from scavenger.slurm_fields import int_or_zero

#: Base job states after which the job (this attempt and the job itself) is over.
TERMINAL_JOB_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "OUT_OF_MEMORY", "REVOKED",
})
#: Job states (base or flag) that hold an allocation: the job runs, is suspended, or is finishing/starting.
RUNNING_JOB_STATES = frozenset({
    "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESIZING",
    "POWER_UP_NODE", "UPDATE_DB",
})
#: Job states that wait for resources and start by themselves.
PENDING_JOB_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "SPECIAL_EXIT"})
#: Job states (or pending reasons) that wait and will not start until someone releases them.
HELD_JOB_STATES = frozenset({"REQUEUE_HOLD", "RESV_DEL_HOLD"})
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: Flags that can end a job's life without being one of TERMINAL_JOB_STATES' names.
TERMINAL_JOB_FLAGS = frozenset({"LAUNCH_FAILED", "RECONFIG_FAIL"})


class JobClass(StrEnum):
    """What a job state means for capacity (:func:`classify_job`)."""

    PENDING = "pending"  # waits for resources; starts by itself
    HELD = "held"  # waits, but starts only when released (held by a user/admin, REQUEUE_HOLD, RESV_DEL_HOLD)
    RUNNING = "running"  # holds an allocation
    TERMINAL = "terminal"  # over
    UNKNOWN = "unknown"  # a state this code does not know: counted as occupying capacity (never ignored)


def classify_job(state: str, flags: Iterable[str] = (), reason: str = "") -> JobClass:
    """The class of a job from its base state, flags and pending reason, for every state Slurm 21.08–25.x
    prints: base states (``PENDING``, ``RUNNING``, ``SUSPENDED``, ``COMPLETED``, ``CANCELLED``, ``FAILED``,
    ``TIMEOUT``, ``NODE_FAIL``, ``PREEMPTED``, ``BOOT_FAIL``, ``DEADLINE``, ``OUT_OF_MEMORY``) and the flag names
    that ≤ 23.02 print in place of the base state (``COMPLETING``, ``CONFIGURING``, ``REQUEUED``, ``REQUEUE_FED``,
    ``REQUEUE_HOLD``, ``RESV_DEL_HOLD``, ``SPECIAL_EXIT``, ``STOPPED``, ``SIGNALING``, ``STAGE_OUT``,
    ``RESIZING``, ``REVOKED``, ``LAUNCH_FAILED``, ``POWER_UP_NODE``, ``UPDATE_DB``, ``RECONFIG_FAIL``).
    Order: terminal, then held, running, pending; anything else is UNKNOWN."""
    names = {state, *flags}
    if state in TERMINAL_JOB_STATES or names & TERMINAL_JOB_FLAGS:
        return JobClass.TERMINAL
    if names & HELD_JOB_STATES or (reason in HELD_REASONS and state not in RUNNING_JOB_STATES):
        return JobClass.HELD
    if state in RUNNING_JOB_STATES:
        return JobClass.RUNNING
    if state in PENDING_JOB_STATES:
        return JobClass.PENDING
    return JobClass.UNKNOWN


def job_number(job_id: str) -> int:
    """The numeric part of a job id for ordering (``"123"`` → 123, ``"123_4"`` → 123); 0 when there is none."""
    digits = "".join(ch for ch in job_id.split("_")[0] if ch.isdigit())
    return int(digits) if digits else 0


def signal_number(name: str) -> int:
    """The number of a signal given as Slurm and ``scancel --signal`` take it: a name with or without ``SIG``, any
    case (``"USR2"``, ``"sigterm"``), or a number (``"12"``).

    Raises:
        ValueError: not a signal of this platform.
    """
    import signal as _signal

    s = str(name).strip().upper().removeprefix("SIG")
    try:
        return int(_signal.Signals(int(s)) if s.isdigit() else _signal.Signals["SIG" + s])
    except (KeyError, ValueError):
        raise ValueError(f"not a signal: {name!r}") from None


#: Node base states that can run new work (flags are checked separately).
USABLE_NODE_STATES = frozenset({"IDLE", "MIXED", "ALLOCATED", "COMPLETING"})
#: Node flags that make a node unusable for new work.
UNUSABLE_NODE_FLAGS = frozenset({
    "DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING", "MAINTENANCE", "MAINT", "NOT_RESPONDING",
    "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "POWERING_UP", "REBOOT_REQUESTED", "REBOOT_ISSUED",
    "INVALID", "INVALID_REG", "FUTURE", "RESERVED", "UNKNOWN", "PLANNED", "BLOCKED", "INVAL",
})


@dataclass(frozen=True)
class NodeInfo:
    """One node as sinfo reports it. ``state`` is the upper-case base state (``IDLE``, ``MIXED``, …);
    ``state_flags`` the upper-case flags (``DRAIN``, ``NOT_RESPONDING``, …); GPU counts are whole devices
    from the node's gres (``gres_used_gpus`` ≤ ``gres_total_gpus`` is not enforced: Slurm's word is kept).
    ``cpus``/``alloc_cpus`` are logical CPUs."""

    name: str
    state: str
    partitions: tuple[str, ...]
    cpus: int
    gres_total_gpus: int
    gres_used_gpus: int
    alloc_cpus: int = 0
    state_flags: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        """True when the node can start new work: base state usable and no draining/down/... flag."""
        return self.state in USABLE_NODE_STATES and not (set(self.state_flags) & UNUSABLE_NODE_FLAGS)

    @property
    def free_gpus(self) -> int:
        """GPUs not allocated (0 on an unusable node), in devices."""
        return max(0, self.gres_total_gpus - self.gres_used_gpus) if self.usable else 0

    @property
    def free_cpus(self) -> int:
        """Logical CPUs not allocated (0 on an unusable node)."""
        return max(0, self.cpus - self.alloc_cpus) if self.usable else 0


@dataclass(frozen=True)
class JobInfo:
    """One job as squeue reports it. Times are Unix epoch seconds (``None`` when unset/0);
    ``state`` is the upper-case base state, ``state_flags`` the extra states 24.05 lists
    (``REQUEUED``, ``COMPLETING``…); ``restart_cnt`` is Slurm's requeue counter (= ``SLURM_RESTART_COUNT``
    of the current attempt); ``gpus`` the job's total GPUs (allocated if known, else requested);
    ``exit_code``/``exit_signal`` come from the raw wait status (``None`` when unknown); ``user`` the Unix user
    owning the job (``""`` when Slurm did not say)."""

    job_id: str
    name: str
    comment: str
    state: str
    state_reason: str
    partition: str
    restart_cnt: int
    nodes: str
    submit_time: float | None
    start_time: float | None
    end_time: float | None = None
    gpus: int = 0
    tres: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    state_flags: tuple[str, ...] = ()
    requeue: bool | None = None
    user: str = ""

    @property
    def job_class(self) -> JobClass:
        """:func:`classify_job` of this job's state, flags and reason."""
        return classify_job(self.state, self.state_flags, self.state_reason)

    @property
    def live(self) -> bool:
        """True while the job runs or waits to, held or in a state we do not know (it may hold capacity)."""
        return self.job_class is not JobClass.TERMINAL

    @property
    def terminal(self) -> bool:
        """True once the job is over (completed, failed, cancelled, timeout, preempted-without-requeue, …)."""
        return self.job_class is JobClass.TERMINAL


@dataclass(frozen=True)
class SacctRecord:
    """One ``sacct -D -P`` row. ``step`` is ``None`` for the job's own row (one per attempt with ``-D``:
    requeued attempts have ``state == "REQUEUED"``), else ``"batch"``, ``"extern"``, ``"0"`` …
    ``state`` drops sacct's suffix (``"CANCELLED by 0"`` → ``"CANCELLED"``); times are epoch seconds
    (``None`` for Unknown/None); ``elapsed_s`` seconds; ``alloc_tres`` the parsed ``AllocTRES`` map."""

    job_id: str
    step: str | None
    name: str
    state: str
    start: float | None
    end: float | None
    nodelist: str
    elapsed_s: float
    alloc_tres: dict[str, str] = field(default_factory=dict)
    partition: str = ""
    account: str = ""
    eligible: float | None = None  # when the job could first start (epoch s): its wait is start − eligible

    @property
    def gpus(self) -> int:
        """GPUs of this allocation (``gres/gpu=N`` in AllocTRES), 0 when none."""
        return int_or_zero(self.alloc_tres.get("gres/gpu"))


def select_jobs(jobs: list[JobInfo], name_prefix: str | None = None, comment_tag: str | None = None,
                all_states: bool = False) -> list[JobInfo]:
    """The jobs whose name starts with ``name_prefix`` and whose comment equals ``comment_tag`` (each filter only
    when given), finished ones only with ``all_states`` — the filters of ``squeue_jobs``, applied on our side
    because some releases ignore them in JSON mode."""
    if name_prefix is not None:
        jobs = [j for j in jobs if j.name.startswith(name_prefix)]
    if comment_tag is not None:
        jobs = [j for j in jobs if j.comment == comment_tag]
    return jobs if all_states else [j for j in jobs if not j.terminal]
