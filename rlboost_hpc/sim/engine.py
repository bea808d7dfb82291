"""Fluid model of one rollout engine (continuous batching, one token per running request per iteration).

Between two events the running set is fixed, so the engine's state is advanced in closed form instead of
token by token. With ``g`` the engine's iteration counter, request ``i`` that (re)joined the running batch at
``g0_i`` with context ``c0_i`` has context ``c0_i + (g − g0_i)``; the context sum is ``S(g) = K + B·g`` with
``K = Σ (c0_i − g0_i)``. One iteration takes ``a + b·B + γ·S`` seconds (:class:`EnginePerf`), so advancing
``Δ`` iterations takes ``T(Δ) = Δ·(a + b·B + γ·S) + γ·B·Δ²/2`` and the inverse is a square root.

Internal events: the next completion (smallest remaining budget among running requests) and the KV cache
filling up (``S`` reaching the capacity: requests with the fewest generated tokens are retracted back to the
engine's waiting queue, keeping their tokens, until ``S <= retract_to·capacity`` — SGLang's retract
behaviour). Admission from the waiting queue (FIFO) needs ``S + ctx + (B+1)·reserve <= retract_to·capacity``
(below the retraction point, so a retracted request is never re-admitted at once) and ``B < max_running``
(an empty batch always admits one request); admitted requests cost a prefill of
their whole context (prompt + tokens generated so far), during which decode stalls.

Token counts are floats (fluid); a request completes when its generated count reaches its target length.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from rlboost_hpc.sim.profiles import EnginePerf

# request states
QUEUED, WAITING, RUNNING, DONE = 0, 1, 2, 3
_EPS = 1e-6


class Req:
    """One response of the step (token-level state as the manager sees it)."""

    __slots__ = ("rid", "gid", "prompt", "target", "n", "state", "eng", "g0", "k", "g_fin", "migrations",
                 "done_at", "regenerated", "step", "ver", "n0", "by_ver")

    def __init__(self, rid: int, gid: int, prompt: int, target: int, step: int = 0) -> None:
        self.rid = rid
        self.gid = gid
        self.step = step      # the RL step it belongs to (bounded staleness: several steps are in flight)
        self.ver = 0          # the weight version of the engine it was last dispatched to ...
        self.n0 = 0.0         # ... when it had generated this many tokens
        self.by_ver: dict[int, float] | None = None  # tokens generated per version, credited when it leaves an engine
        self.prompt = prompt
        self.target = float(target)
        self.n = 0.0          # generated tokens (exact while not RUNNING; see Engine.generated while RUNNING)
        self.state = QUEUED
        self.eng: Engine | None = None
        self.g0 = 0.0
        self.k = 0.0          # c0 - g0 (contribution to K)
        self.g_fin = 0.0
        self.migrations = 0
        self.done_at = -1.0
        self.regenerated = 0.0


class Engine:
    """One rollout engine; ``kind`` is ``"reserved"`` or ``"remote"``."""

    __slots__ = ("eid", "kind", "perf", "t", "g", "B", "K", "running", "heap", "waiting", "ver", "retract_to",
                 "busy_acc", "busy_since", "tokens_out", "prefill_s", "on_done", "last_completion")

    def __init__(self, eid: str, kind: str, perf: EnginePerf, on_done, *, retract_to: float = 0.92) -> None:
        self.eid = eid
        self.kind = kind
        self.perf = perf
        self.t = 0.0
        self.g = 0.0
        self.B = 0
        self.K = 0.0
        self.running: dict[int, Req] = {}
        self.heap: list[tuple[float, int]] = []
        self.waiting: deque[Req] = deque()
        self.ver = 0
        self.retract_to = retract_to
        self.busy_acc = 0.0
        self.busy_since: float | None = None
        self.tokens_out = 0.0
        self.prefill_s = 0.0
        self.on_done = on_done
        self.last_completion = -1.0

    # ------------------------------------------------------------------ state
    @property
    def S(self) -> float:
        return self.K + self.B * self.g

    def load(self) -> int:
        return self.B + len(self.waiting)

    def generated(self, r: Req) -> float:
        return r.n + (self.g - r.g0) if r.state == RUNNING else r.n

    def iter_time(self) -> float:
        return self.perf.iter_time(self.B, self.S)

    def throughput(self) -> float:
        """Current decode tokens/s (0 when idle)."""
        return self.B / self.iter_time() if self.B else 0.0

    def _busy(self, now: float) -> None:
        if self.load() > 0:
            if self.busy_since is None:
                self.busy_since = now
        elif self.busy_since is not None:
            self.busy_acc += now - self.busy_since
            self.busy_since = None

    def busy_time(self, now: float) -> float:
        return self.busy_acc + (now - self.busy_since if self.busy_since is not None else 0.0)

    # ------------------------------------------------------------------ time
    def advance(self, now: float) -> None:
        """Decode until ``now`` (no internal event may lie before ``now``; the simulator guarantees it)."""
        if now <= self.t:
            return
        if self.B == 0:
            self.t = now
            return
        p = self.perf
        c1 = p.a + p.b * self.B + p.gamma * (self.K + self.B * self.g)
        c2 = p.gamma * self.B
        dt = now - self.t
        if c2 > 0:
            d = 2.0 * dt / (c1 + math.sqrt(c1 * c1 + 2.0 * c2 * dt))
        else:
            d = dt / c1
        self.g += d
        self.tokens_out += d * self.B
        self.t = now

    def _dt(self, d: float) -> float:
        p = self.perf
        c1 = p.a + p.b * self.B + p.gamma * (self.K + self.B * self.g)
        return d * c1 + 0.5 * p.gamma * self.B * d * d

    def next_event(self) -> float | None:
        """Time of the next internal event (completion or KV full), or ``None`` when idle."""
        if self.B == 0:
            return None
        heap, running = self.heap, self.running
        while heap:
            gf, rid = heap[0]
            r = running.get(rid)
            if r is None or r.g_fin != gf:
                heapq.heappop(heap)
                continue
            break
        d = heap[0][0] - self.g if heap else math.inf
        room = self.perf.kv_capacity - self.S
        dkv = room / self.B
        if dkv < d:
            d = dkv
        return self.t + self._dt(max(0.0, d))

    # ------------------------------------------------------------------ events
    def on_event(self, now: float) -> None:
        """Handle completions and KV-full at ``now`` (the time returned by :meth:`next_event`)."""
        self.advance(now)
        heap, running = self.heap, self.running
        while heap:
            gf, rid = heap[0]
            r = running.get(rid)
            if r is None or r.g_fin != gf:
                heapq.heappop(heap)
                continue
            if gf > self.g + _EPS:
                break
            heapq.heappop(heap)
            self._remove(r)
            r.n = r.target
            r.state = DONE
            r.eng = None
            r.done_at = now
            self.last_completion = now
            self.on_done(r, now)
        if self.B and self.S >= self.perf.kv_capacity - _EPS * self.B:
            self._retract(now)
        self.admit(now)

    def _remove(self, r: Req) -> None:
        del self.running[r.rid]
        self.B -= 1
        self.K -= r.k
        if self.B == 0:
            self.K = 0.0
            self.g = 0.0
            self.heap.clear()

    def _retract(self, now: float) -> None:
        target = self.retract_to * self.perf.kv_capacity
        cands = sorted(self.running.values(), key=lambda r: (self.generated(r), r.rid))
        for r in cands:
            if self.S <= target or self.B <= 1:
                break
            r.n = self.generated(r)
            self._remove(r)
            r.state = WAITING
            self.waiting.appendleft(r)

    def take(self, r: Req) -> None:
        """Put ``r`` into this engine's waiting queue (dispatch or migration target)."""
        r.state = WAITING
        r.eng = self
        self.waiting.append(r)

    def admit(self, now: float) -> int:
        """Admit waiting requests that fit; returns how many (their prefill stalls decode)."""
        if not self.waiting:
            self._busy(now)
            return 0
        p = self.perf
        self.advance(now)
        start = max(self.t, now)
        stall = 0.0
        n = 0
        S = self.S
        while self.waiting:
            r = self.waiting[0]
            ctx = r.prompt + r.n
            if self.B > 0 and (self.B >= p.max_running
                               or S + ctx + (self.B + 1) * p.reserve_tokens > self.retract_to * p.kv_capacity):
                break
            self.waiting.popleft()
            stall += p.prefill_time(ctx)
            r.state = RUNNING
            r.eng = self
            r.g0 = self.g
            r.k = ctx - self.g
            r.g_fin = self.g + (r.target - r.n)
            self.K += r.k
            self.B += 1
            S += ctx
            self.running[r.rid] = r
            heapq.heappush(self.heap, (r.g_fin, r.rid))
            n += 1
        if n:
            stall += p.pf_fixed
            self.prefill_s += stall
            self.t = start + stall
        self._busy(now)
        return n

    def evict_all(self, now: float) -> list[Req]:
        """Remove every request (preemption, end of seeding): returns them with their generated counts."""
        self.advance(now)
        out = []
        for r in sorted(self.running.values(), key=lambda r: r.rid):
            r.n = self.generated(r)
            out.append(r)
        self.running.clear()
        self.heap.clear()
        self.B = 0
        self.K = 0.0
        self.g = 0.0
        out.extend(self.waiting)
        self.waiting.clear()
        for r in out:
            r.state = QUEUED
            r.eng = None
        self._busy(now)
        return out

    def pop_running(self, rids: list[int], now: float) -> list[Req]:
        """Take specific running requests out (balancer migration)."""
        self.advance(now)
        out = []
        for rid in rids:
            r = self.running.get(rid)
            if r is None:
                continue
            r.n = self.generated(r)
            self._remove(r)
            r.state = QUEUED
            r.eng = None
            out.append(r)
        self._busy(now)
        return out

    def pop_waiting(self, rids: list[int], now: float) -> list[Req]:
        want = set(rids)
        keep: deque[Req] = deque()
        out = []
        for r in self.waiting:
            if r.rid in want:
                r.state = QUEUED
                r.eng = None
                out.append(r)
            else:
                keep.append(r)
        self.waiting = keep
        self._busy(now)
        return out
