"""Replay a spot-availability trace onto local worker slots — the driver (side effects).

:class:`ReplayDriver` applies a :class:`~rlboost_hpc.cluster.replay_plan.ReplayPlan` to real (or fake) processes
through an injected ``spawn`` callable and ``clock``, reaps them and keeps an event log for reports.

Driver invariants:

* :meth:`ReplayDriver.poll` first reaps exited processes, then applies every action whose ``at_s`` is due
  (``clock() - t0 >= at_s``; ``t0`` is the clock at the first ``poll``/``start``), in plan order;
* with a ``fire_when`` predicate a due ``preempt``/``kill`` of a live worker waits until
  ``fire_when(slot, attempt)`` is true (e.g. the worker holds work to hand over: a fault scheduled by progress,
  not by the clock) or it is ``max_hold_s`` overdue; the actions after it wait with it (plan order is kept);
* with a cap (:meth:`ReplayDriver.set_cap`) the number of live workers is ``min(cap, offered)``, where
  *offered* is the set of slots the plan currently has started; an offered slot without a worker because of
  the cap is *held* and started (lowest slot first) as soon as room frees up; lowering the cap below the live
  count *retires* the most recently started workers with the preempt signal;
* a worker that was signalled is *dying*: it no longer counts as live (nor against the cap) but is still
  reaped and its exit code recorded;
* a signalled worker's machine goes away with it: for real processes, the descendants it had when it was
  signalled are SIGKILLed with a ``kill`` at once, and after a ``preempt``/``retire`` once the worker has
  exited (it may use the warning to shut them down itself);
* after :meth:`ReplayDriver.stop_all` no worker spawned by the driver (nor, for real processes, any of their
  descendants) is left running.
"""
from __future__ import annotations

import logging
import math
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import psutil

from rlboost_hpc.cluster.replay_plan import ReplayAction, ReplayPlan, check_int, check_number

log = logging.getLogger(__name__)



def _returncode(proc: Any) -> int | None:
    """Exit code if the process has exited (reaping it), else ``None``. Popen-like or psutil.Process."""
    if hasattr(proc, "poll"):
        return proc.poll()
    try:  # plain psutil.Process: wait() gives the code for our children, None for others
        rc = proc.wait(timeout=0)
    except psutil.TimeoutExpired:
        return None
    except psutil.NoSuchProcess:
        return -1
    return -1 if rc is None else rc


def _is_real(proc: Any) -> bool:
    return isinstance(proc, (subprocess.Popen, psutil.Process))


def _descendants(proc: Any) -> list[psutil.Process]:
    """Live descendants of a real process (empty for test doubles or a gone process)."""
    if not _is_real(proc):
        return []
    try:
        p = proc if isinstance(proc, psutil.Process) else psutil.Process(proc.pid)
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _signal(proc: Any, sig: int) -> bool:
    """Send ``sig`` (SIGKILL through ``kill()``); False if the process was already gone."""
    try:
        if sig == signal.SIGKILL:
            proc.kill()
        else:
            proc.send_signal(sig)
        return True
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False


@dataclass
class _Worker:
    slot: int
    attempt: int
    proc: Any
    pid: int | None
    started_t: float
    cause: str | None = None  # why it is ending: preempt, kill, retire, stop
    descendants: list[psutil.Process] = field(default_factory=list)


SpawnFn = Callable[[int, int], Any]


