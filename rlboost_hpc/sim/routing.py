"""Where a simulated response runs: dispatch of the queue to the routable engines, and continuous balancing.

This module owns routing in a :class:`~rlboost_hpc.sim.simulator.Simulation`: the dispatch of queued responses to
the routable engines (the simulation says which: the reserved ones while seeding, remote ones holding the current
version) by JSQ with Θ or round robin (:func:`~rlboost_hpc.policy.dispatch.choose_instance`,
:class:`~rlboost_hpc.policy.dispatch.RoundRobin`) or the co-located systems' static split, and the balancer's pass
every ``balance_interval_s`` that measures every busy engine and moves queued or running responses
(:class:`~rlboost_hpc.policy.dispatch.Balancer`). :class:`Router` is a collaborator of the simulation: the queue,
the set of engines to reschedule and the run's counters come in at construction.
"""
from __future__ import annotations

from collections import deque

from rlboost_hpc.policy.dispatch import Balancer, InstanceLoad, RoundRobin, choose_instance
from rlboost_hpc.sim.engine import DONE, Engine, Req
from rlboost_hpc.sim.staleness import Staleness


class Router:
    """Dispatch and balancing of a simulation's responses over the engines it says are routable.

    Args:
        system: the :class:`~rlboost_hpc.sim.systems.SystemSpec` (dispatch rule, Θ, balancing, migration).
        balancer: the rate learner and mover (shared with the remote pool, which reads its peaks).
        staleness: credits a moved response's tokens to its version.
        queue: the responses waiting for an engine (popped from the left).
        dirty: the engines to reschedule after the event.
        counters: the run's counters (moves of queued and running responses).
    """

    def __init__(self, system, *, balancer: Balancer, staleness: Staleness, queue: deque[Req], dirty: set,
                 counters: dict) -> None:
        self.sys, self._balancer, self._staleness = system, balancer, staleness
        self._queue, self._dirty, self._counters = queue, dirty, counters
        self._rr = RoundRobin()

    def static_split(self, engs: list[Engine], t: float, version: int) -> None:
        """The co-located systems' fixed split: the queue cut into equal runs, one per engine, at ``t``."""
        if not engs or not self._queue:
            return
        reqs = list(self._queue)
        self._queue.clear()
        n, E = len(reqs), len(engs)
        per = -(-n // E)
        for i, e in enumerate(engs):
            for r in reqs[i * per:(i + 1) * per]:
                self._staleness.took(r, version)
                e.take(r)
            e.admit(t)
            self._dirty.add(e)

    def dispatch(self, engs: list[Engine], t: float, version: int) -> None:
        """Give queued responses to ``engs`` (holding ``version``) by JSQ with Θ, or round robin, at ``t``."""
        if not engs:
            return
        q = self._queue
        theta = self.sys.theta
        loads = [e.B + len(e.waiting) for e in engs]
        rr = self.sys.dispatch != "jsq"
        while q:
            i = self._rr.choose(loads, theta) if rr else choose_instance(loads, theta)
            if i is None:
                break
            r = q.popleft()
            if r.state == DONE:
                continue
            e = engs[i]
            self._staleness.took(r, version)
            e.take(r)
            e.admit(t)
            self._dirty.add(e)
            loads[i] = e.B + len(e.waiting)

    def balance(self, engs: list[Engine], t: float, version: int) -> None:
        """The balancer's pass at ``t``: every routable engine measured (its decode rate at its batch); then, when
        the system balances, queued or running responses moved from donors past their plateau to engines with
        headroom."""
        bal = self._balancer
        loads = []
        by_id = {}
        for e in engs:
            e.advance(t)
            if e.B:
                bal.observe(e.eid, e.B, e.throughput())
            cap = e.B if e.waiting else None
            loads.append(InstanceLoad(e.eid, len(e.waiting), e.B, cap))
            by_id[e.eid] = e
        if not self.sys.balancer or len(engs) < 2:
            return
        moves = bal.moves_for(
            loads, t,
            lambda iid: [r.rid for r in by_id[iid].waiting],
            lambda iid: [(r.rid, by_id[iid].generated(r)) for r in by_id[iid].running.values()],
            tail=not self._queue)
        if not moves:
            return
        by_src: dict = {}
        for m in moves:
            by_src.setdefault((m.src, m.kind), []).append(m)
        for (src, kind), ms in by_src.items():
            e = by_id[src]
            rids = [m.rid for m in ms]
            got = e.pop_waiting(rids, t) if kind == "queued" else e.pop_running(rids, t)
            self._dirty.add(e)
            dst_of = {m.rid: m.dst for m in ms}
            for r in got:
                self._staleness.left(r)
                self._staleness.took(r, version)
                d = by_id[dst_of[r.rid]]
                if kind == "running":
                    r.migrations += 1
                    self._counters["moves_running"] += 1
                else:
                    self._counters["moves_queued"] += 1
                d.take(r)
                self._dirty.add(d)
        for e in engs:
            if e in self._dirty:
                e.admit(t)
