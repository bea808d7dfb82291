"""The trainer keeps its rollout manager running: a manager process that dies is started again under the same
endpoint, keys and Prometheus port, with a new epoch, and continues the step in flight from its work log
(``manager/worklog.py``, ``manager/restore.py``). The trainer waits for the step meanwhile — its calls are resent
with their call ids and answered idempotently by the restarted manager — and rollout instances reconnect to the
same address on their own (ZeroMQ), keeping their engines and weights.

Invariant: at most ``restarts`` restarts within any ``window_s`` seconds — a new manager that dies while it
starts (the first one included) counts as one and is started again; past that, :meth:`ManagerSupervisor.alive` says False and the trainer
fails the run (exit 1; a requeue resumes from the last checkpoint). A work log that is not the run's is bad input
(raised: exit 2).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from rlboost_hpc.errors import BadInput, RunFailed

log = logging.getLogger("rlboost.run")


class ManagerSupervisor:
    """Owns the manager process of a run (see the module docstring).

    Args:
        spawn: starts a manager: ``spawn(bind=…, restore=…, metrics_port=…) -> (process, bound endpoint,
            metrics_url)`` (:func:`~rlboost_hpc.manager.service.spawn_manager` with the run's arguments bound).
        restore: the first manager continues what the work log holds (a resumed trainer).
        restarts / window_s: the most restarts allowed within ``window_s`` seconds (0: none).
        bind: the first manager's bind address (``tcp://host:0``: a free port, kept by every restart).
        clock: monotonic seconds.

    Raises:
        RunFailed: the first manager could not be started within the restart budget (exit 1).
        BadInput: its work log is not the run's (exit 2, naming the file).

    Attributes: ``proc`` (the current manager process), ``bound`` (its endpoint), ``metrics_url``, ``restarted``
    (restarts so far) and ``restart_s`` (seconds each restart took, death noticed → endpoint reported).
    """

    def __init__(self, spawn: Callable[..., tuple], *, restore: bool, restarts: int, window_s: float, bind: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._spawn, self.restarts, self.window_s, self.clock = spawn, restarts, window_s, clock
        self._times: list[float] = []
        while True:  # the first manager too may die before it reports its endpoint (killed while it starts)
            try:
                self.proc, self.bound, self.metrics_url = spawn(bind=bind, restore=restore, metrics_port=0)
                break
            except BadInput:
                raise
            except Exception as e:  # noqa: BLE001 - it died before reporting its endpoint
                if not self._may_restart():
                    raise RunFailed(f"the rollout manager could not be started ({type(e).__name__}: {e}); "
                                    f"{self.restarts} restarts within {self.window_s:.0f} s are spent") from None
                log.warning("the manager died while it started (%s: %s); starting it again", type(e).__name__, e)
        self._metrics_port = int(self.metrics_url.rsplit(":", 1)[1].split("/")[0]) if self.metrics_url else 0
        self._lock = threading.Lock()
        self.stopping = False
        self.restarted = 0
        self.restart_s: list[float] = []

    def _may_restart(self) -> bool:
        """One more restart fits the budget (``restarts`` within ``window_s``): it is counted, and True."""
        now = self.clock()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.restarts:
            return False
        self._times.append(now)
        return True

    def alive(self) -> bool:
        """True while a manager runs — after restarting a dead one when the budget allows (blocking for the
        restart, about a second). False once the manager is dead for good, or the run is stopping."""
        with self._lock:
            if self.proc.is_alive():
                return True
            if self.stopping:
                return False
            code, t0 = self.proc.exitcode, time.monotonic()
            while True:  # a new manager killed while it starts is started again, within the same budget
                if not self._may_restart():
                    log.error("the manager process died (exit code %s) and %d restarts within %.0f s are spent",
                              code, len(self._times), self.window_s)
                    return False
                try:
                    self.proc, _, _ = self._spawn(bind=self.bound, restore=True, metrics_port=self._metrics_port)
                    break
                except BadInput:  # its work log is not this run's: exit 2, naming the file
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. it died before reporting its endpoint
                    log.warning("a restart of the manager failed (%s: %s); trying again", type(e).__name__, e)
            self.restarted += 1
            self.restart_s.append(time.monotonic() - t0)
            log.warning("the manager process died (exit code %s); restarted on %s in %.2f s, continuing the step "
                        "from its work log (restart %d)", code, self.bound, self.restart_s[-1], self.restarted)
            return True
