"""The run's job event log: ``RUN_DIR/events.jsonl``, one JSON object per line, appended by several writers.

Writers: the scavenger daemon (``submitted``, ``adopted``, ``started``, ``requeued``, ``finished``,
``cancelled``), the embedded local cluster (``started``, ``finished``: one per attempt), rollout jobs
(``worker_started``, ``instance_ready`` with the seconds of each start-up phase at its first token —
``process_start->agent_start_s``, ``agent_start->welcome_s``, ``welcome->weights_loaded_s``,
``weights_loaded->first_token_s`` —, ``warned`` with its ``cause``, ``tokens``), anything else that follows the
format.

Record format (every line): ``{"ts": <epoch seconds, float>, "event": <str>, ...}``; job records carry
``"job_id": <str>`` and the attempt (``"restart_cnt"`` from the daemon, ``"attempt"`` from rollout jobs —
both equal ``SLURM_RESTART_COUNT`` of that attempt). ``tokens`` records:
``{"event": "tokens", "job_id", "attempt", "produced": n, "handed_off": m}`` with optional
``"regenerated": k`` and ``"cumulative": true`` (counts are running totals of the attempt, so readers take the
last one; without it each record's counts are increments to be summed).

Invariants:

* :func:`append_event` is the only writer: one ``write(2)`` of one complete line on an ``O_APPEND`` descriptor
  under an exclusive ``lockf`` lock, then ``fsync`` after the lock is released — concurrent writers on one host
  never interleave, and the lock makes appends from several NFS clients safe too (NFS has no atomic ``O_APPEND``
  of its own).
* No writer waits on another for long: the lock is awaited at most :data:`LOCK_WAIT_S` seconds, then the line
  is appended without it (and a warning logged). A writer that was stopped while holding it — a rollout job
  SIGSTOPped or its node hung — must never stall the trainer, the local cluster (which would be the one to
  continue it) or the scavenger.
* Readers (:func:`read_events`) skip lines that are not a JSON object (a torn write after a crash) and count
  them; they never raise on content.
* The drain marker (:func:`drain_marker_path`) is created by the daemon *before* it signals a surplus job,
  so a rollout job that receives the warning signal can tell "drain and exit" from "preempted: requeue".
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from rlboost_hpc.rundir import EVENTS_FILE  # the run directory's layout has one owner

#: Writers of job life-cycle events (``submitted`` … ``finished``): the scavenger for Slurm jobs, the embedded
#: local cluster for its worker slots (a slot is a job, each spawn an attempt). Statistics read only these.
LOCAL_CLUSTER_SOURCE = "local-cluster"
LIFECYCLE_SOURCES = frozenset({"scavenger", LOCAL_CLUSTER_SOURCE})
#: One line must fit one write; records are small (a few hundred bytes).
MAX_LINE_BYTES = 64 * 1024
#: Longest wait (seconds) for the event log's lock before appending without it (a holder may be stopped).
LOCK_WAIT_S = 2.0

log = logging.getLogger("rlboost.events")


def _lock(fd: int, path: Path, wait_s: float) -> bool:
    """Take the exclusive ``lockf`` lock of ``fd``, waiting at most ``wait_s`` seconds; whether it was taken
    (False also on filesystems without locks, where ``O_APPEND`` alone is atomic locally)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except (BlockingIOError, PermissionError):  # held by another process (EAGAIN / EACCES)
            if time.monotonic() >= deadline:
                log.warning("%s: its lock has been held for %.1f s (a writer stopped while appending?); "
                            "appending without it", path, wait_s)
                return False
            time.sleep(0.01)
        except OSError:
            return False


