"""The remote (preemptible) pool of a simulated run: the instances it holds and how they come and go.

This module owns the remote instances' life in a :class:`~rlboost_hpc.sim.simulator.Simulation`: acquiring
available instances from the spot trace up to the ``N_prem`` cap, booting, pulling each new weight version over
the trainer's egress (shared by the pulls in progress), becoming routable once it holds the current version,
preemption by the trace (its responses requeued: migrated with their tokens, or restarted from zero in the
recompute ablation) and release of the excess at step boundaries, and each instance's record for the observation
law. A mixin: its state (``remotes``, ``available``, ``held_log``, ``cap``, ``counters``, …) is set by
``Simulation.__init__``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlboost_hpc.policy.observation import RemoteWork
from rlboost_hpc.sim.engine import Engine
from rlboost_hpc.sim.event_queue import BOOT, PULL


@dataclass
class Remote:
    """One held remote instance: its engine, its state (booting → pulling → ready), when it was acquired
    (simulated s), the weight version it holds and the one it pulls (-1: none), and its engine's token count at the
    step start (``tok_mark``)."""

    name: str
    engine: Engine
    state: str            # booting | pulling | ready
    acquired_at: float
    version: int = -1     # version held
    pulling: int = -1     # version being pulled
    tok_mark: float = 0.0


class RemotePoolMixin:
    """Acquire, boot, pull, preempt and release remote instances (:class:`Remote`) of a simulation."""

    def _held(self) -> int:
        return len(self.remotes)

    def _acquire_if_needed(self, t: float) -> None:
        if self.sys.colocated:
            return
        target = math.inf if self.cap is None else self.cap
        while self._held() < target and self.available:
            name = next(iter(self.available))
            del self.available[name]
            eng = Engine(name, "remote", self.inst_perf, self._on_done)
            eng.t = t
            r = Remote(name, eng, "booting", acquired_at=t)
            self.remotes[name] = r
            self._held_idx[name] = len(self.held_log)
            self.held_log.append((name, t, None))
            self.counters["acquired"] += 1
            self.push(t + self.p.boot_s, BOOT, r)

    def _release(self, r: Remote, t: float, *, preempted: bool) -> None:
        del self.remotes[r.name]
        i = self._held_idx.pop(r.name)
        self.held_log[i] = (r.name, self.held_log[i][1], t)
        reqs = r.engine.evict_all(t)
        for q in reqs:
            self._left(q)
        self._gone_work.append(self._work(r))
        self.balancer.forget(r.name)
        r.engine.ver += 1  # invalidate pending engine events
        self.dirty.discard(r.engine)
        if reqs:
            for q in reqs:
                if self.sys.migration:
                    self.counters["responses_migrated"] += 1
                    self.counters["tokens_migrated"] += q.n
                    q.migrations += 1
                else:
                    self.counters["tokens_regenerated"] += q.n
                    q.regenerated += q.n
                    q.n, q.n0, q.by_ver = 0.0, 0.0, None
            self.queue.extendleft(reversed(reqs))
        if preempted:
            self.counters["preemptions"] += 1
        else:
            self.counters["released"] += 1

    def _trim_to_cap(self, t: float) -> None:
        if self.cap is None:
            return
        excess = self._held() - self.cap
        if excess <= 0:
            return
        rank = {"booting": 0, "pulling": 1, "ready": 2}
        order = sorted(self.remotes.values(), key=lambda r: (rank[r.state], -r.acquired_at, r.name))
        for r in order[:excess]:
            self._release(r, t, preempted=False)
            self.available[r.name] = None  # still live in the trace: it may be taken again later

    def _trace(self, ev, t: float) -> None:
        if ev.kind == "add":
            self.available[ev.instance] = None
        else:
            self.available.pop(ev.instance, None)
            r = self.remotes.get(ev.instance)
            if r is not None:
                self._release(r, t, preempted=True)
        self._acquire_if_needed(t)
        self._maybe_fallback(t)

    def _start_pull(self, r: Remote, t: float, n_starting: int = 1) -> None:
        """Start pulling the latest version. The trainer's egress is shared by every pull in progress,
        counted when the pull starts (pulls starting together finish together)."""
        n_pulling = n_starting + sum(1 for x in self.remotes.values() if x.state == "pulling" and x is not r)
        r.state = "pulling"
        r.pulling = self.version
        net = self.p.net
        egress = net.trainer_egress_Bps * self.p.reserved_nodes
        rate = min(net.instance_ingress_Bps, egress / n_pulling) * net.efficiency
        self.push(t + self.p.model.weight_bytes / rate, PULL, r, self.version)

    def _boot_done(self, r: Remote, t: float) -> None:
        if self.remotes.get(r.name) is not r:
            return
        self._start_pull(r, t)
        self._try_close(t)

    def _pull_done(self, r: Remote, version: int, t: float) -> None:
        if self.remotes.get(r.name) is not r or r.pulling != version:
            return
        r.version = version
        if version != self.version:
            self._start_pull(r, t)
            return
        r.state = "ready"
        self._try_close(t)

    def _work(self, r: Remote) -> RemoteWork:
        """Remote ``r``'s record for the observation law (``policy/observation.py``). The simulator's balancer
        samples every busy engine each balance period, so a peak is known for any engine that served a period;
        busy seconds (the law's last resort) are not tracked here (0)."""
        return RemoteWork(tokens=r.engine.tokens_out - r.tok_mark, peak_tokens_per_s=self.balancer.peak(r.name))

    def _remote_capacity(self) -> bool:
        return any(r.state in ("ready", "pulling") for r in self.remotes.values())
