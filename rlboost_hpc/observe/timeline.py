"""Where a step's wall time goes: phases that partition it, instance activity, and the fixed overhead.

Pure (clocks are injected); shared by the trainer (its step's phases), the manager (instance activity and the
intervals in which some engine was generating) and the report.

Invariants:

* A step's phases partition its wall time exactly: :class:`StepTimeline` keeps one current phase at a time and
  every instant between its start and :meth:`StepTimeline.finish` belongs to exactly one span.
* Fixed overhead = the part of a step's wall time in which no rollout engine was generating and the trainer was not
  computing (``train``, ``optimizer``): ``wall − |generating ∪ computing|`` over the step's window
  (:func:`fixed_overhead_s`). It is what a faster engine or trainer cannot shorten.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum


class Phase(StrEnum):
    """What the trainer's step is doing. Every instant of a step is in exactly one phase."""

    SUBMIT = "submit"  # taking prompts, tokenising, submitting the step to the manager
    SEEDING = "seeding"  # the seeding window T_seed: the reserved engine (and ready preemptible ones) generate
    HANDOFF = "handoff"  # closing the seeding window: unfinished seeds migrate to preemptible instances
    REMOTE = "remote_generation"  # waiting for responses while < TAIL_FRACTION of the groups arrived
    TAIL = "tail"  # waiting for the last groups (≥ TAIL_FRACTION arrived): the long-response tail
    REWARD = "reward"  # scoring responses and GRPO advantages
    TRAIN = "train"  # forward/backward of micro-batches (trainer compute)
    OPTIMIZER = "optimizer"  # the optimizer step (trainer compute)
    EXPORT = "export"  # the trainer's weights to host memory (``export_weights``)
    PUBLISH = "publish"  # flattening, checksums and deltas into the weight server
    SET_VERSION = "set_version"  # the manager makes the new version current; instances start pulling
    POLICY = "policy"  # observing the step and deciding T_seed and N_prem
    CHECKPOINT = "checkpoint"  # the run's per-step bookkeeping: checkpoint save (when due), targets, metrics


#: Phases in which the trainer computes (the rest of its time is overhead unless an engine generates meanwhile).
COMPUTE_PHASES = frozenset({Phase.TRAIN, Phase.OPTIMIZER})
#: Share of a step's groups after which waiting for rollout counts as the tail.
TAIL_FRACTION = 0.9


def response_tail_s(done_s: Iterable[float], fraction: float = TAIL_FRACTION) -> float:
    """Seconds from the completion by which ``fraction`` of the responses were done to the last completion.

    ``done_s``: completion times (seconds, one clock); with n responses the first is the ⌈fraction·n⌉-th in time
    order. 0.0 for no responses."""
    t = sorted(done_s)
    if not t:
        return 0.0
    return t[-1] - t[max(0, math.ceil(fraction * len(t)) - 1)]