class ReplayDriver:
    """Apply a :class:`ReplayPlan` to processes (see the module docstring for the invariants).

    Args:
        plan: a plan, or an iterable of :class:`ReplayAction` (validated via :meth:`ReplayPlan.from_actions`).
        spawn: ``spawn(slot, attempt) -> process`` starts one worker; ``attempt`` counts the spawns of that slot
            (0, 1, ...). The process must offer ``pid``, ``poll() -> int | None``, ``send_signal(sig)`` and
            ``kill()`` (``subprocess.Popen``, ``psutil.Popen``); a plain ``psutil.Process`` also works (exit
            code ``-1`` when it is gone, as it is not our child). If ``spawn`` raises, the error is recorded
            (``"spawn_failed"``), the slot stays down until the plan restarts it, and the error propagates.
        clock: monotonic seconds (injected in tests); ``t0`` is its value at the first :meth:`poll`.
        preempt_signal: signal of a ``preempt`` (the warning), default SIGTERM; e.g. ``signal.SIGUSR2``.
        cap: initial cap on live workers (``None``: no cap), see :meth:`set_cap`.
        restart_exited: a worker that exits on its own while its slot is offered is respawned (next attempt) at
            the next poll if True; if False (default) the slot stays down until the plan removes and re-adds it.
        sleep: wait function used by :meth:`stop_all` between polls (inject one that advances a fake clock).
        fire_when: ``fire_when(slot, attempt) -> bool``; a due removal of a live worker is held until it returns
            True or the action is ``max_hold_s`` seconds overdue (``None``: removals fire when due).
        max_hold_s: the longest a removal is held by ``fire_when`` (seconds).
        before_retire: ``before_retire(slot, attempt)`` runs before a retire's warning signal (the local cluster
            writes the worker's drain marker there, so the worker counts itself drained, not preempted).

    Event records (:attr:`events`, also returned by :meth:`poll`) are dicts with the keys ``t`` (seconds since
    ``t0``), ``slot``, ``attempt``, ``pid``, ``action``, ``exit_code``, ``planned_at_s`` and ``cause``; actions:
    ``start``, ``preempt`` (warning signal sent), ``kill`` (SIGKILL), ``retire`` (cap lowered), ``withdraw``
    (the plan removed a slot that had no worker; a removal's record has ``held_s``, how long ``fire_when`` held
    it), ``exit`` (reaped; ``cause`` says why it ended, ``None`` if on
    its own), ``stop_term``/``stop_kill`` (from :meth:`stop_all`), ``spawn_failed`` (with ``error``).

    Not thread-safe: call it from one thread.
    """

    def __init__(self, plan: ReplayPlan | Iterable[ReplayAction], spawn: SpawnFn,
                 clock: Callable[[], float] = time.monotonic, *, preempt_signal: int = signal.SIGTERM,
                 cap: int | None = None, restart_exited: bool = False,
                 sleep: Callable[[float], Any] = time.sleep,
                 fire_when: Callable[[int, int], bool] | None = None, max_hold_s: float = 30.0,
                 before_retire: Callable[[int, int], Any] | None = None) -> None:
        check_number("max_hold_s", max_hold_s, lo=0)
        self.fire_when = fire_when
        self.before_retire = before_retire
        self.max_hold_s = max_hold_s
        self.plan = plan if isinstance(plan, ReplayPlan) else ReplayPlan.from_actions(plan)
        if preempt_signal == signal.SIGKILL:
            raise ValueError("preempt_signal must be a catchable signal (SIGKILL is what 'kill' actions send)")
        self._spawn_fn = spawn
        self._clock = clock
        self._sleep = sleep
        self.preempt_signal = preempt_signal
        self.restart_exited = restart_exited
        self.events: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._next = 0
        self._cap: int | None = None
        self._offered: set[int] = set()
        self._failed: set[int] = set()
        self._running: dict[int, _Worker] = {}
        self._dying: list[_Worker] = []
        self._attempts: dict[int, int] = {}
        self._stopped = False
        self.counts: dict[str, int] = {k: 0 for k in ("start", "preempt", "kill", "retire", "withdraw", "exit")}
        if cap is not None:
            self.set_cap(cap)

    # ---- time
    def start(self) -> None:
        """Fix ``t0`` now (otherwise the first :meth:`poll` does). Idempotent."""
        if self._t0 is None:
            self._t0 = self._clock()

    def elapsed(self) -> float:
        """Seconds since ``t0`` (0 before the start)."""
        return 0.0 if self._t0 is None else self._clock() - self._t0

    def next_due_in(self) -> float | None:
        """Seconds until the next planned action is due (<= 0: overdue); ``None`` when none is left."""
        if self._next >= len(self.plan.actions) or self._stopped:
            return None
        return self.plan.actions[self._next].at_s - self.elapsed()

    @property
    def done(self) -> bool:
        """True when every planned action has been applied (or the driver was stopped)."""
        return self._stopped or self._next >= len(self.plan.actions)

    # ---- state
    def live_slots(self) -> list[int]:
        """Slots with a running worker that was not signalled, ascending."""
        return sorted(self._running)

    def live_pids(self) -> dict[int, int | None]:
        """``{slot: pid}`` of the live workers."""
        return {s: w.pid for s, w in sorted(self._running.items())}

    def live_attempts(self) -> dict[int, int]:
        """``{slot: attempt}`` of the live workers."""
        return {s: w.attempt for s, w in sorted(self._running.items())}

    def offered_slots(self) -> list[int]:
        """Slots the plan currently has started (live, held by the cap, or down after exiting)."""
        return sorted(self._offered)

    def dying_pids(self) -> list[int | None]:
        """Pids of signalled workers not yet reaped."""
        return [w.pid for w in self._dying]

    @property
    def cap(self) -> int | None:
        """The cap on live workers (``None``: none)."""
        return self._cap

    @property
    def n_preempted(self) -> int:
        """Workers sent the preempt (warning) signal by a ``preempt`` action."""
        return self.counts["preempt"]

    @property
    def n_killed(self) -> int:
        """Workers SIGKILLed by a ``kill`` action (no warning)."""
        return self.counts["kill"]

    @property
    def n_started(self) -> int:
        """Spawns (every attempt of every slot)."""
        return self.counts["start"]

    def summary(self) -> dict[str, Any]:
        """Counts for reports: started, preempted (warned), killed, retired, withdrawn, exited, plus
        ``exit_codes`` (as :meth:`exit_codes`), ``live`` slots and ``elapsed_s``."""
        return {
            "started": self.n_started, "preempted": self.n_preempted, "killed": self.n_killed,
            "retired": self.counts["retire"], "withdrawn": self.counts["withdraw"], "exited": self.counts["exit"],
            "exit_codes": self.exit_codes(), "live": self.live_slots(), "elapsed_s": self.elapsed(),
        }

    def exit_codes(self) -> list[tuple[int, int, int | None]]:
        """``(slot, attempt, exit_code)`` of every reaped worker, in reaping order."""
        return [(e["slot"], e["attempt"], e["exit_code"]) for e in self.events if e["action"] == "exit"]

    # ---- control
    def set_cap(self, n: int | None) -> list[dict[str, Any]]:
        """Allow at most ``n`` live workers (``None``: no cap), e.g. the N_prem policy's choice.

        Raising the cap starts held offered slots (lowest first); lowering it below the live count retires the
        most recently started workers with the preempt signal (their slots stay offered and restart, as a new
        attempt, when the cap allows). Takes effect now if the replay has started, else at the first poll.

        Returns:
            The event records this produced.

        Raises:
            ValueError: ``n`` is negative or not an int.
        """
        if n is not None:
            check_int("cap", n, 0)
        self._cap = n
        new: list[dict[str, Any]] = []
        if self._t0 is not None and not self._stopped:
            self._reconcile(self.elapsed(), new)
        return new

    def end_now(self, slot: int, action: str) -> list[dict[str, Any]]:
        """End the live worker of ``slot`` now, off the plan: ``"preempt"`` (the warning signal) or ``"kill"``
        (SIGKILL, its descendants too), recorded and counted as the plan's would be. The slot stays offered, so its
        next attempt starts at once (a preempted job requeued) — a fault scheduled by progress (a chaos run's step
        count), not by the trace's clock. Returns the event records (empty when the slot has no live worker).

        Raises:
            ValueError: another ``action``.
        """
        if action not in ("preempt", "kill"):
            raise ValueError(f"end_now: action must be 'preempt' or 'kill', not {action!r}")
        out: list[dict[str, Any]] = []
        w = self._running.pop(slot, None)
        if w is None or self._stopped:
            if w is not None:
                self._running[slot] = w
            return out
        now = self.elapsed()
        w.cause = action
        w.descendants = _descendants(w.proc)
        if action == "kill":
            _signal(w.proc, signal.SIGKILL)
            self._kill_descendants(w.descendants)
        else:
            _signal(w.proc, self.preempt_signal)
        self._dying.append(w)
        self._record(out, now, w, action, scheduled=True)
        self._reconcile(now, out)
        return out

    def poll(self) -> list[dict[str, Any]]:
        """Reap exited workers, then apply every due action (and the cap). Returns the new event records.

        Raises:
            Exception: whatever ``spawn`` raised (after recording it).
        """
        self.start()
        new: list[dict[str, Any]] = []
        now = self.elapsed()
        self._reap(now, new)
        if self._stopped:
            return new
        acts = self.plan.actions
        while self._next < len(acts) and acts[self._next].at_s <= now:
            a = acts[self._next]
            if self._held(a, now):
                break
            self._next += 1
            self._apply(a, now, new)
        self._reconcile(now, new)
        return new

    def freeze(self) -> None:
        """Apply no more plan actions (nor a cap): the workers alive stay, :meth:`poll` still reaps the ones that
        exit. For the end of a run, so that no fault lands while it reports."""
        self._stopped = True

    def stop_all(self, grace_s: float = 5.0, *, poll_interval_s: float = 0.05,
                 kill_wait_s: float = 5.0) -> list[dict[str, Any]]:
        """Terminate every worker: SIGTERM, wait up to ``grace_s`` (injected clock/sleep), then SIGKILL.

        Already-signalled workers are not signalled again before the grace period ends. After SIGKILL each
        process is waited for (real wait, up to ``kill_wait_s`` each) so none is left a zombie, and live
        descendants of real workers are killed too. No more plan actions are applied afterwards.

        Returns:
            The event records this produced.

        Raises:
            ValueError: negative ``grace_s``.
        """
        check_number("grace_s", grace_s, lo=0)
        self.start()
        self._stopped = True
        new: list[dict[str, Any]] = []
        now = self.elapsed()
        self._reap(now, new)
        self._offered.clear()
        for slot in sorted(self._running):
            w = self._running.pop(slot)
            w.descendants = _descendants(w.proc)
            w.cause = "stop"
            _signal(w.proc, signal.SIGTERM)
            self._dying.append(w)
            self._record(new, now, w, "stop_term")
        for w in self._dying:
            if not w.descendants:
                w.descendants = _descendants(w.proc)
        targets = list(self._dying)
        deadline = self._clock() + grace_s
        while True:
            self._reap(self.elapsed(), new)
            remaining = deadline - self._clock()
            if not self._dying or remaining <= 0:
                break
            self._sleep(min(poll_interval_s, remaining))
        stubborn = list(self._dying)
        for w in stubborn:
            _signal(w.proc, signal.SIGKILL)
            self._record(new, self.elapsed(), w, "stop_kill")
        for w in stubborn:
            if hasattr(w.proc, "wait"):
                try:
                    w.proc.wait(timeout=kill_wait_s)
                except Exception:  # noqa: BLE001 - best effort; reported below if still alive
                    pass
        self._reap(self.elapsed(), new)
        for w in self._dying:
            log.error("slot %d pid %s still not reaped after SIGKILL", w.slot, w.pid)
        self._kill_descendants([d for w in targets for d in w.descendants], wait_s=min(kill_wait_s, 1.0))
        return new

    def __enter__(self) -> "ReplayDriver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    # ---- internals
    @staticmethod
    def _kill_descendants(procs: list[psutil.Process], wait_s: float = 0.0) -> None:
        """SIGKILL the still-running ``procs``; wait up to ``wait_s`` for them to go (0: do not wait)."""
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    alive.append(p)
            except psutil.Error:
                pass
        if alive and wait_s > 0:
            psutil.wait_procs(alive, timeout=wait_s)

    def _record(self, out: list[dict[str, Any]], now: float, w: _Worker | None, action: str, *,
                slot: int | None = None, exit_code: int | None = None, planned: float | None = None,
                cause: str | None = None, **extra: Any) -> dict[str, Any]:
        rec = {
            "t": now,
            "slot": w.slot if w is not None else slot,
            "attempt": w.attempt if w is not None else None,
            "pid": w.pid if w is not None else None,
            "action": action,
            "exit_code": exit_code,
            "planned_at_s": planned,
            "cause": cause if cause is not None else (w.cause if w is not None else None),
            **extra,
        }
        self.events.append(rec)
        out.append(rec)
        if action in self.counts:
            self.counts[action] += 1
        return rec

    def _reap(self, now: float, out: list[dict[str, Any]]) -> None:
        for slot in sorted(self._running):
            w = self._running[slot]
            rc = _returncode(w.proc)
            if rc is None:
                continue
            del self._running[slot]
            self._record(out, now, w, "exit", exit_code=rc, cause=None)
            if not self.restart_exited:
                self._failed.add(slot)
        still: list[_Worker] = []
        for w in self._dying:
            rc = _returncode(w.proc)
            if rc is None:
                still.append(w)
            else:
                self._record(out, now, w, "exit", exit_code=rc)
                if w.descendants:  # its machine is gone: so is whatever it left behind
                    self._kill_descendants(w.descendants)
        self._dying = still

    def _held(self, a: ReplayAction, now: float) -> bool:
        """Whether ``fire_when`` holds the due removal ``a`` back (see the class docstring)."""
        w = self._running.get(a.slot)
        if self.fire_when is None or a.action == "start" or w is None or now - a.at_s >= self.max_hold_s:
            return False
        return not self.fire_when(w.slot, w.attempt)

    def _apply(self, a: ReplayAction, now: float, out: list[dict[str, Any]]) -> None:
        if a.action == "start":
            self._offered.add(a.slot)
            self._failed.discard(a.slot)
            self._reconcile(now, out, planned=a.at_s, prefer=a.slot)
            return
        self._offered.discard(a.slot)
        self._failed.discard(a.slot)
        w = self._running.pop(a.slot, None)
        if w is None:
            self._record(out, now, None, "withdraw", slot=a.slot, planned=a.at_s, cause=a.action)
        else:
            w.cause = a.action
            if a.action == "kill":
                w.descendants = _descendants(w.proc)  # the whole machine goes away
                _signal(w.proc, signal.SIGKILL)
                self._kill_descendants(w.descendants)
            else:
                w.descendants = _descendants(w.proc)  # swept once the worker has exited
                _signal(w.proc, self.preempt_signal)
            self._dying.append(w)
            self._record(out, now, w, a.action, planned=a.at_s, held_s=max(0.0, now - a.at_s))
        self._reconcile(now, out, planned=a.at_s)

    def _reconcile(self, now: float, out: list[dict[str, Any]], *, planned: float | None = None,
                   prefer: int | None = None) -> None:
        cap = math.inf if self._cap is None else self._cap
        while len(self._running) > cap:
            w = max(self._running.values(), key=lambda x: (x.started_t, x.slot))
            del self._running[w.slot]
            w.cause = "retire"
            w.descendants = _descendants(w.proc)
            if self.before_retire is not None:
                self.before_retire(w.slot, w.attempt)
            _signal(w.proc, self.preempt_signal)
            self._dying.append(w)
            self._record(out, now, w, "retire")
        waiting = sorted(self._offered - self._running.keys() - self._failed)
        if prefer is not None and prefer in waiting:  # the slot the plan just started goes first
            waiting.remove(prefer)
            waiting.insert(0, prefer)
        for slot in waiting:
            if len(self._running) >= cap:
                break
            self._spawn(slot, now, planned if slot == prefer else None, out)

    def _spawn(self, slot: int, now: float, planned: float | None, out: list[dict[str, Any]]) -> None:
        attempt = self._attempts.get(slot, 0)
        self._attempts[slot] = attempt + 1
        try:
            proc = self._spawn_fn(slot, attempt)
        except Exception as exc:
            self._failed.add(slot)
            self._record(out, now, None, "spawn_failed", slot=slot, planned=planned, error=repr(exc))
            out[-1]["attempt"] = attempt
            raise
        w = _Worker(slot, attempt, proc, getattr(proc, "pid", None), now)
        self._running[slot] = w
        self._record(out, now, w, "start", planned=planned)
