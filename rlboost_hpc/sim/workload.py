"""Per-step RL workload (prompts × group responses) and spot-availability input for the simulator.

Both are deterministic functions of their seeds: step ``s`` of every system draws the same lengths
(``numpy.random.default_rng([seed, s])``), so systems are compared on identical work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlboost_hpc.cluster.traces import TraceEvent, load_trace
from rlboost_hpc.sim.profiles import Workload


@dataclass(frozen=True)
class StepWork:
    """Lengths of one step's requests; request ``r`` belongs to group ``r // group``."""

    prompt: np.ndarray    # int, per request (siblings share their prompt length)
    response: np.ndarray  # int, final response length per request

    @property
    def tokens(self) -> int:
        return int(self.prompt.sum() + self.response.sum())


def step_work(w: Workload, seed: int, step: int) -> StepWork:
    """Draw step ``step``'s prompt and response lengths (see :class:`~rlboost_hpc.sim.profiles.Workload`)."""
    rng = np.random.default_rng([seed, step])
    p = np.clip(np.exp(rng.normal(np.log(w.prompt_median), 0.4, w.prompts)), w.min_prompt, 2048).astype(np.int64)
    med = np.exp(rng.normal(np.log(w.response_median), w.sigma_prompt, w.prompts))
    r = med[:, None] * np.exp(rng.normal(0.0, w.sigma_response, (w.prompts, w.group)))
    r = np.clip(r, w.min_response, w.max_response).astype(np.int64).reshape(-1)
    return StepWork(prompt=np.repeat(p, w.group), response=r)


# --------------------------------------------------------------------------------------------- availability


@dataclass(frozen=True)
class Availability:
    """Spot capacity over a window: instances live at the start and the add/remove events after it.

    Times are seconds since the window start. ``name`` identifies an instance of the trace.
    """

    initial: tuple[str, ...]
    events: tuple[TraceEvent, ...]
    source: str = ""

    @staticmethod
    def none() -> "Availability":
        return Availability((), (), "none")

    @staticmethod
    def fixed(n: int) -> "Availability":
        """``n`` instances available throughout, never preempted."""
        return Availability(tuple(f"fixed-{i}" for i in range(n)), (), f"fixed-{n}")


def sample_instances(events: list[TraceEvent], keep_every: int = 2, offset: int = 0) -> list[TraceEvent]:
    """Keep every ``keep_every``-th instance (by order of first appearance), as the paper samples half of the
    Bamboo trace's instances."""
    order: dict[str, int] = {}
    for e in events:
        order.setdefault(e.instance, len(order))
    return [e for e in events if order[e.instance] % keep_every == offset]


def availability(trace: str = "p3", start_s: float = 0.0, duration_s: float | None = None, *,
                 keep_every: int = 2, offset: int = 0) -> Availability:
    """Window ``[start_s, start_s + duration_s)`` of a trace (via :func:`load_trace`), instances sampled."""
    evs = sample_instances(list(load_trace(trace)), keep_every, offset)
    end = float("inf") if duration_s is None else start_s + duration_s
    live: dict[str, None] = {}
    out: list[TraceEvent] = []
    for e in evs:
        if e.t_s <= start_s:
            if e.kind == "add":
                live[e.instance] = None
            else:
                live.pop(e.instance, None)
        elif e.t_s < end:
            out.append(TraceEvent(e.t_s - start_s, e.kind, e.instance))
    return Availability(tuple(live), tuple(out), f"{trace}[{start_s:.0f}s+{duration_s}]")


#: The three 2-hour windows of the (half-sampled) p3 trace used for the paper table (our choice; the paper
#: does not list its windows): A = hours 1–3, B = 5–7, C = 8–10.
SEGMENTS: dict[str, tuple[str, float, float]] = {
    "A": ("p3", 1 * 3600.0, 7200.0),
    "B": ("p3", 5 * 3600.0, 7200.0),
    "C": ("p3", 8 * 3600.0, 7200.0),
}


def segment(name: str) -> Availability:
    trace, start, dur = SEGMENTS[name]
    return availability(trace, start, dur)
