"""Dispatch and continuous load balancing of rollout requests (RLBoost §token-level migration).

Three pieces, all pure and deterministic (no clock is read: the balancer is handed ``now``):

* :func:`choose_instance` — join-shortest-queue (JSQ) with a pending threshold Θ: a request goes to the
  routable instance with the fewest *pending* requests, but only if that count is below Θ; otherwise it is
  held at the manager ("delayed dispatch"), so that instances joining later, or instances that drain first,
  still find work. :func:`plan_dispatch` applies it to a whole queue; :class:`RoundRobin` is the ablation;
  :func:`arrival_share` bounds what an instance takes while others are about to load the version it serves.
* :class:`PlateauEstimator` — learns online, per instance, where its decode throughput stops growing with
  batch size, from that instance's own ``(batch size, tokens/s)`` measurements: the plateau is the smallest
  batch bucket whose smoothed throughput reaches ``frac`` (95%) of the best bucket; until enough distinct
  buckets were seen it answers a prior. Heterogeneous GPUs get their own curves.
* :class:`Balancer` — proposes moves: (1) requests *queued* at an instance (not yet running) to instances
  with headroom; (2) *running* requests beyond an instance's plateau to instances with headroom; (3) when no work
  is queued anywhere (the step's tail), a running request from the instance where one decodes slowest to an idle
  instance that decodes one at least ``tail_gain`` × faster (:meth:`Balancer.tail_plan`: heterogeneous GPUs).
  An instance has headroom when ``running + queued < min(plateau, capacity)``; a transfer of ``c`` requests is proposed
  only if afterwards the receiver's load is still at most the donor's (``c <= (donor − receiver)/2``, load =
  running + queued), so the sum of squared loads strictly falls and plans never oscillate, and a
  request moved within the last ``cooldown_s`` is not moved again. Moves are proposals ``(rid, src, dst)``;
  the caller executes them by per-sample migration (prompt + generated tokens, budget reduced).

Which running requests move: those with the fewest generated tokens first (cheapest re-prefill), ties by rid
(:func:`select_running`). Which queued requests move: the most recently queued first (they waited least).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

InstanceId = Hashable


# ------------------------------------------------------------------------------------------- JSQ + Θ


def choose_instance(loads: Sequence[float], theta: float, tiebreak: Sequence[float] | None = None) -> int | None:
    """Join-shortest-queue with pending threshold Θ.

    Args:
        loads: pending requests per routable instance. The caller decides what "pending" counts: the
            simulator counts requests waiting inside the engine (assigned, not yet running) and passes the
            in-flight count (running + waiting) as ``tiebreak``; a manager that cannot see inside its engines
            passes in-flight counts as ``loads`` and ``min(Θ, max_batch)`` as the threshold.
        theta: the threshold Θ; a request is dispatched only to an instance with ``load < theta``.
        tiebreak: optional secondary key among instances with equal ``loads`` (smaller first).

    Returns:
        The index of the instance with the smallest ``(load, tiebreak, index)``, or ``None`` if there is no
        instance or every load is ``>= theta`` (the request waits at the manager: delayed dispatch).
    """
    best: int | None = None
    best_key = (math.inf, math.inf)
    for i, load in enumerate(loads):
        key = (load, tiebreak[i] if tiebreak is not None else 0)
        if key < best_key:
            best, best_key = i, key
    if best is None or best_key[0] >= theta:
        return None
    return best


def arrival_share(n_work: int, n_serving: int, n_arriving: int) -> int | None:
    """The most requests one serving instance may hold while ``n_arriving`` instances are about to serve (they are
    loading the version the work needs, and were quick to load the last one): an equal share of ``n_work`` — the
    step's queued plus in-flight requests — over serving and arriving instances, rounded up, so the arriving ones
    find their share waiting at the manager instead of every request piling onto the instances that loaded first
    (a reserved engine maps a version in milliseconds, a preemptible worker pulls it over the network). ``None``
    (no bound but Θ) when nothing arrives.

    Raises:
        ValueError: a negative count, or work without any instance.
    """
    if min(n_work, n_serving, n_arriving) < 0 or (n_work and not n_serving + n_arriving):
        raise ValueError(f"arrival_share({n_work}, {n_serving}, {n_arriving})")
    if not n_arriving:
        return None
    return -(-n_work // (n_serving + n_arriving))


def plan_dispatch(n_queued: int, loads: Sequence[float], theta: float,
                  tiebreak: Sequence[float] | None = None) -> list[int]:
    """Assign up to ``n_queued`` requests one by one with :func:`choose_instance`, each assignment raising
    that instance's load (and tiebreak) by one. Returns the chosen instance index per dispatched request, in
    queue order (shorter than ``n_queued`` when the rest must wait at the manager)."""
    cur = list(loads)
    tb = list(tiebreak) if tiebreak is not None else None
    out: list[int] = []
    for _ in range(n_queued):
        i = choose_instance(cur, theta, tb)
        if i is None:
            break
        out.append(i)
        cur[i] += 1
        if tb is not None:
            tb[i] += 1
    return out


@dataclass
class RoundRobin:
    """Round-robin dispatch (ablation of JSQ): instances are taken in turn, skipping those at or above Θ
    (the delayed-dispatch threshold is kept, so only the choice rule differs from :func:`choose_instance`)."""

    next_index: int = 0

    def choose(self, loads: Sequence[float], theta: float = math.inf) -> int | None:
        n = len(loads)
        for k in range(n):
            i = (self.next_index + k) % n
            if loads[i] < theta:
                self.next_index = i + 1
                return i
        return None


# ------------------------------------------------------------------------------------------- plateau


def _bucket_edges(max_batch: int = 1 << 16) -> list[int]:
    """Bucket lower edges: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ... (powers of two and 1.5× between)."""
    edges = [1, 2, 3]
    p = 4
    while p <= max_batch:
        edges.append(p)
        edges.append(p + p // 2)
        p *= 2
    return edges


_EDGES = _bucket_edges()


@dataclass
class PlateauEstimator:
    """Online estimate of the batch size at which an instance's decode throughput plateaus.

    Each measurement ``(batch, tokens_per_s)`` updates an exponential moving average (weight ``alpha``) of
    the throughput in the batch's bucket (bucket lower edges 1, 2, 3, 4, 6, 8, 12, 16, 24, ...). The plateau
    is the lower edge of the smallest bucket whose average reaches ``frac`` × the best bucket's average.
    Until ``min_buckets`` distinct buckets and ``min_samples`` measurements were seen, :attr:`plateau`
    returns ``prior``. Measurements with ``batch < 1`` or a non-positive/non-finite throughput are ignored.
    """

    prior: int = 64
    frac: float = 0.95
    alpha: float = 0.3
    min_samples: int = 8
    min_buckets: int = 3
    ema: dict[int, float] = field(default_factory=dict)
    n_samples: int = 0

    def observe(self, batch: int, tokens_per_s: float) -> None:
        if batch < 1 or not (tokens_per_s > 0 and math.isfinite(tokens_per_s)):
            return
        b = _EDGES[bisect.bisect_right(_EDGES, batch) - 1]
        old = self.ema.get(b)
        self.ema[b] = tokens_per_s if old is None else old + self.alpha * (tokens_per_s - old)
        self.n_samples += 1

    @property
    def peak(self) -> float | None:
        """Best smoothed throughput over all buckets (tokens/s), ``None`` before any measurement."""
        return max(self.ema.values()) if self.ema else None

    @property
    def plateau(self) -> int:
        if self.n_samples < self.min_samples or len(self.ema) < self.min_buckets:
            return self.prior
        best = max(self.ema.values())
        for b in sorted(self.ema):
            if self.ema[b] >= self.frac * best:
                return b
        return self.prior  # unreachable: the best bucket qualifies


# ------------------------------------------------------------------------------------------- balancer


@dataclass(frozen=True)
class InstanceLoad:
    """What the balancer needs to know about one routable instance (counts only).

    ``capacity``: the most requests it could run right now (e.g. its KV-cache or ``max_batch`` limit);
    ``None`` means unknown (only the plateau limits headroom).
    """

    iid: InstanceId
    queued: int
    running: int
    capacity: int | None = None


@dataclass(frozen=True)
class Transfer:
    """Move ``count`` requests of ``kind`` (``"queued"`` or ``"running"``) from ``src`` to ``dst``."""

    src: InstanceId
    dst: InstanceId
    kind: str
    count: int


@dataclass(frozen=True)
class Move:
    """Move request ``rid`` (``kind`` ``"queued"`` or ``"running"``) from instance ``src`` to ``dst``."""

    rid: Hashable
    src: InstanceId
    dst: InstanceId
    kind: str


def select_running(running: Iterable[tuple[Hashable, int]], k: int,
                   exclude: frozenset | set = frozenset()) -> list[Hashable]:
    """The ``k`` running requests to migrate: fewest generated tokens first (cheapest re-prefill), ties by
    ``str(rid)``; requests in ``exclude`` (cooling down) are skipped."""
    cands = [(n, str(r), r) for r, n in running if r not in exclude]
    cands.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in cands[:max(0, k)]]


def select_queued(queued: Sequence[Hashable], k: int, exclude: frozenset | set = frozenset()) -> list[Hashable]:
    """The ``k`` queued requests to move: the most recently queued first (end of the sequence)."""
    out = []
    for r in reversed(queued):
        if len(out) >= k:
            break
        if r not in exclude:
            out.append(r)
    return out


@dataclass
class Balancer:
    """Continuous load balancer. See the module docstring.

    Args:
        prior_plateau / frac / min_samples / min_buckets / alpha: :class:`PlateauEstimator` settings for the
            instances it learns about.
        move_running: propose moves of running requests (needs per-sample migration; False in the
            recompute-from-scratch ablation).
        tail_gain: a tail move (:meth:`tail_plan`) needs the idle receiver to decode one request at least this many
            times faster than its donor does now.
        max_moves: most moves per plan (bounds re-prefill work per tick).
        cooldown_s: a request moved at ``t`` is not moved again before ``t + cooldown_s``.
    """

    prior_plateau: int = 64
    frac: float = 0.95
    min_samples: int = 8
    min_buckets: int = 3
    alpha: float = 0.3
    move_running: bool = True
    max_moves: int = 64
    cooldown_s: float = 10.0
    tail_gain: float = 1.5
    estimators: dict = field(default_factory=dict)
    last_moved: dict = field(default_factory=dict)

    # -------------------------------------------------------------- learning
    def estimator(self, iid: InstanceId) -> PlateauEstimator:
        est = self.estimators.get(iid)
        if est is None:
            est = self.estimators[iid] = PlateauEstimator(
                prior=self.prior_plateau, frac=self.frac, alpha=self.alpha,
                min_samples=self.min_samples, min_buckets=self.min_buckets)
        return est

    def observe(self, iid: InstanceId, batch: int, tokens_per_s: float) -> None:
        """Feed one throughput measurement of instance ``iid`` at running batch ``batch``."""
        self.estimator(iid).observe(batch, tokens_per_s)

    def plateau(self, iid: InstanceId) -> int:
        est = self.estimators.get(iid)
        return est.plateau if est is not None else self.prior_plateau

    def peak(self, iid: InstanceId) -> float | None:
        """Best smoothed throughput learned for ``iid`` (tokens/s), ``None`` if never measured."""
        est = self.estimators.get(iid)
        return est.peak if est is not None else None

    def per_request_rate(self, iid: InstanceId, batch: int) -> float | None:
        """Learned decode tokens/s of one request on ``iid`` while ``batch`` requests run there: that batch's
        bucket's smoothed throughput ÷ ``batch``; None when that bucket was never measured."""
        est = self.estimators.get(iid)
        if est is None or batch < 1:
            return None
        tp = est.ema.get(_EDGES[bisect.bisect_right(_EDGES, batch) - 1])
        return tp / batch if tp is not None else None

    def solo_rate(self, iid: InstanceId) -> float | None:
        """The best learned tokens/s of one request on ``iid`` (a measured bucket's throughput ÷ its lower edge,
        the largest over its buckets); None before any measurement."""
        est = self.estimators.get(iid)
        if est is None or not est.ema:
            return None
        return max(tp / b for b, tp in est.ema.items())

    def forget(self, iid: InstanceId) -> None:
        """Drop what was learned about an instance that left."""
        self.estimators.pop(iid, None)

    def cooling(self, now: float) -> set:
        """Requests moved less than ``cooldown_s`` before ``now`` (they must not move again yet)."""
        expired = [r for r, t in self.last_moved.items() if now - t >= self.cooldown_s]
        for r in expired:
            del self.last_moved[r]
        return set(self.last_moved)

    # -------------------------------------------------------------- planning
    def _limit(self, inst: InstanceLoad) -> int:
        lim = self.plateau(inst.iid)
        if inst.capacity is not None:
            lim = min(lim, inst.capacity)
        return max(1, lim)

    def plan(self, instances: Sequence[InstanceLoad]) -> list[Transfer]:
        """Count-level plan: which (src, dst, kind, count) transfers to make now.

        Queued requests go first (any queued request is waiting; a receiver with headroom runs it at once),
        then running requests beyond the donor's plateau. Receivers are taken largest headroom first; every
        transfer of ``c`` keeps ``receiver load + c <= donor load − c`` (load = running + queued).
        """
        load = {i.iid: i.running + i.queued for i in instances}
        queued = {i.iid: i.queued for i in instances}
        running = {i.iid: i.running for i in instances}
        limit = {i.iid: self._limit(i) for i in instances}
        order = {i.iid: k for k, i in enumerate(instances)}
        out: list[Transfer] = []
        budget = self.max_moves

        def receivers() -> list:
            rs = [iid for iid in load if load[iid] < limit[iid]]
            rs.sort(key=lambda r: (-(limit[r] - load[r]), order[r]))
            return rs

        def transfer(src, kind: str, avail: int) -> int:
            nonlocal budget
            moved = 0
            for dst in receivers():
                if budget <= 0 or avail <= 0:
                    break
                if dst == src:
                    continue
                # narrowing only: after moving c, load[dst] + c <= load[src] - c
                room = limit[dst] - load[dst]
                gap = (load[src] - load[dst]) // 2
                c = min(avail, room, gap, budget)
                if c <= 0:
                    continue
                out.append(Transfer(src, dst, kind, c))
                load[src] -= c
                load[dst] += c
                queued[dst] += c if kind == "queued" else 0
                running[dst] += c if kind == "running" else 0
                avail -= c
                moved += c
                budget -= c
            return moved

        donors_q = sorted((iid for iid in load if queued[iid] > 0), key=lambda d: (-queued[d], order[d]))
        for d in donors_q:
            n = transfer(d, "queued", queued[d])
            queued[d] -= n
        if self.move_running:
            donors_r = sorted((iid for iid in load if running[iid] > limit[iid]),
                              key=lambda d: (-(running[d] - limit[d]), order[d]))
            for d in donors_r:
                n = transfer(d, "running", running[d] - limit[d])
                running[d] -= n
        return out

    def tail_plan(self, instances: Sequence[InstanceLoad]) -> list[Transfer]:
        """Count-level moves that shorten a step's tail on instances of different speeds (RLBoost's continuous
        load balancing by token-level migration, when no queued work is left to hand out).

        With nothing queued on any instance, each idle instance (nothing running or queued), fastest
        (:meth:`solo_rate`) first, takes one running request from the instance where a request now decodes
        slowest (:meth:`per_request_rate` at its running batch), if the receiver decodes a request at least
        ``tail_gain`` × faster; instances never measured neither give nor take. A moved request runs alone on its
        receiver, at that instance's best per-request rate, so it can never be the slowest by ``tail_gain`` again
        and move back: no oscillation (the cooldown of :meth:`moves_for` holds besides).
        """
        if any(i.queued for i in instances) or not self.move_running:
            return []
        running = {i.iid: i.running for i in instances}
        receivers = [(rate, k, i.iid) for k, i in enumerate(instances)
                     if i.running == 0 and (rate := self.solo_rate(i.iid)) is not None]
        receivers.sort(key=lambda x: (-x[0], x[1]))
        out: list[Transfer] = []
        for rate, _, dst in receivers[:self.max_moves]:
            donors = [(r, k, i.iid) for k, i in enumerate(instances)
                      if running[i.iid] > 0 and (r := self.per_request_rate(i.iid, running[i.iid])) is not None]
            if not donors:
                break
            slowest, _, src = min(donors)
            if rate < self.tail_gain * slowest:
                break  # receivers come fastest first: no later one gains enough either
            out.append(Transfer(src, dst, "running", 1))
            running[src] -= 1
        return out

    def moves(self, instances: Sequence[tuple[InstanceId, Sequence[Hashable], Sequence[tuple[Hashable, int]]]],
              now: float, capacities: dict | None = None) -> list[Move]:
        """Request-level plan: ``instances`` are ``(iid, queued_rids, [(running_rid, generated_tokens), ...])``.

        Returns :class:`Move` proposals (and records them for the cooldown at ``now``). A request appears in
        at most one move; a request cooling down is not moved (the plan is cut short instead).
        """
        capacities = capacities or {}
        loads = [InstanceLoad(iid, len(q), len(r), capacities.get(iid)) for iid, q, r in instances]
        by_id = {iid: (q, r) for iid, q, r in instances}
        return self.moves_for(loads, now, lambda i: by_id[i][0], lambda i: by_id[i][1])

    def moves_for(self, loads: Sequence[InstanceLoad], now: float,
                  queued_of: Callable[[InstanceId], Sequence[Hashable]],
                  running_of: Callable[[InstanceId], Sequence[tuple[Hashable, int]]], *,
                  tail: bool = False) -> list[Move]:
        """As :meth:`moves`, from counts plus callbacks that list a donor's requests only when needed. ``tail``: the
        caller holds no queued request either, so when :meth:`plan` has nothing to move, :meth:`tail_plan` may."""
        plan = self.plan(loads) or (self.tail_plan(loads) if tail else [])
        if not plan:
            return []
        cool = self.cooling(now)
        taken: set = set()
        out: list[Move] = []
        for t in plan:
            excl = cool | taken
            if t.kind == "queued":
                rids = select_queued(queued_of(t.src), t.count, excl)
            else:
                rids = select_running(running_of(t.src), t.count, excl)
            for rid in rids:
                taken.add(rid)
                out.append(Move(rid, t.src, t.dst, t.kind))
        for m in out:
            self.last_moved[m.rid] = now
        return out
