"""The steps in flight of a simulated run and its bounded-staleness mode.

This module owns the admitted steps (:class:`StepPool`: one step's responses, queued when the step is admitted)
and what bounded staleness (``SystemSpec.max_staleness`` = k ≥ 1) adds to them in a
:class:`~rlboost_hpc.sim.simulator.Simulation`: up to k + 1 steps admitted at once (the next k queue behind the
current one, so the pool generates while the trainer trains), each response's tokens credited to the weight
version that generated them, and the staleness of the tokens a step trains. With k = 0 one step is admitted at a
time and every token has staleness 0. :class:`Staleness` is a collaborator of the simulation: it owns k and the
workload it admits from; the version a response is credited to is the caller's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlboost_hpc.sim.engine import Req
from rlboost_hpc.sim.workload import step_work

#: Request ids are ``step · RID_STRIDE + index``: unique over the steps in flight, ordered as before within a step.
RID_STRIDE = 1 << 32


@dataclass
class StepPool:
    """One admitted step's responses: ``reqs`` (G consecutive per group), responses done per group, responses done,
    groups complete before the step became current (bounded staleness), its tokens, when its last response ended."""

    reqs: list[Req]
    gdone: list[int]
    tokens: int
    n_done: int = 0
    early_groups: list[int] = field(default_factory=list)
    rollout_done_at: float | None = None


class Staleness:
    """Admission of steps and per-version token accounting of a simulation: ``k`` (``SystemSpec.max_staleness``),
    the ``workload`` and ``seed`` each step's lengths are drawn from (``step_work``)."""

    def __init__(self, k: int, workload, seed: int) -> None:
        self.k, self.workload, self.seed = k, workload, seed

    def admit(self, step: int) -> StepPool:
        """``step``'s responses (its workload: ``step_work``), for the caller to queue."""
        w = step_work(self.workload, self.seed, step)
        G = self.workload.group
        reqs = [Req(step * RID_STRIDE + i, i // G, int(w.prompt[i]), int(w.response[i]), step)
                for i in range(len(w.response))]
        return StepPool(reqs, [0] * (len(reqs) // G), w.tokens)

    def took(self, r: Req, version: int) -> None:
        """Bounded staleness: ``r`` goes to an engine that holds ``version``, the current one (only holders are
        routable)."""
        if self.k:
            r.ver, r.n0 = version, r.n

    def left(self, r: Req) -> None:
        """Bounded staleness: ``r`` left its engine (done, evicted, moved): credit its new tokens to the version."""
        if self.k and r.n > r.n0:
            if r.by_ver is None:
                r.by_ver = {}
            r.by_ver[r.ver] = r.by_ver.get(r.ver, 0.0) + r.n - r.n0
            r.n0 = r.n

    def by_staleness(self, pool: StepPool, version: int) -> dict[str, float]:
        """Generated tokens of ``pool`` (trained by ``version``) by staleness: {"0": all} when k = 0."""
        if not self.k:
            return {"0": float(sum(r.target for r in pool.reqs))}
        out: dict[str, float] = {}
        for r in pool.reqs:
            for v, n in (r.by_ver or {}).items():
                out[str(version - v)] = out.get(str(version - v), 0.0) + n
        return out
