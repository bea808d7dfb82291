"""Where a simulated response runs: dispatch of the queue to the routable engines, and continuous balancing.

This module owns routing in a :class:`~rlboost_hpc.sim.simulator.Simulation`: which engines are routable (the
reserved ones while seeding, remote ones holding the current version), the dispatch of queued responses by JSQ
with Θ or round robin (:func:`~rlboost_hpc.policy.dispatch.choose_instance`,
:class:`~rlboost_hpc.policy.dispatch.RoundRobin`) or the co-located systems' static split, and the balancer's tick
every ``balance_interval_s`` that measures every busy engine and moves queued or running responses
(:class:`~rlboost_hpc.policy.dispatch.Balancer`). A mixin: its state (``queue``, ``reserved``, ``remotes``,
``balancer``, ``rr``, ``dirty``, …) is set by ``Simulation.__init__``.
"""
from __future__ import annotations

from rlboost_hpc.policy.dispatch import InstanceLoad, choose_instance
from rlboost_hpc.sim.engine import DONE, Engine
from rlboost_hpc.sim.event_queue import TICK


class RoutingMixin:
    """Dispatch and balancing of a simulation's responses over its routable engines."""

    def _routable(self) -> list[Engine]:
        out = list(self.reserved) if self.resv_routable else []
        v = self.version
        for r in self.remotes.values():
            if r.state == "ready" and r.version == v:
                out.append(r.engine)
                self.remote_seen = True
        return out

    def _static_split(self, t: float) -> None:
        engs = self._routable()
        if not engs or not self.queue:
            return
        reqs = list(self.queue)
        self.queue.clear()
        n, E = len(reqs), len(engs)
        per = -(-n // E)
        for i, e in enumerate(engs):
            for r in reqs[i * per:(i + 1) * per]:
                self._took(r)
                e.take(r)
            e.admit(t)
            self.dirty.add(e)

    def _dispatch(self, t: float) -> None:
        engs = self._routable()
        if not engs:
            return
        q = self.queue
        theta = self.sys.theta
        loads = [e.B + len(e.waiting) for e in engs]
        rr = self.sys.dispatch != "jsq"
        while q:
            i = self.rr.choose(loads, theta) if rr else choose_instance(loads, theta)
            if i is None:
                break
            r = q.popleft()
            if r.state == DONE:
                continue
            e = engs[i]
            self._took(r)
            e.take(r)
            e.admit(t)
            self.dirty.add(e)
            loads[i] = e.B + len(e.waiting)

    def _tick(self, t: float) -> None:
        if self.finished:
            return
        self.push(t + self.sys.balance_interval_s, TICK)
        if all(p.n_done >= len(p.reqs) for p in self.pools.values()):
            return
        engs = self._routable()
        bal = self.balancer
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
            tail=not self.queue)
        if not moves:
            return
        by_src: dict = {}
        for m in moves:
            by_src.setdefault((m.src, m.kind), []).append(m)
        for (src, kind), ms in by_src.items():
            e = by_id[src]
            rids = [m.rid for m in ms]
            got = e.pop_waiting(rids, t) if kind == "queued" else e.pop_running(rids, t)
            self.dirty.add(e)
            dst_of = {m.rid: m.dst for m in ms}
            for r in got:
                self._left(r)
                self._took(r)
                d = by_id[dst_of[r.rid]]
                if kind == "running":
                    r.migrations += 1
                    self.counters["moves_running"] += 1
                else:
                    self.counters["moves_queued"] += 1
                d.take(r)
                self.dirty.add(d)
        for e in engs:
            if e in self.dirty:
                e.admit(t)
