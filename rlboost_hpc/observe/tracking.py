"""Sending a run's figures to its experiment trackers without ever holding up the run: :class:`TrackerHub`.

The caller (the trainer's step loop, the scavenger's reconciliation loop) only puts items on a bounded queue; one
thread of the hub opens the trackers (:mod:`rlboost_hpc.observe.trackers`) and does every tracker call, in order.

Invariants:
- No call of the hub blocks on a tracker: a put that finds the queue full drops the item (logged once); opening a
  tracker (W&B starts a process, MLflow may dial a server) happens on the hub's thread.
- A tracker that raises is logged once (WARNING: which tracker, what it raised) and dropped; the others and the
  run go on.
- The trainer's hub logs on global rank 0 only (:func:`global_rank`); on other ranks it is inert.
- ``trackers.json`` is written by the trainer's hub only, after its trackers opened: what a resumed incarnation
  continues and what the scavenger joins.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rlboost_hpc.observe import names
from rlboost_hpc.observe.trackers import Role, Tracker, open_tracker, read_tracker_runs, write_tracker_runs
from rlboost_hpc.rundir import RunDir

log = logging.getLogger("rlboost.tracking")

__all__ = ["TrackerHub", "global_rank"]

#: Items the queue holds before puts are dropped (a step is one item; a tracker hours behind is dropped anyway).
QUEUE_ITEMS = 10_000


def global_rank() -> int:
    """This process's global rank: torch.distributed's when initialised, else ``$RANK`` (torchrun), else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class TrackerHub:
    """The trackers ``kinds`` of run directory ``rd`` as ``role``, fed through a queue by one thread.

    ``run_name`` names new tracker runs (the run id); ``resume_step`` is the step a resumed trainer continues from
    (``None``: a fresh start — new tracker runs); ``opener(kind, its trackers.json entry)`` opens one tracker
    (default :func:`~rlboost_hpc.observe.trackers.open_tracker`). Methods return at once; :meth:`close` waits
    (bounded) for the queue to drain. Without kinds (or off rank 0) it is inert: every method returns at once and
    nothing starts.
    """

    def __init__(self, kinds: list[str], rd: RunDir, *, run_name: str, role: Role = Role.TRAINER,
                 resume_step: int | None = None, queue_items: int = QUEUE_ITEMS,
                 opener: Callable[[str, dict | None], Tracker] | None = None) -> None:
        self.rd, self.role, self.run_name, self.resume_step = rd, role, run_name, resume_step
        self._opener = opener or (lambda kind, known: open_tracker(kind, rd, role, run_name, known, resume_step))
        self.kinds = list(dict.fromkeys(kinds)) if (role is Role.SCAVENGER or global_rank() == 0) else []
        self.trackers: list[Tracker] = []
        self.failed: dict[str, str] = {}  # tracker → what it raised (logged once)
        self.dropped_items = 0
        self.last_step = resume_step or 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_items)
        self._thread: threading.Thread | None = None
        if self.kinds:
            self._thread = threading.Thread(target=self._serve, name=f"trackers-{role.value}", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        """Whether any tracker is configured here (it may still fail later)."""
        return bool(self.kinds)

    # -------------------------------------------------------------------------------- the caller's side (no waits)
    def params(self, config: dict[str, Any]) -> None:
        """The run's configuration (``RunConfig.model_dump(mode="json")``) as the tracker runs' parameters."""
        self._put(("params", config))

    def backfill(self, lines: list[dict[str, Any]]) -> None:
        """``metrics.jsonl`` lines of earlier incarnations: sent to the trackers this incarnation created (a
        tracker added at a resume), not to runs that already hold them."""
        if lines:
            self._put(("backfill", lines))

    def step(self, line: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` line (:meth:`~rlboost_hpc.trainer.record.StepRecord.line`), at its step."""
        self._put(("line", line))  # named on the hub's thread: the step pays for a put only

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Step ``step``'s sample rows (``trainer.log_samples``), as each tracker's table; before its line."""
        if rows:
            self._put(("samples", int(step), list(rows)))

    def metrics(self, step: int, figures: dict[str, float], ts: float | None = None) -> None:
        """Figures already named by :mod:`~rlboost_hpc.observe.names` at trainer step ``step``."""
        self._put(("metrics", int(step), dict(figures), time.time() if ts is None else ts))

    def summary(self, report: dict[str, Any]) -> None:
        """``report.json`` as the run's summary."""
        self._put(("summary", report))

    def artifact(self, path: Path) -> None:
        """A file of the run (``run.png``, ``report.json``); a missing one is skipped."""
        self._put(("artifact", Path(path)))

    def close(self, *, failed: bool = False, timeout_s: float = 60.0) -> None:
        """Send what is queued, end the trackers' runs (failed: marked so), and stop the thread — waiting at most
        ``timeout_s`` seconds (a tracker stuck past that is abandoned with its daemon thread)."""
        if self._thread is None:
            return
        try:
            self._queue.put(("close", failed), timeout=timeout_s)
        except queue.Full:
            log.warning("trackers: the queue did not drain in %.0f s; abandoning %s", timeout_s, self.kinds)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trackers: still busy after %.0f s; abandoning %s", timeout_s,
                        ", ".join(t.kind.value for t in self.trackers))
        self._thread = None

    def _put(self, item: tuple) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped_items += 1
            if self.dropped_items == 1:
                log.warning("trackers: %d items queued (a tracker far behind); dropping new ones", self._queue.maxsize)

    # -------------------------------------------------------------------------------- the hub's thread
    def _serve(self) -> None:
        self._open()
        while True:
            item = self._queue.get()
            kind, args = item[0], item[1:]
            if kind == "close":
                for t in list(self.trackers):
                    self._call(t, lambda t=t: t.close(args[0]))
                self.trackers = []
                return
            if kind == "line":  # the caller no longer changes a line it handed over
                try:
                    kind, args = "metrics", _named(args[0])
                except (KeyError, TypeError, ValueError) as e:
                    self._fail("step record", e, "could not be named")
                    continue
            if kind == "metrics":
                self.last_step = max(self.last_step, args[0])
            for t in list(self.trackers):
                self._call(t, lambda t=t: self._do(t, kind, args))

    def _do(self, t: Tracker, kind: str, args: tuple) -> None:
        """One item for one tracker."""
        if kind == "params":
            t.log_params(args[0], names.flat_params(args[0]))
        elif kind == "backfill":
            if t.created and not t.forked:  # a continued run (and its fork) holds these steps already
                for line in args[0]:
                    t.log_metrics(*_named(line))
        elif kind == "metrics":
            t.log_metrics(*args)
        elif kind == "summary":
            t.log_summary(self.last_step, names.summary_figures(args[0]), args[0])
        elif kind == "samples":
            t.log_samples(*args)
        elif kind == "artifact":
            if args[0].is_file():
                t.log_artifact(self.last_step, args[0])
        else:
            raise ValueError(f"unknown tracker item {kind!r}")

    def _open(self) -> None:
        known = read_tracker_runs(self.rd)
        runs = dict(known)
        for kind in self.kinds:
            try:
                t = self._opener(kind, known.get(kind))
                runs[t.kind.value] = t.identity()
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self._fail(kind, e, "could not be opened")
                continue
            self.trackers.append(t)
            log.info("trackers: %s %s run %s", kind, "forks into" if t.forked else "started" if t.created else
                     "continues", runs[t.kind.value])
        if self.role is Role.TRAINER and any(t.created for t in self.trackers):
            try:
                write_tracker_runs(self.rd, runs)
            except OSError as e:
                log.warning("trackers: could not write %s (%s): a resumed run will start new tracker runs",
                            self.rd.trackers, e)

    def _call(self, t: Tracker, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a tracker never stops the run
            self._fail(t.kind.value, e, "failed")
            self.trackers.remove(t)
            try:
                t.close(True)
            except Exception:  # noqa: BLE001 - already dropped
                pass

    def _fail(self, kind: str, e: BaseException, what: str) -> None:
        if kind not in self.failed:
            self.failed[kind] = f"{type(e).__name__}: {e}"
            log.warning("trackers: %s %s (%s: %s); it is dropped, the run goes on", kind, what, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")


def _named(line: dict[str, Any]) -> tuple[int, dict[str, float], float]:
    """(step, figures, Unix time) of a ``metrics.jsonl`` line."""
    return int(line["step"]), names.step_figures(line), float(line.get("ts") or time.time())
