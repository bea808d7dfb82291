"""Discrete-event simulator of one RL run (co-located verl, verl 2×, disaggregated, RLBoost and its ablations).

One :class:`Simulation` replays a spot-availability window (:class:`~rlboost_hpc.sim.workload.Availability`)
against a :class:`~rlboost_hpc.sim.profiles.Profile` under a :class:`SystemSpec` and drives the policy code of
``rlboost_hpc.policy`` unchanged: :class:`~rlboost_hpc.policy.controller.RolloutController` (seeding window +
pool cap) once per step, :func:`~rlboost_hpc.policy.dispatch.choose_instance` for every dispatch and
:class:`~rlboost_hpc.policy.dispatch.Balancer` every ``balance_interval_s``.

One RL step:

1. version ``v`` is published at the step start ``t0``; every held remote instance starts pulling it (time =
   weight bytes / min(instance NIC, trainer egress shared by concurrent pulls)); it is routable once it holds
   ``v`` (zero staleness).
2. Reserved GPUs switch to rollout (co-located resharding), seed for ``T_seed``, then — if a remote instance
   is routable or pulling — release every unfinished response (a *seed*: prompt + generated tokens, resumed
   elsewhere after one prefill) and switch to training. Without remote capacity they keep generating
   (co-located fallback) until capacity appears or the rollout is done. ``T_seed = 0`` skips the switches.
3. The trainer consumes completed groups as micro-batches of ``m_b`` responses (arrival order is free);
   after the last one, optimizer step + publish end the step.
4. A preempted instance's responses resume elsewhere from their generated tokens (``migration``) or restart
   from zero (recompute ablation). Instances that appear mid-step boot, pull and take work in the same step.
5. After the step the controller turns the observed waits/times into the next ``T_seed`` and ``N_prem``; the
   pool is trimmed or grown to ``min(N_prem, available)``.

Bounded staleness (``SystemSpec.max_staleness`` = k ≥ 1, live ``rollout.max_staleness`` with ``on_new_version =
"finish"``): steps s+1 … s+k queue behind step s at its start, so the pool generates while the trainer trains; a
response ends under its dispatch version; a step generated ahead skips seeding; staleness (≤ k) is counted per token;
the controller runs its overlap law (``policy/cap.py``; docs/simulator.md §4).

Deterministic: the event heap is ordered by ``(time, sequence number)``, all iteration orders are fixed, and
step ``s`` draws its lengths from ``default_rng([seed, s])``.

Where the parts live: this module holds the event loop (:meth:`Simulation.run`), the step lifecycle (seeding
window, co-located fallback, training, the step's end and the controller) and the run's result; its collaborators,
each owning its state: :class:`~rlboost_hpc.sim.event_queue.EventQueue` (the event kinds and heap),
:class:`~rlboost_hpc.sim.remote_pool.RemotePool` (the remote instances), :class:`~rlboost_hpc.sim.routing.Router`
(dispatch and balancing) and :class:`~rlboost_hpc.sim.staleness.Staleness` (admitted steps, bounded staleness);
:mod:`~rlboost_hpc.sim.systems` the :class:`SystemSpec` of each system.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field

from rlboost_hpc.policy.controller import RolloutController, StepObservation
from rlboost_hpc.policy.observation import observe_remote
from rlboost_hpc.policy.dispatch import Balancer
from rlboost_hpc.policy.seeding import SeedingWindow
from rlboost_hpc.sim.engine import Engine, Req
from rlboost_hpc.sim.event_queue import (
    BOOT, ENG, PULL, SEED_CLOSE, SEED_OPEN, STEP_END, TICK, TRACE, TRAIN_DONE, TRAIN_READY, EventQueue,
)
from rlboost_hpc.sim.profiles import Profile
from rlboost_hpc.sim.remote_pool import RemotePool
from rlboost_hpc.sim.routing import Router
from rlboost_hpc.sim.staleness import Staleness, StepPool
from rlboost_hpc.sim.systems import SystemSpec
from rlboost_hpc.sim.workload import Availability


@dataclass
class RunResult:
    """Outcome of one run. ``throughput`` = (prompt + response tokens of completed steps) / their wall time."""

    system: str
    model: str
    availability: str
    steps: int
    tokens: int
    wall_s: float
    throughput: float
    cost_usd: float
    tokens_per_dollar: float
    reserved_usd: float
    remote_usd: float
    remote_instance_hours: float
    mean_remote_held: float
    events: int
    counters: dict
    timeline: list = field(default_factory=list)

    def to_dict(self, timeline: bool = True) -> dict:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        return d


class Simulation:
    """One run. ``duration_s``: steps start only before this time; ``max_steps`` bounds the step count."""

    def __init__(self, profile: Profile, system: SystemSpec, avail: Availability | None = None, *,
                 duration_s: float = 7200.0, max_steps: int | None = None, seed: int = 0,
                 model_name: str = "") -> None:
        self.p = profile
        self.sys = system
        self.avail = avail or Availability.none()
        self.duration_s = duration_s
        self.max_steps = max_steps
        self.seed = seed
        self.model_name = model_name or profile.model.name
        self.schedule = EventQueue()
        self.now = 0.0
        self.events = 0
        self.dirty: set = set()
        self.reserved = [Engine(f"resv{i}", "reserved", profile.reserved_perf(), self._on_done)
                         for i in range(profile.n_resv_engines)]
        self.controller = RolloutController(
            n_resv=profile.n_resv_equiv,
            seeding=SeedingWindow(initial_s=system.t_seed_initial_s if system.seeding else 0.0, eta=system.eta,
                                  floor_s=system.floor_s if system.seeding else 0.0,
                                  adapt=system.adapt and system.seeding, memory=system.memory),
            use_cap=system.use_cap, overlap=system.max_staleness > 0 and system.overlap_controller)
        # The balancer always learns (its peak rates also measure remote work for the cap); it proposes moves
        # only when the system balances.
        self.balancer = Balancer(move_running=system.migration)
        self.queue: deque[Req] = deque()
        self.staleness = Staleness(system.max_staleness, profile.workload, seed)
        self.pools: dict[int, StepPool] = {}  # the admitted steps not trained yet (k + 1 at most)
        self.cur: StepPool | None = None  # the step the trainer trains now
        self.version = 0
        self.step = -1
        self.timeline: list[dict] = []
        self.counters = {k: 0.0 for k in ("preemptions", "responses_migrated", "tokens_migrated",
                                          "tokens_regenerated", "seeds", "seed_tokens", "moves_queued",
                                          "moves_running", "acquired", "released", "fallbacks")}
        self.finished = False
        self.t_last_end = 0.0
        self.tokens_done = 0
        self.router = Router(system, balancer=self.balancer, staleness=self.staleness, queue=self.queue,
                             dirty=self.dirty, counters=self.counters)
        self.pool = RemotePool(profile, system, on_done=self._on_done, schedule=self.schedule,
                               balancer=self.balancer, staleness=self.staleness, counters=self.counters,
                               dirty=self.dirty, requeue=lambda reqs: self.queue.extendleft(reversed(reqs)))

    # ------------------------------------------------------------------ event loop
    def run(self) -> RunResult:
        for name in self.avail.initial:
            self.pool.available[name] = None
        for ev in self.avail.events:
            self.schedule.push(ev.t_s, TRACE, ev)
        self.pool.acquire_if_needed(0.0)
        self._start_step(0.0)
        self.schedule.push(self.sys.balance_interval_s, TICK)
        heap = self.schedule.heap
        while heap and not self.finished:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            self.events += 1
            if kind == ENG:
                if b != a.ver:
                    continue
                a.on_event(t)
                self.dirty.add(a)
            elif kind == TICK:
                self._tick(t)
            elif kind == TRACE:
                self.pool.on_trace(a, t)
                self._maybe_fallback(t)
            elif kind == BOOT:
                if self.pool.boot_done(a, t, self.version):
                    self._try_close(t)
            elif kind == PULL:
                if self.pool.pull_done(a, b, t, self.version):
                    self._try_close(t)
            elif kind == SEED_OPEN:
                if b == self.step:
                    self._seed_open(t)
            elif kind == SEED_CLOSE:
                if b == self.step:
                    self._try_close(t, deadline=True)
            elif kind == TRAIN_READY:
                if b == self.step:
                    self._train_ready(t)
            elif kind == TRAIN_DONE:
                if b == self.step:
                    self._train_done(a, t)
            elif kind == STEP_END:
                if b == self.step:
                    self._step_end(t)
            if self.queue:
                self.router.dispatch(self._routable(), t, self.version)
            if self.dirty:
                for e in self.dirty:
                    self.schedule.resched(e)
                self.dirty.clear()
        return self._result()

    def _routable(self) -> list[Engine]:
        """The engines new work may go to: the reserved ones while they seed (or fall back), then the remote ones
        ready with the current version."""
        return (list(self.reserved) if self.resv_routable else []) + self.pool.ready_engines(self.version)

    def _tick(self, t: float) -> None:
        """The balancer's period: schedule the next one and, while a step's responses are unfinished, balance."""
        if self.finished:
            return
        self.schedule.push(t + self.sys.balance_interval_s, TICK)
        if all(p.n_done >= len(p.reqs) for p in self.pools.values()):
            return
        self.router.balance(self._routable(), t, self.version)

    # ------------------------------------------------------------------ step lifecycle
    def _start_step(self, t: float) -> None:
        self.step += 1
        self.version += 1
        s = self.step
        for ahead in range(s, s + self.staleness.k + 1):  # this step, and under bounded staleness the k after it
            if ahead not in self.pools:
                self.pools[ahead] = self.staleness.admit(ahead)
                self.queue.extend(self.pools[ahead].reqs)
        cur = self.cur = self.pools[s]
        G = self.p.workload.group
        self.t0 = t
        self.pool.begin_step(t, self.version)
        self.n_start = self.pool.held()
        if self.sys.colocated:
            self.t_seed = math.inf
        else:
            self.t_seed = self.controller.begin_step(self.n_start)
        self.resv_routable, self.seed_state = False, "pre"  # seed_state: pre | open | closed | reopening (fallback)
        self.close_pending = self.train_started = False
        self.train_avail: deque = deque(q for g in cur.early_groups for q in cur.reqs[g * G:(g + 1) * G])
        self.train_busy, self.trained, self.t_train, self.t_wait_train = False, 0, 0.0, 0.0
        self.idle_since: float | None = None
        self.rollout_done_at = None if cur.rollout_done_at is None else max(t, cur.rollout_done_at)
        # seeded False: generated ahead (bounded staleness), no window; seed_closed_at: its first close
        self.seeded, self.seed_closed_at = cur.n_done < len(cur.reqs), None
        self.step_counters = dict(self.counters)
        if self.t_seed <= 0 and self.pool.capacity():
            self.seed_state = "closed"
            self.schedule.push(t, TRAIN_READY, None, s)
        else:
            t_open = t + self.p.switch_to_rollout_s
            self.schedule.push(t_open, SEED_OPEN, None, s)
            if math.isfinite(self.t_seed):
                self.schedule.push(t_open + self.t_seed, SEED_CLOSE, None, s)

    def _seed_open(self, t: float) -> None:
        self.seed_state = "open"
        self.resv_routable = True
        if self.sys.dispatch == "static":
            self.router.static_split(self._routable(), t, self.version)
        # a fallback reopening with capacity back, or a step generated ahead (bounded staleness): close at once
        if self.close_pending or self.cur.n_done == len(self.cur.reqs):
            self._try_close(t)

    def _try_close(self, t: float, deadline: bool = False) -> None:
        if self.seed_state != "open":
            return
        if deadline:
            self.close_pending = True
        cur = self.cur
        if not self.close_pending and cur.n_done < len(cur.reqs):
            return
        if cur.n_done < len(cur.reqs) and not self.pool.capacity():
            return  # co-located fallback: keep generating until capacity appears or the rollout is done
        self.seed_state = "closed"
        self.resv_routable = False
        self.seed_closed_at = t if self.seed_closed_at is None else self.seed_closed_at
        seeds: list[Req] = []
        for e in self.reserved:
            for q in e.evict_all(t):
                self.staleness.left(q)
                seeds.append(q)
            e.ver += 1
            self.dirty.discard(e)
        if seeds:
            seeds.sort(key=lambda r: r.rid)
            self.counters["seeds"] += len(seeds)
            self.counters["seed_tokens"] += sum(r.n for r in seeds)
            self.queue.extendleft(reversed(seeds))
        self.schedule.push(t + self.p.switch_to_train_s, TRAIN_READY, None, self.step)

    def _maybe_fallback(self, t: float) -> None:
        """Co-located fallback after seeding closed: if the trainer is idle waiting, work remains and no remote
        instance is routable or pulling, the reserved GPUs switch back to rollout (they close again, releasing
        their unfinished responses, as soon as remote capacity returns or the rollout is done)."""
        if (self.seed_state != "closed" or not self.train_started or self.train_busy
                or self.cur.n_done >= len(self.cur.reqs) or self.pool.capacity()):
            return
        if self.idle_since is not None:
            self.t_wait_train += t - self.idle_since
            self.idle_since = None
        self.train_started = False
        self.seed_state = "reopening"
        self.close_pending = True
        self.counters["fallbacks"] += 1
        self.schedule.push(t + self.p.switch_to_rollout_s, SEED_OPEN, None, self.step)

    def _on_done(self, r: Req, t: float) -> None:
        self.staleness.left(r)
        pool = self.pools[r.step]
        pool.n_done += 1
        g = r.gid
        pool.gdone[g] += 1
        if pool.gdone[g] == self.p.workload.group:
            if pool is not self.cur:  # a step ahead (bounded staleness): trained when it becomes current
                pool.early_groups.append(g)
            else:
                G = self.p.workload.group
                for q in pool.reqs[g * G:(g + 1) * G]:
                    self.train_avail.append(q)
                if self.train_started and not self.train_busy:
                    self._train_next(t)
        if pool.n_done == len(pool.reqs):
            pool.rollout_done_at = t
            if pool is self.cur:
                self.rollout_done_at = t
                if self.seed_state == "open":
                    self._try_close(t)

    def _train_ready(self, t: float) -> None:
        self.train_started = True
        self.idle_since = t
        self._train_next(t)
        self._maybe_fallback(t)

    def _train_next(self, t: float) -> None:
        mb = self.p.workload.micro_batch
        cur = self.cur
        n_left = len(cur.reqs) - self.trained
        k = min(mb, len(self.train_avail))
        if k == 0 or (k < mb and k < n_left and cur.n_done < len(cur.reqs)):
            return
        if self.idle_since is not None:
            self.t_wait_train += t - self.idle_since
            self.idle_since = None
        tok = sq = 0.0
        for _ in range(k):
            q = self.train_avail.popleft()
            L = q.prompt + q.target
            tok += L
            sq += L * L
        dt = self.p.train_time(tok, sq)
        self.t_train += dt
        self.train_busy = True
        self.schedule.push(t + dt, TRAIN_DONE, k, self.step)

    def _train_done(self, k: int, t: float) -> None:
        self.train_busy = False
        self.trained += k
        if self.trained >= len(self.cur.reqs):
            dt = self.p.optimizer_s + self.p.net.publish_s
            self.t_train += self.p.optimizer_s
            self.schedule.push(t + dt, STEP_END, None, self.step)
            return
        self.idle_since = t
        self._train_next(t)
        self._maybe_fallback(t)

    def _step_end(self, t: float) -> None:
        G = self.p.workload.group
        cur = self.cur
        if cur.n_done != len(cur.reqs) or any(g != G for g in cur.gdone) or self.trained != len(cur.reqs):
            raise AssertionError(f"step {self.step}: exactly-once violated ({cur.n_done} done, "
                                 f"{self.trained} trained of {len(cur.reqs)})")
        del self.pools[self.step]
        stale = self.staleness.by_staleness(cur, self.version)
        n_end = self.pool.held()
        k = self.staleness.k
        done_at = self.pools[self.step + k].rollout_done_at if k else self.rollout_done_at  # the pool idle after
        rem = observe_remote(self.pool.step_work(), rollout_done_s=done_at, step_end_s=t)
        n_remote, t_remote = rem.n_remote, rem.t_remote_s
        t_seed_used = 0.0 if not (math.isfinite(self.t_seed) and self.seeded) else min(  # as the trainer measures it
            self.t_seed, (self.seed_closed_at or t) - self.t0 - self.p.switch_to_rollout_s)
        obs = StepObservation(
            t_seed_s=t_seed_used, t_wait_train_s=self.t_wait_train, t_wait_remote_s=rem.t_wait_remote_s,
            t_remote_s=t_remote, n_remote=n_remote, t_train_s=self.t_train, n_instances_start=self.n_start,
            n_instances_end=n_end, n_available=n_end + len(self.pool.available), step_s=t - self.t0)
        if not self.sys.colocated:
            dec = self.controller.end_step(obs)
            self.pool.cap = dec.n_prem_cap if self.sys.use_cap else None
        c0 = self.step_counters
        self.timeline.append({
            "step": self.step, "t_start": self.t0, "t_end": t, "step_s": t - self.t0, "tokens": cur.tokens,
            "throughput": cur.tokens / (t - self.t0), "t_seed_s": t_seed_used, "staleness_tokens": stale,
            "n_start": self.n_start, "n_end": n_end, "cap_next": self.pool.cap,
            "t_wait_train_s": self.t_wait_train, "t_wait_remote_s": obs.t_wait_remote_s,
            "t_train_s": self.t_train, "t_remote_s": t_remote, "n_remote": n_remote,
            "rollout_s": (self.rollout_done_at or t) - self.t0,
            **{k: self.counters[k] - c0[k] for k in ("preemptions", "responses_migrated", "tokens_migrated",
                                                      "tokens_regenerated", "seeds", "seed_tokens",
                                                      "moves_queued", "moves_running", "fallbacks")},
        })
        self.tokens_done += cur.tokens
        self.t_last_end = t
        if t >= self.duration_s or (self.max_steps is not None and self.step + 1 >= self.max_steps):
            self.finished = True
            return
        self.pool.trim_to_cap(t)
        self.pool.acquire_if_needed(t)
        self._start_step(t)

    # ------------------------------------------------------------------ results
    def _result(self) -> RunResult:
        T = self.t_last_end
        pr = self.p.prices
        reserved_usd = self.p.reserved_nodes * pr.on_demand_node * T / 3600.0
        rate = pr.on_demand_instance if self.sys.remote_on_demand else pr.spot_instance
        inst_s = 0.0
        for _, a, b in self.pool.held_log:
            end = T if b is None else min(b, T)
            if end > a:
                inst_s += end - a
        remote_usd = rate * inst_s / 3600.0
        cost = reserved_usd + remote_usd
        return RunResult(
            system=self.sys.name, model=self.model_name, availability=self.avail.source,
            steps=len(self.timeline), tokens=self.tokens_done, wall_s=T,
            throughput=self.tokens_done / T if T > 0 else 0.0, cost_usd=cost,
            tokens_per_dollar=self.tokens_done / cost if cost > 0 else 0.0, reserved_usd=reserved_usd,
            remote_usd=remote_usd, remote_instance_hours=inst_s / 3600.0,
            mean_remote_held=inst_s / T if T > 0 else 0.0, events=self.events,
            counters=dict(self.counters), timeline=self.timeline)


def simulate(profile: Profile, system: SystemSpec, avail: Availability | None = None, **kw) -> RunResult:
    """Convenience wrapper: ``Simulation(...).run()``."""
    return Simulation(profile, system, avail, **kw).run()
