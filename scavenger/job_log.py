"""The scavenger's record of its own rollout jobs: what it last saw of each (:class:`JobTrack`), the lifecycle events
it writes to ``RUN_DIR/events.jsonl`` (``adopted``, ``submitted``, ``started``, ``requeued``, ``finished``,
``cancelled``) and their replay when a daemon restarts.

Invariants: one event per observed change, also across daemon restarts (a restarted daemon replays its own past
events, with its tag, before it looks at Slurm, so it logs no job's ``submitted``/``started`` twice and remembers
which jobs it asked to drain); a job is counted from listings, never from memory, and a job missing from
``VANISH_AFTER`` consecutive listings is logged as finished with state ``UNKNOWN``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlboost_hpc.events import append_event, iter_events
from rlboost_hpc.rundir import RunDir
from scavenger.slurm_records import JobClass, JobInfo

log = logging.getLogger("scavenger")

#: The ``source`` of every event this module writes.
SOURCE = "scavenger"
#: A job missing from this many consecutive listings is logged as finished with state UNKNOWN.
VANISH_AFTER = 2


@dataclass
class JobTrack:
    """What the daemon last saw of one of its jobs (rebuilt from events.jsonl after a restart): its state and attempt
    (``restart_cnt``), which attempt was seen starting and when (``started_attempt``, ``start_ts``, epoch s), whether
    it ended, when it was asked to drain or cancelled (epoch s), and for how many listings it has been missing."""

    state: str = "PENDING"
    restart_cnt: int = 0
    started_attempt: int | None = None
    start_ts: float | None = None
    finished: bool = False
    drain_signalled_at: float | None = None
    cancel_sent_at: float | None = None
    missing: int = 0


class JobLog:
    """The jobs of one run's scavenger (those tagged ``tag``) and their event log in ``run_dir``; ``clock``: wall
    seconds for the events' ``ts``. ``tracks``: job id → :class:`JobTrack`."""

    def __init__(self, run_dir: str | os.PathLike[str], tag: str, clock: Callable[[], float]) -> None:
        self.run_dir, self.tag, self.clock = Path(run_dir), tag, clock
        self.tracks: dict[str, JobTrack] = {}

    def replay(self) -> None:
        """Rebuild per-job state from this daemon's own past events (same tag), so a restart logs nothing
        twice and remembers which jobs it asked to drain."""
        for ev in iter_events(self.run_dir):
            if ev.get("source") != SOURCE or ev.get("tag") != self.tag or "job_id" not in ev:
                continue
            jid = str(ev["job_id"])
            t = self.tracks.setdefault(jid, JobTrack())
            rc = int(ev.get("restart_cnt", t.restart_cnt) or 0)
            kind = ev["event"]
            if kind in ("submitted", "adopted"):
                t.restart_cnt = max(t.restart_cnt, rc)
                t.state = str(ev.get("state", "PENDING"))
            elif kind == "requeued":
                t.restart_cnt = max(t.restart_cnt, rc)
                t.state = "PENDING"
                t.finished = False
            elif kind == "started":
                t.started_attempt = rc
                t.start_ts = ev.get("start_time") or ev.get("ts")
                t.state = "RUNNING"
            elif kind == "finished":
                t.finished = True
                t.state = str(ev.get("state", "UNKNOWN"))
            elif kind == "cancelled":
                if ev.get("mode") == "signal":
                    t.drain_signalled_at = float(ev.get("ts", 0.0))
                else:
                    t.cancel_sent_at = float(ev.get("ts", 0.0))

    def emit(self, event: str, job_id: str, restart_cnt: int, **fields: Any) -> None:
        """Append one event of job ``job_id`` (attempt ``restart_cnt``) to ``RUN_DIR/events.jsonl``; ``None``
        fields are left out. Never raises: a failed write is logged."""
        rec = {"ts": round(self.clock(), 3), "event": event, "source": SOURCE, "tag": self.tag,
               "job_id": str(job_id), "restart_cnt": int(restart_cnt)}
        rec.update({k: v for k, v in fields.items() if v is not None})
        try:
            append_event(self.run_dir, rec)
        except (OSError, ValueError) as e:
            log.error("scavenger: cannot append %s event of job %s to %s: %s", event, job_id,
                      RunDir(self.run_dir).events, e)

    def observe(self, jobs: list[JobInfo], now: float, on_finish: Callable[[JobInfo, JobTrack, float], None]) -> None:
        """Log lifecycle changes of OUR jobs in this listing (first sight, start, requeue, finish, vanish);
        ``on_finish(job, track, now)`` is called for every job seen ending (not for a vanished one)."""
        seen: set[str] = set()
        for j in jobs:
            seen.add(j.job_id)
            t = self.tracks.get(j.job_id)
            if t is None:
                t = JobTrack(state="PENDING", restart_cnt=j.restart_cnt)
                self.tracks[j.job_id] = t
                self.emit("adopted", j.job_id, j.restart_cnt, state=j.state, name=j.name,
                           partition=j.partition, submit_time=j.submit_time, gpus=j.gpus or None)
                log.info("scavenger: found job %s (%s) from an earlier daemon or a lost submission",
                         j.job_id, j.state)
            t.missing = 0
            if j.restart_cnt > t.restart_cnt:
                cause = "drain" if t.drain_signalled_at is not None else "preempted_or_requeued"
                for k in range(t.restart_cnt + 1, j.restart_cnt + 1):
                    self.emit("requeued", j.job_id, k, previous_state=t.state, state=j.state,
                               reason=j.state_reason or None, cause=cause,
                               attempt_start_time=t.start_ts if k == t.restart_cnt + 1 else None,
                               skipped=True if k < j.restart_cnt else None)
                log.info("scavenger: job %s requeued (restart_cnt %d → %d, %s)", j.job_id, t.restart_cnt,
                         j.restart_cnt, j.state_reason or j.state)
                t.restart_cnt = j.restart_cnt
                t.finished = False
                t.start_ts = None
            if t.started_attempt != j.restart_cnt:
                ran = j.job_class is JobClass.RUNNING and j.state not in ("COMPLETING", "CONFIGURING")
                inferred = (j.terminal or j.state == "COMPLETING") and j.start_time is not None \
                    and j.end_time is not None and j.end_time > j.start_time
                if ran or inferred:
                    self.emit("started", j.job_id, j.restart_cnt, node=j.nodes or None, gpus=j.gpus,
                               start_time=j.start_time, partition=j.partition,
                               inferred=True if inferred and not ran else None)
                    t.started_attempt = j.restart_cnt
                    t.start_ts = j.start_time or now
            if j.terminal and not t.finished:
                self.emit("finished", j.job_id, j.restart_cnt, state=j.state, exit_code=j.exit_code,
                           exit_signal=j.exit_signal, end_time=j.end_time, reason=j.state_reason or None,
                           node=j.nodes or None)
                t.finished = True
                on_finish(j, t, now)
            elif j.live and t.finished:  # e.g. `scontrol requeue` of a finished job
                t.finished = False
            t.state = j.state
        for jid, t in self.tracks.items():
            if t.finished or jid in seen:
                continue
            t.missing += 1
            if t.missing >= VANISH_AFTER:
                self.emit("finished", jid, t.restart_cnt, state="UNKNOWN", vanished=True)
                log.warning("scavenger: job %s vanished from squeue (aged out or lost by slurmctld)", jid)
                t.finished = True
