"""The remote (preemptible) pool of a simulated run: the instances it holds and how they come and go.

This module owns the remote instances' life in a :class:`~rlboost_hpc.sim.simulator.Simulation`: acquiring
available instances from the spot trace up to the ``N_prem`` cap, booting, pulling each new weight version over
the trainer's egress (shared by the pulls in progress), becoming routable once it holds the current version,
preemption by the trace (its responses requeued: migrated with their tokens, or restarted from zero in the
recompute ablation) and release of the excess at step boundaries, and each instance's record for the observation
law. :class:`RemotePool` is a collaborator of the simulation that owns that state; what it needs of the run comes
in at construction (the event queue, the balancer, the run's counters, the engines to reschedule, where evicted
responses go back) and the simulation calls it on each trace, boot and pull event.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rlboost_hpc.policy.observation import RemoteWork
from rlboost_hpc.policy.dispatch import Balancer
from rlboost_hpc.sim.engine import Engine, Req
from rlboost_hpc.sim.event_queue import BOOT, PULL, EventQueue
from rlboost_hpc.sim.staleness import Staleness


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


class RemotePool:
    """The remote instances (:class:`Remote`) of a simulation: acquire, boot, pull, preempt and release them.

    State: ``remotes`` (held, by name), ``available`` (live in the trace, not held; insertion order = acquisition
    order), ``held_log`` ((name, from, to) simulated s, per holding), ``cap`` (the controller's N_prem cap; None:
    every available one), ``gone_work`` (this step's records of the instances that left).

    Args:
        profile: the run's :class:`~rlboost_hpc.sim.profiles.Profile` (boot time, network, weight bytes).
        system: its :class:`~rlboost_hpc.sim.systems.SystemSpec` (co-located: no remote pool; migration or
            recompute on preemption).
        on_done: each remote engine's completion callback (the simulation's).
        schedule: the event queue BOOT and PULL events go to.
        balancer: the rate learner (each instance's peak; forgotten when it leaves).
        staleness: credits an evicted response's tokens to its version.
        counters: the run's counters (acquired, released, preemptions, migrated and regenerated tokens).
        dirty: the engines to reschedule after the event (a released engine leaves it).
        requeue: puts evicted responses back at the head of the queue, in order.
    """

    def __init__(self, profile, system, *, on_done: Callable, schedule: EventQueue, balancer: Balancer,
                 staleness: Staleness, counters: dict, dirty: set, requeue: Callable[[list[Req]], None]) -> None:
        self.p, self.sys, self.perf = profile, system, profile.instance_perf()
        self._on_done, self._schedule, self._balancer, self._staleness = on_done, schedule, balancer, staleness
        self._counters, self._dirty, self._requeue = counters, dirty, requeue
        self.remotes: dict[str, Remote] = {}
        self.available: dict[str, None] = {}
        self.held_log: list[tuple[str, float, float | None]] = []
        self._held_idx: dict[str, int] = {}
        self.cap: int | None = None
        self.gone_work: list[RemoteWork] = []

    def held(self) -> int:
        """Remote instances held (booting, pulling or ready)."""
        return len(self.remotes)

    def acquire_if_needed(self, t: float) -> None:
        """Take available instances up to the cap (booting from ``t``)."""
        if self.sys.colocated:
            return
        target = math.inf if self.cap is None else self.cap
        while self.held() < target and self.available:
            name = next(iter(self.available))
            del self.available[name]
            eng = Engine(name, "remote", self.perf, self._on_done)
            eng.t = t
            r = Remote(name, eng, "booting", acquired_at=t)
            self.remotes[name] = r
            self._held_idx[name] = len(self.held_log)
            self.held_log.append((name, t, None))
            self._counters["acquired"] += 1
            self._schedule.push(t + self.p.boot_s, BOOT, r)

    def release(self, r: Remote, t: float, *, preempted: bool) -> None:
        """``r`` leaves at ``t`` (preempted by the trace, or released to the cap): its responses go back to the
        queue's head — migrated with their tokens, or restarted from zero (the recompute ablation)."""
        del self.remotes[r.name]
        i = self._held_idx.pop(r.name)
        self.held_log[i] = (r.name, self.held_log[i][1], t)
        reqs = r.engine.evict_all(t)
        for q in reqs:
            self._staleness.left(q)
        self.gone_work.append(self.work(r))
        self._balancer.forget(r.name)
        r.engine.ver += 1  # invalidate pending engine events
        self._dirty.discard(r.engine)
        if reqs:
            for q in reqs:
                if self.sys.migration:
                    self._counters["responses_migrated"] += 1
                    self._counters["tokens_migrated"] += q.n
                    q.migrations += 1
                else:
                    self._counters["tokens_regenerated"] += q.n
                    q.regenerated += q.n
                    q.n, q.n0, q.by_ver = 0.0, 0.0, None
            self._requeue(reqs)
        self._counters["preemptions" if preempted else "released"] += 1

    def trim_to_cap(self, t: float) -> None:
        """Release the instances beyond the cap (booting first, then pulling, then ready; the newest first)."""
        if self.cap is None:
            return
        excess = self.held() - self.cap
        if excess <= 0:
            return
        rank = {"booting": 0, "pulling": 1, "ready": 2}
        order = sorted(self.remotes.values(), key=lambda r: (rank[r.state], -r.acquired_at, r.name))
        for r in order[:excess]:
            self.release(r, t, preempted=False)
            self.available[r.name] = None  # still live in the trace: it may be taken again later

    def on_trace(self, ev, t: float) -> None:
        """A trace event at ``t``: an instance appears (available) or disappears (preempted, if held); then
        acquire up to the cap."""
        if ev.kind == "add":
            self.available[ev.instance] = None
        else:
            self.available.pop(ev.instance, None)
            r = self.remotes.get(ev.instance)
            if r is not None:
                self.release(r, t, preempted=True)
        self.acquire_if_needed(t)

    def begin_step(self, t: float, version: int) -> None:
        """A step starts at ``t`` with ``version`` published: every ready instance pulls it; the step's records
        start (token marks, no instance gone yet)."""
        ready = [r for r in self.remotes.values() if r.state == "ready"]
        for k, r in enumerate(ready):
            self.start_pull(r, t, version, n_starting=len(ready) - k)
        self.gone_work = []
        for r in self.remotes.values():
            r.tok_mark = r.engine.tokens_out

    def start_pull(self, r: Remote, t: float, version: int, n_starting: int = 1) -> None:
        """Start pulling ``version`` (the latest). The trainer's egress is shared by every pull in progress,
        counted when the pull starts (pulls starting together finish together)."""
        n_pulling = n_starting + sum(1 for x in self.remotes.values() if x.state == "pulling" and x is not r)
        r.state = "pulling"
        r.pulling = version
        net = self.p.net
        egress = net.trainer_egress_Bps * self.p.reserved_nodes
        rate = min(net.instance_ingress_Bps, egress / n_pulling) * net.efficiency
        self._schedule.push(t + self.p.model.weight_bytes / rate, PULL, r, version)

    def boot_done(self, r: Remote, t: float, version: int) -> bool:
        """``r`` booted at ``t``: it pulls ``version``. False: ``r`` is no longer held (nothing happened)."""
        if self.remotes.get(r.name) is not r:
            return False
        self.start_pull(r, t, version)
        return True

    def pull_done(self, r: Remote, version: int, t: float, current: int) -> bool:
        """``r`` finished pulling ``version`` at ``t``; ``current``: the latest version. True: ``r`` is ready
        (routable); else it pulls ``current`` next, or is no longer held."""
        if self.remotes.get(r.name) is not r or r.pulling != version:
            return False
        r.version = version
        if version != current:
            self.start_pull(r, t, current)
            return False
        r.state = "ready"
        return True

    def ready_engines(self, version: int) -> list[Engine]:
        """The engines of the instances ready with ``version``."""
        return [r.engine for r in self.remotes.values() if r.state == "ready" and r.version == version]

    def work(self, r: Remote) -> RemoteWork:
        """Remote ``r``'s record for the observation law (``policy/observation.py``). The simulator's balancer
        samples every busy engine each balance period, so a peak is known for any engine that served a period;
        busy seconds (the law's last resort) are not tracked here (0)."""
        return RemoteWork(tokens=r.engine.tokens_out - r.tok_mark, peak_tokens_per_s=self._balancer.peak(r.name))

    def step_work(self) -> list[RemoteWork]:
        """The step's records: of the instances gone during it and of those held now."""
        return self.gone_work + [self.work(r) for r in self.remotes.values()]

    def capacity(self) -> bool:
        """Remote capacity: an instance ready or pulling."""
        return any(r.state in ("ready", "pulling") for r in self.remotes.values())