def events_path(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/events.jsonl``."""
    return Path(run_dir) / EVENTS_FILE


def append_event(run_dir: str | os.PathLike[str], record: Mapping[str, Any], *, fsync: bool = True,
                 lock_wait_s: float = LOCK_WAIT_S) -> dict:
    """Append ``record`` as one line to ``RUN_DIR/events.jsonl`` (created with the directory if missing).

    Adds ``ts`` (time.time(), seconds) when absent. ``record`` must have a string ``event`` and be JSON
    serialisable. Waits at most ``lock_wait_s`` seconds for another writer's lock (module invariants). Returns
    the record as written. Raises ``ValueError`` (no ``event``, not serialisable, or longer than
    :data:`MAX_LINE_BYTES`) and ``OSError`` (the file cannot be written)."""
    rec = dict(record)
    if not isinstance(rec.get("event"), str) or not rec["event"]:
        raise ValueError("an event record needs a non-empty string 'event'")
    rec.setdefault("ts", round(time.time(), 3))
    try:
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"event record is not JSON serialisable: {e}") from None
    data = line.encode()
    if len(data) > MAX_LINE_BYTES:
        raise ValueError(f"event record too long ({len(data)} bytes > {MAX_LINE_BYTES})")
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        locked = _lock(fd, path, lock_wait_s)
        try:
            written = os.write(fd, data)
            if written != len(data):  # only on a full disk or an interrupted NFS write
                raise OSError(f"short write to {path}: {written} of {len(data)} bytes")
        finally:
            if locked:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        if fsync:  # outside the lock: a slow disk never holds the other writers
            os.fsync(fd)
    finally:
        os.close(fd)
    return rec


def iter_events(run_dir: str | os.PathLike[str], stats: dict[str, int] | None = None) -> Iterator[dict]:
    """Yield each well-formed record of ``RUN_DIR/events.jsonl`` in file order (nothing if the file is
    missing). Bad lines are skipped; if ``stats`` is given, ``stats["bad_lines"]`` counts them."""
    path = events_path(run_dir)
    if stats is not None:
        stats.setdefault("bad_lines", 0)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
                if stats is not None:
                    stats["bad_lines"] += 1
                continue
            yield rec


def read_events(run_dir: str | os.PathLike[str], stats: dict[str, int] | None = None) -> list[dict]:
    """All well-formed records of ``RUN_DIR/events.jsonl`` (see :func:`iter_events`)."""
    return list(iter_events(run_dir, stats))


def drain_marker_path(run_dir: str | os.PathLike[str], job_id: str | int) -> Path:
    """``RUN_DIR/scavenger/drain/<job_id>``: exists once the daemon asked this job to drain and exit
    (it is surplus). A rollout job that gets the warning signal and finds it must hand off and exit
    *without* requeueing itself."""
    return Path(run_dir) / "scavenger" / "drain" / str(job_id)


def drain_requested(run_dir: str | os.PathLike[str], job_id: str | int | None = None) -> bool:
    """True when the daemon asked ``job_id`` (default ``$SLURM_JOB_ID``) to drain (see
    :func:`drain_marker_path`). For rollout jobs' signal handlers."""
    jid = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID", "")
    return bool(jid) and drain_marker_path(run_dir, jid).exists()


def slow_load_marker_path(run_dir: str | os.PathLike[str], instance: str) -> Path:
    """``RUN_DIR/faults/slow-load/<instance key>``: a chaos run's local cluster scheduled a slow weight load for this
    rollout instance (``job#attempt``); the file holds the extra seconds. The instance's next load takes them and
    removes the file (:func:`take_slow_load`)."""
    return Path(run_dir) / "faults" / "slow-load" / instance.replace("/", "_")


def take_slow_load(run_dir: str | os.PathLike[str], instance: str) -> float:
    """The extra seconds of a slow load scheduled for ``instance`` (:func:`slow_load_marker_path`), consumed: the
    marker is removed, so each scheduled fault slows one load; 0.0 when none is scheduled or it is unreadable."""
    path = slow_load_marker_path(run_dir, instance)
    try:
        text = path.read_text()
        path.unlink()
        return max(0.0, float(text or 0))
    except (OSError, ValueError):
        return 0.0
