"""User-level code on model output in a persistent pool of worker processes, each call under a deadline.

Rewards (math-verify runs SymPy on whatever the policy wrote) and tool calls (a calculator on a model-written
expression) are functions of model output: one call can take unbounded time, and run inline it would stall the
process that waits on it. :class:`DeadlinePool` is the one implementation both use:

* ``workers`` processes (``spawn``: no inherited threads or CUDA state) each hold a copy of the ``handler`` (a
  picklable callable; its optional ``setup()`` runs once in the worker, e.g. to load a tokenizer) and serve calls
  one at a time; they persist (no start-up cost per call). A worker is given work only after its ``setup()``
  finished, so a call's deadline never pays for it.
* Every call has a deadline of ``timeout_s`` seconds from when a worker took it. A worker past its deadline is
  killed (SIGKILL: SymPy or a runaway power cannot be interrupted cooperatively) and replaced; the call completes
  as ``TIMEOUT``. With ``grace_s > 0`` (handlers that hold resources: environments) a worker is stopped instead:
  SIGTERM interrupts the call and runs the handler's optional ``teardown()`` (e.g. close every environment it
  holds), and only a worker still alive ``grace_s`` seconds later is killed; the pool does not wait for it (its
  replacement starts at once). ``teardown()`` also runs when the pool closes and when a worker's pipe closes (its
  parent died). A worker that dies otherwise is replaced and its call re-run once on another worker (then
  ``FAILED``). A handler that raises completes its call as ``FAILED`` with the exception's text (the worker lives on).
* Nothing is lost: every submitted key completes exactly once, through :meth:`DeadlinePool.poll`.
* A call may name the worker it runs on (``slot``: stateful handlers keep per-key state in one worker); each worker
  position counts its incarnations (:meth:`DeadlinePool.generation`), so a caller knows when the state a worker held
  died with it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.connection import Connection, wait
from typing import Any, Hashable

log = logging.getLogger("rlboost.pool")

__all__ = ["CallStatus", "Completed", "DeadlinePool"]

#: Workers in a row that may die before they are ready (the handler's ``setup()`` fails) before
#: :meth:`DeadlinePool.poll` gives up with a RuntimeError instead of starting processes forever.
MAX_SETUP_DEATHS = 3


class CallStatus(StrEnum):
    OK = "ok"  # the handler returned ``value``
    TIMEOUT = "timeout"  # past the deadline: its worker was killed and replaced
    FAILED = "failed"  # the handler raised (``error``), or its worker died twice


@dataclass(frozen=True)
class Completed:
    """One finished call: its key, status, the handler's return value (``OK`` only), the error text (otherwise)
    and the seconds from when a worker took it to its completion."""

    key: Hashable
    status: CallStatus
    value: Any = None
    error: str = ""
    seconds: float = 0.0


class _Stop(BaseException):
    """SIGTERM in a worker's call: stop it (a BaseException, so user code's ``except Exception`` lets it by)."""


class _Worker:
    """A worker's state as its SIGTERM handler sees it (module-level: one worker per process)."""

    stopped = False  # SIGTERM came (it acts once)
    in_call = False  # the handler runs: SIGTERM interrupts it
    conn: Connection | None = None


def _on_sigterm(*_: Any) -> None:  # pragma: no cover - runs in the child
    """Interrupt the call the worker runs (raise once, only inside it: never in its teardown), or else end its wait
    for the next call (its pipe closed: the read fails and the loop ends)."""
    if _Worker.stopped:
        return
    _Worker.stopped = True
    if _Worker.in_call:
        raise _Stop
    try:
        _Worker.conn.close()
    except (AttributeError, OSError):
        pass


