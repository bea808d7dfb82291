"""The simulator's event queue: the kinds of event a :class:`~rlboost_hpc.sim.simulator.Simulation` schedules and
the heap they wait in.

This module owns the ordering every part of a simulation relies on: events are popped by ``(time, sequence
number)``, so two events at the same time run in the order they were pushed and a run is deterministic. The kinds
are small ints (cheap heap comparisons); an engine's pending event carries the engine's ``ver`` counter and is
dropped when stale (:meth:`EventQueue.resched` bumps it). The loop that pops and dispatches them is
``Simulation.run``.
"""
from __future__ import annotations

import heapq

from rlboost_hpc.sim.engine import Engine

# event kinds (ints: cheap heap comparisons)
ENG, TICK, TRACE, BOOT, PULL, SEED_OPEN, SEED_CLOSE, TRAIN_READY, TRAIN_DONE, STEP_END = range(10)


class EventQueue:
    """The event heap of one simulation: entries ``(t_s, seq, kind, a, b)`` with ``t_s`` simulated seconds, ``seq``
    the push count (the tie-break), ``kind`` one of the kinds above and ``a``/``b`` the kind's arguments."""

    def __init__(self) -> None:
        self.heap: list = []
        self.seq = 0

    def push(self, t: float, kind: int, a=None, b=None) -> None:
        """Schedule event ``kind`` with arguments ``a``, ``b`` at simulated time ``t`` (s)."""
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def resched(self, e: Engine) -> None:
        """Drop ``e``'s pending event (its ``ver`` bumped) and schedule its next one, if any."""
        e.ver += 1
        t = e.next_event()
        if t is not None:
            self.push(t, ENG, e, e.ver)