@dataclass
class StepTimeline:
    """The phases of one step, measured with ``clock`` (seconds, monotonic). Starts in ``initial`` at creation.

    ``spans``: ``(phase, start_s, end_s)``, contiguous and in time order once :meth:`finish` was called."""

    clock: Callable[[], float]
    initial: Phase = Phase.SUBMIT
    spans: list[tuple[Phase, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self._since = self.clock()
        self.current: Phase = self.initial
        self.end: float | None = None

    def enter(self, phase: Phase) -> None:
        """Close the current phase now and continue in ``phase``."""
        now = self.clock()
        if now > self._since:
            self.spans.append((self.current, self._since, now))
        self.current, self._since = phase, now

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the duration of the block, then back to the phase it interrupted."""
        before = self.current
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def split_last(self, phase: Phase, first: Phase, first_s: float) -> None:
        """Relabel the first ``first_s`` seconds of the last span of ``phase`` as ``first`` (a callee measured its
        own first part, e.g. the export inside a publish). No-op when there is no such span."""
        for i in range(len(self.spans) - 1, -1, -1):
            p, a, b = self.spans[i]
            if p == phase:
                cut = min(b, a + max(0.0, first_s))
                self.spans[i:i + 1] = [s for s in ((first, a, cut), (phase, cut, b)) if s[2] > s[1]]
                return

    def finish(self) -> float:
        """Close the current phase; returns the wall time (seconds) from the start."""
        self.enter(self.current)
        self.end = self._since
        return self.end - self.start

    def seconds(self) -> dict[str, float]:
        """Seconds per phase (only phases that occurred), summing to the wall time."""
        out: dict[str, float] = {}
        for p, a, b in self.spans:
            out[p.value] = out.get(p.value, 0.0) + (b - a)
        return out

    def overhead_by_phase(self, generating: Iterable[tuple[float, float]]) -> dict[str, float]:
        """The fixed overhead of the step split by the phase it fell in: for each span outside
        :data:`COMPUTE_PHASES`, the seconds in which no engine was generating (``generating``: ``(start_s,
        end_s)`` intervals, same clock). Sums to :func:`fixed_overhead_s` over the step's window."""
        gen = merge(generating)
        out: dict[str, float] = {}
        for p, a, b in self.spans:
            if p not in COMPUTE_PHASES:
                out[p.value] = out.get(p.value, 0.0) + fixed_overhead_s(a, b, gen)
        return out

    def compute_intervals(self) -> list[tuple[float, float]]:
        """The spans in which the trainer computed (:data:`COMPUTE_PHASES`)."""
        return [(a, b) for p, a, b in self.spans if p in COMPUTE_PHASES]


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of ``intervals`` (``(start, end)`` seconds; empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def fixed_overhead_s(start: float, end: float, busy: Iterable[tuple[float, float]]) -> float:
    """Seconds of ``[start, end]`` covered by none of ``busy`` (engines generating, trainer computing): the union
    of the busy intervals clipped to the window, subtracted from its length. Never negative."""
    covered = sum(min(b, end) - max(a, start) for a, b in merge(busy) if min(b, end) > max(a, start))
    return max(0.0, (end - start) - covered)


class Activity(StrEnum):
    """What a rollout instance is doing, as the manager sees it (instance-seconds are counted per activity)."""

    BUSY = "busy"  # has responses in flight
    IDLE = "idle"  # holds the latest version, nothing in flight
    PULLING = "pulling"  # loading a weight version


@dataclass
class ActivityClock:
    """Instance-seconds per :class:`Activity` and the intervals in which at least one instance was busy, kept by
    events: the owner calls :meth:`set` whenever an instance's activity may have changed, and the clock charges each
    instance's time to the activity it held, exactly. A call costs O(1) whatever the number of instances N (a
    sampling clock that re-reads all N instances at every message costs O(N) per message, O(N²) per step);
    :meth:`flush` (O(N)) brings every per-instance figure up to a given instant, before they are read.

    ``generating``: merged ``(start_s, end_s)`` intervals since the last :meth:`take`, at most ``max_intervals``
    (older ones are merged into one when the cap is reached, so the list stays bounded whatever the churn)."""

    max_intervals: int = 10_000
    total_s: dict[str, float] = field(default_factory=lambda: {a.value: 0.0 for a in Activity})
    by_instance_s: dict[str, dict[str, float]] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=lambda: {a.value: 0.0 for a in Activity})
    step_by_instance_s: dict[str, dict[str, float]] = field(default_factory=dict)
    generating: list[tuple[float, float]] = field(default_factory=list)
    _current: dict[str, tuple[Activity, float]] = field(default_factory=dict)  # key -> (activity, charged until)
    _busy: int = 0  # instances whose current activity is BUSY
    _busy_since: float = 0.0  # start of the current generating interval (while _busy > 0)

    def set(self, key: str, act: Activity | None, now: float) -> None:
        """Instance ``key`` does ``act`` from ``now`` on (``None``: not counted); the time since its previous
        change is charged to the activity it held. A repeated activity changes nothing."""
        cur = self._current.get(key)
        if cur is not None and cur[0] is act:
            return
        if cur is not None:
            self._charge(key, cur[0], cur[1], now)
        if act is None:
            self._current.pop(key, None)
        else:
            self._current[key] = (act, now)
        was_busy, is_busy = cur is not None and cur[0] is Activity.BUSY, act is Activity.BUSY
        if is_busy and not was_busy:
            self._busy += 1
            if self._busy == 1:
                self._busy_since = now
        elif was_busy and not is_busy:
            self._busy -= 1
            if self._busy == 0:
                self._generating(self._busy_since, now)

    def flush(self, now: float) -> None:
        """Charge every instance's time up to ``now`` (O(N)); the generating interval open now is closed at
        ``now`` and continues from it."""
        for key, (act, since) in self._current.items():
            self._charge(key, act, since, now)
            self._current[key] = (act, max(since, now))
        if self._busy and now > self._busy_since:
            self._generating(self._busy_since, now)
            self._busy_since = now

    def _charge(self, key: str, act: Activity, since: float, now: float) -> None:
        dt = now - since
        if dt <= 0:
            return
        for acc in (self.by_instance_s, self.step_by_instance_s):
            acc.setdefault(key, {a.value: 0.0 for a in Activity})[act.value] += dt
        self.total_s[act.value] += dt
        self.step_s[act.value] += dt

    def _generating(self, start: float, end: float) -> None:
        if end <= start:
            return
        if self.generating and self.generating[-1][1] >= start:
            self.generating[-1] = (self.generating[-1][0], max(end, self.generating[-1][1]))
            return
        if len(self.generating) >= self.max_intervals:
            self.generating[:2] = [(self.generating[0][0], self.generating[1][1])]
        self.generating.append((start, end))

    def forget(self, key: str) -> None:
        """Drop the per-instance record of an instance that is gone (after ``set(key, None, …)``; its seconds stay
        in the totals)."""
        self.by_instance_s.pop(key, None)

    def take(self, now: float | None = None) -> dict:
        """The step's instance-seconds per activity (``instance_s``: all instances; ``by_instance_s``: per instance)
        and its generating intervals, charged up to ``now`` (:meth:`flush`; None: as charged so far); starts the
        next step."""
        if now is not None:
            self.flush(now)
        out = {"instance_s": dict(self.step_s), "by_instance_s": self.step_by_instance_s,
               "generating": [list(iv) for iv in self.generating]}
        self.step_s = {a.value: 0.0 for a in Activity}
        self.step_by_instance_s = {}
        self.generating = []
        return out


def add_phase(step: dict, phase: Phase, seconds: float) -> None:
    """Extend a finished step's metrics (``phase_s``, ``wall_s``, ``fixed_overhead_s``) by ``seconds`` of
    ``phase`` spent after the trainer's step returned, while no engine generated (between steps nothing is in
    flight) and the trainer did not compute — e.g. the run's checkpoint of that step."""
    for key in ("phase_s", "fixed_overhead_s_by_phase"):
        step[key][phase.value] = step[key].get(phase.value, 0.0) + seconds
    step["wall_s"] += seconds
    step["fixed_overhead_s"] += seconds


def summarize(steps: list[dict]) -> dict:
    """The report's view of the step timelines: mean seconds per step of each phase (``step_phase_s_mean``), of the
    fixed overhead (``fixed_overhead_s_per_step``) and of the overhead by phase (``fixed_overhead_s_by_phase``),
    and the overhead's share of the summed wall time (``fixed_overhead_share``; 0 with no steps)."""
    n = max(1, len(steps))
    wall = sum(m["wall_s"] for m in steps)
    over = sum(m.get("fixed_overhead_s", 0.0) for m in steps)

    def mean_by_phase(key: str) -> dict[str, float]:
        acc: dict[str, float] = {}
        for m in steps:
            for p, sec in m.get(key, {}).items():
                acc[p] = acc.get(p, 0.0) + sec / n
        return {p.value: acc[p.value] for p in Phase if p.value in acc}

    return {"step_phase_s_mean": mean_by_phase("phase_s"), "fixed_overhead_s_by_phase": mean_by_phase(
        "fixed_overhead_s_by_phase"), "fixed_overhead_s_per_step": over / n,
            "fixed_overhead_share": over / wall if wall > 0 else 0.0}