def _worker(handler: Any, conn: Connection) -> None:  # pragma: no cover - runs in the child
    """Run ``handler.setup()`` if it has one, say ready, then serve ``(key, item)`` → ``(key, ok, value|error)``
    until SIGTERM or the pipe closes; then ``handler.teardown()`` if it has one."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C
    _Worker.conn = conn
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        setup = getattr(handler, "setup", None)
        if setup is not None:
            setup()
        conn.send(("ready",))
        while not _Worker.stopped:
            key, item = conn.recv()
            _Worker.in_call = True
            try:
                out = (key, True, handler(item))
            except Exception as e:  # noqa: BLE001 - user-level code on model output: report, keep serving
                out = (key, False, f"{type(e).__name__}: {e}")
            finally:
                _Worker.in_call = False
            conn.send(out)
    except (_Stop, EOFError, OSError):
        pass
    finally:
        teardown = getattr(handler, "teardown", None)
        if teardown is not None:
            teardown()


class _Slot:
    def __init__(self, ctx, handler) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(handler, child), daemon=True, name="rlboost-pool")
        self.proc.start()
        child.close()
        self.ready = False
        self.key: Hashable | None = None  # the call it serves
        self.since = 0.0
        self.generation = 0  # incarnations of this worker position before this one

    def stop(self, grace_s: float) -> float | None:
        """Stop the worker: SIGKILL at once (``grace_s`` 0; returns None once it is reaped), else SIGTERM (its
        ``teardown()`` runs) and the monotonic time after which it is killed (not waited for)."""
        self.conn.close()
        if grace_s > 0 and self.proc.is_alive():
            self.proc.terminate()
            return time.monotonic() + grace_s
        self.proc.kill()
        self.proc.join(5)
        return None


class DeadlinePool:
    """Run ``handler(item)`` calls in ``workers`` processes with a per-call deadline (see the module docstring).

    Args:
        handler: a picklable callable (sent to each worker once); may define ``setup()``.
        workers: processes (≥ 1).
        timeout_s: per-call deadline, seconds (> 0).
        grace_s: seconds a stopped worker has for its ``teardown()`` before it is killed (0: killed at once).

    Raises:
        ValueError: ``workers < 1``, ``timeout_s <= 0`` or ``grace_s < 0``.
    """

    def __init__(self, handler: Any, *, workers: int = 1, timeout_s: float = 5.0, grace_s: float = 0.0) -> None:
        if workers < 1 or not timeout_s > 0 or grace_s < 0:
            raise ValueError(f"workers must be >= 1, timeout_s > 0 and grace_s >= 0, got {workers}, {timeout_s}, "
                             f"{grace_s}")
        self.handler, self.timeout_s, self.grace_s = handler, timeout_s, grace_s
        self._stopping: list[tuple[Any, float]] = []  # (process, kill after) of workers given their grace
        self._ctx = mp.get_context("spawn")
        self._slots = [_Slot(self._ctx, handler) for _ in range(workers)]
        self._todo: deque[tuple[Hashable, Any]] = deque()
        self._items: dict[Hashable, Any] = {}
        self._slot_of: dict[Hashable, int] = {}  # calls bound to one worker position
        self._timeouts: dict[Hashable, float] = {}  # calls submitted with a deadline of their own
        self._retried: set[Hashable] = set()
        self._setup_deaths = 0  # workers in a row that died before they were ready
        self.timed_out = 0  # calls that ran past their deadline
        self.failed = 0  # calls whose handler raised or whose worker died twice
        self.replaced = 0  # workers killed or died and started anew

    @property
    def pending(self) -> int:
        """Calls submitted and not yet returned by :meth:`poll`."""
        return len(self._items)

    def connections(self) -> list[Connection]:
        """The workers' pipe ends (to wait on them together with other sockets; :meth:`poll` reads them)."""
        return [s.conn for s in self._slots]

    @property
    def workers(self) -> int:
        return len(self._slots)

    def generation(self, slot: int) -> int:
        """Incarnations of worker position ``slot`` so far (0: its first worker still serves)."""
        return self._slots[slot].generation

    def submit(self, key: Hashable, item: Any, timeout_s: float | None = None, slot: int | None = None) -> None:
        """Queue ``handler(item)``; it completes (once) through :meth:`poll` under ``key``. ``timeout_s``: this call's
        deadline (s) instead of the pool's; ``slot``: the worker position (``0 ≤ slot < workers``) that must run it
        (None: any).

        Raises:
            ValueError: ``key`` is already pending, or ``slot`` is not a worker position.
        """
        if key in self._items:
            raise ValueError(f"call {key!r} is already pending")
        if slot is not None and not 0 <= slot < len(self._slots):
            raise ValueError(f"slot {slot} of a pool of {len(self._slots)} workers")
        self._items[key] = item
        if timeout_s is not None:
            self._timeouts[key] = timeout_s
        if slot is not None:
            self._slot_of[key] = slot
        self._todo.append((key, item))

    def set_timeout(self, key: Hashable, timeout_s: float) -> None:
        """The deadline (s) of pending call ``key``, counted from when a worker took (or takes) it — a call already
        running is held to the new deadline too. Unknown keys are ignored."""
        if key in self._items:
            self._timeouts[key] = timeout_s

    def _deadline(self, s: "_Slot") -> float:
        return s.since + self._timeouts.get(s.key, self.timeout_s)

    def _next_for(self, i: int) -> tuple[Hashable, Any] | None:
        """Take the oldest queued call worker position ``i`` may run."""
        for j, (key, item) in enumerate(self._todo):
            if self._slot_of.get(key, i) == i:
                del self._todo[j]
                return key, item
        return None

    def _start_calls(self) -> None:
        for i, s in enumerate(self._slots):
            if s.ready and s.key is None and self._todo:
                call = self._next_for(i)
                if call is None:
                    continue
                key, item = call
                try:
                    s.conn.send((key, item))
                except (BrokenPipeError, OSError):
                    self._todo.appendleft((key, item))
                    self._replace(s, "its pipe broke")
                    continue
                s.key, s.since = key, time.monotonic()

    def poll(self, timeout_s: float = 0.0) -> list[Completed]:
        """Start queued calls on free workers and return the calls that completed, waiting up to ``timeout_s``
        seconds for the first one (0: do not wait).

        Raises:
            RuntimeError: more than :data:`MAX_SETUP_DEATHS` workers in a row died in the handler's ``setup()``.
        """
        out: list[Completed] = []
        end = time.monotonic() + timeout_s
        while True:
            self._start_calls()
            busy = [s for s in self._slots if s.key is not None]
            waiting = [s for s in self._slots if not s.ready]
            now = time.monotonic()
            left = end - now
            if busy:
                left = min(left, min(self._deadline(s) for s in busy) - now)
            ready = wait([s.conn for s in busy + waiting], timeout=max(0.0, left)) if busy or waiting else []
            for s in waiting:
                if s.conn in ready:
                    try:
                        s.conn.recv()
                        s.ready, self._setup_deaths = True, 0
                    except (EOFError, OSError):
                        self._setup_deaths += 1
                        if self._setup_deaths > MAX_SETUP_DEATHS:
                            raise RuntimeError(f"{self._setup_deaths} pool workers in a row died during their "
                                               f"handler's setup ({type(self.handler).__name__}); see their "
                                               "stderr") from None
                        self._replace(s, "it died during setup")
            for s in busy:
                if s.conn in ready:
                    try:
                        key, ok, value = s.conn.recv()
                    except (EOFError, OSError):
                        key = s.key
                        self._replace(s, "it died")
                        if key in self._retried:
                            out.append(self._complete(key, CallStatus.FAILED, error="its worker died twice"))
                        else:
                            self._retried.add(key)
                            self._todo.appendleft((key, self._items[key]))
                        continue
                    secs = time.monotonic() - s.since
                    s.key = None
                    out.append(self._complete(key, CallStatus.OK if ok else CallStatus.FAILED,
                                              value=value if ok else None, error="" if ok else value, seconds=secs))
                elif time.monotonic() >= self._deadline(s):
                    key, limit = s.key, self._timeouts.get(s.key, self.timeout_s)
                    log.warning("call %r ran past its %.1f s deadline; its worker is replaced", key, limit)
                    out.append(self._complete(key, CallStatus.TIMEOUT, error=f"ran past {limit:g} s",
                                              seconds=time.monotonic() - s.since))
                    self._replace(s, "it ran past its deadline")
            self._start_calls()
            if self._stopping:
                self._reap(time.monotonic())
            if out or not self._items or time.monotonic() >= end:
                return out

    def _complete(self, key: Hashable, status: CallStatus, **kw) -> Completed:
        self._items.pop(key, None)
        self._timeouts.pop(key, None)
        self._slot_of.pop(key, None)
        self._retried.discard(key)
        if status == CallStatus.TIMEOUT:
            self.timed_out += 1
        elif status == CallStatus.FAILED:
            self.failed += 1
        return Completed(key, status, **kw)

    def run_all(self, items: list[Any], timeouts: list[float] | None = None) -> list[Completed]:
        """Run every item and return their completions in input order (blocks until all completed); ``timeouts``:
        each item's deadline (s; default the pool's).

        Raises:
            RuntimeError: other calls are pending on this pool (their completions would be taken here).
        """
        if self._items:
            raise RuntimeError(f"run_all on a pool with {len(self._items)} other calls pending")
        for i, item in enumerate(items):
            self.submit(("run_all", i), item, None if timeouts is None else timeouts[i])
        done: dict[int, Completed] = {}
        while len(done) < len(items):
            for c in self.poll(timeout_s=1.0):
                done[c.key[1]] = c
        return [done[i] for i in range(len(items))]

    def _stop(self, s: _Slot) -> None:
        kill_at = s.stop(self.grace_s)
        if kill_at is not None:
            self._stopping.append((s.proc, kill_at))

    def _reap(self, now: float) -> None:
        """Kill the stopped workers past their grace; forget those that exited."""
        left = []
        for proc, kill_at in self._stopping:
            if proc.is_alive() and now >= kill_at:
                proc.kill()
                proc.join(5)
            elif proc.is_alive():
                left.append((proc, kill_at))
            else:
                proc.join(0)
        self._stopping = left

    def _replace(self, s: _Slot, why: str) -> None:
        log.debug("pool worker %s replaced: %s", s.proc.pid, why)
        self._stop(s)
        fresh = _Slot(self._ctx, self.handler)
        fresh.generation = s.generation + 1
        s.__dict__.update(fresh.__dict__)
        self.replaced += 1

    def close(self) -> None:
        """Stop every worker, each given ``grace_s`` seconds for its ``teardown()`` (blocks up to that; idempotent)."""
        for s in self._slots:
            self._stop(s)
        self._slots = []
        while self._stopping:
            self._reap(time.monotonic())
            if self._stopping:
                time.sleep(0.01)

    def __enter__(self) -> "DeadlinePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
