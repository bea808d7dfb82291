"""Replay a spot-availability trace onto local worker slots — the plan (pure, deterministic).

:class:`ReplayPlan` turns trace events (:mod:`rlboost_hpc.cluster.traces`) into a schedule of
:class:`ReplayAction` ``(at_s, action, slot)`` in *wall* seconds from the start of the replay;
:class:`~rlboost_hpc.cluster.replay.ReplayDriver` applies it to processes.

Scaling rule (one place, :func:`scale_window`). For a window ``[w0, w0 + W)`` of trace time:

* the initial live count ``L0`` is the count after every event with ``t_s <= w0``; the window's changes are the
  distinct event times ``w0 < t < w0 + W`` (``W = None``: to the end of the trace);
* ``peak`` is the largest live count in the window (``L0`` included);
* ``target(L) = clamp(floor(L * max_workers / peak + 1/2), min_workers, max_workers)`` (round half up, exact
  integer arithmetic); when ``peak == 0`` the target is ``min_workers``;
* only times where the target changes produce actions. A trace change at ``t`` happens at wall time
  ``(t - w0) / time_scale`` (``time_scale`` = trace seconds per wall second).

Plan invariants (checked by :meth:`ReplayPlan.from_actions` for hand-written plans too):

* actions are sorted by ``at_s`` (>= 0); a ``start`` names a slot that is not live, a ``preempt``/``kill`` one
  that is; slots are in ``range(max_workers)``, so at most ``max_workers`` slots are ever live;
* a start takes the lowest free slot; a removal picks its victim by ``victim`` (``"random"``: seeded choice
  among live slots; ``"oldest"``/``"newest"``: by start time, ties by slot number);
* of the ``n`` removals, exactly ``floor(kill_fraction * n + 1/2)`` are ``kill`` (no warning, SIGKILL), chosen
  by the seeded RNG; the others are ``preempt`` (warning signal). Same inputs and seed -> same plan.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal, Sequence

from rlboost_hpc.cluster.traces import TraceEvent, live_counts

log = logging.getLogger(__name__)

ActionKind = Literal["start", "preempt", "kill"]
Victim = Literal["random", "oldest", "newest"]
ACTION_KINDS: tuple[str, ...] = ("start", "preempt", "kill")

#: Default slot count of :func:`choose_window` (the size of the local demo).
DEFAULT_MAX_WORKERS = 3


# ============================================================================================ planning


@dataclass(frozen=True, slots=True)
class ReplayAction:
    """One scheduled change: at ``at_s`` wall seconds from the replay start, start/preempt/kill ``slot``.

    ``trace_t_s`` is the trace time (seconds) of the change that caused it and ``target`` the scaled number of
    live slots after that change (both informational; 0 in hand-written plans).
    """

    at_s: float
    action: ActionKind
    slot: int
    trace_t_s: float = 0.0
    target: int = 0


@dataclass(frozen=True, slots=True)
class ScaledWindow:
    """A trace window scaled to slots (see the module docstring for the rule).

    Attributes:
        window_start_s / window_end_s: trace seconds (end ``math.inf`` when the window is open).
        initial_live / initial_target: live count and scaled target at the window start.
        peak: largest live count in the window.
        changes: ``(trace_t_s, live, target)`` for each time in the window where the *target* changes.
    """

    window_start_s: float
    window_end_s: float
    initial_live: int
    initial_target: int
    peak: int
    changes: tuple[tuple[float, int, int], ...]

    @property
    def n_starts(self) -> int:
        """Slot starts after the initial ones (sum of target increases)."""
        prev, n = self.initial_target, 0
        for _, _, tgt in self.changes:
            n += max(0, tgt - prev)
            prev = tgt
        return n

    @property
    def n_removals(self) -> int:
        """Slot removals (sum of target decreases)."""
        prev, n = self.initial_target, 0
        for _, _, tgt in self.changes:
            n += max(0, prev - tgt)
            prev = tgt
        return n


@dataclass(frozen=True, slots=True)
class SlotLifetime:
    """One worker life in a plan: ``slot`` live from ``start_s`` to ``end_s`` (wall seconds).

    ``end_s`` is ``None`` and ``end`` is ``"end"`` when the plan does not remove it; ``end`` is otherwise the
    removing action (``"preempt"`` or ``"kill"``).
    """

    slot: int
    start_s: float
    end_s: float | None
    end: str

    def duration(self, plan_end_s: float) -> float:
        """Seconds live, counting a worker still live at the end as live until ``plan_end_s``."""
        return (plan_end_s if self.end_s is None else self.end_s) - self.start_s


def check_number(name: str, value: float, *, lo: float | None = None, lo_open: bool = False,
                  hi: float | None = None) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite number within the bounds (``lo_open``: > lo)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")


def check_int(name: str, value: int, lo: int) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int (not a bool) ≥ ``lo``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _target(live: int, peak: int, max_workers: int, min_workers: int) -> int:
    if peak <= 0:
        return min_workers
    t = (2 * live * max_workers + peak) // (2 * peak)  # floor(live*M/peak + 1/2), exact
    return max(min_workers, min(max_workers, t))


def _scale_counts(counts: Sequence[tuple[float, int]], window_start_s: float, window_s: float | None,
                  max_workers: int, min_workers: int) -> ScaledWindow:
    end = math.inf if window_s is None else window_start_s + window_s
    initial = 0
    inside: list[tuple[float, int]] = []
    for t, c in counts:
        if t <= window_start_s:
            initial = c
        elif t < end:
            inside.append((t, c))
        else:
            break
    peak = max([initial] + [c for _, c in inside])
    init_tgt = _target(initial, peak, max_workers, min_workers)
    changes: list[tuple[float, int, int]] = []
    prev = init_tgt
    for t, c in inside:
        tgt = _target(c, peak, max_workers, min_workers)
        if tgt != prev:
            changes.append((t, c, tgt))
            prev = tgt
    return ScaledWindow(window_start_s, end, initial, init_tgt, peak, tuple(changes))


def scale_window(events: Iterable[TraceEvent], *, window_start_s: float = 0.0, window_s: float | None = None,
                 max_workers: int, min_workers: int = 0) -> ScaledWindow:
    """Scale the live count of a trace window to ``[min_workers, max_workers]`` slots (rule: module docstring).

    Raises:
        ValueError: ``window_start_s < 0``, ``window_s <= 0``, ``max_workers < 1`` or ``min_workers`` outside
            ``[0, max_workers]``.
    """
    check_number("window_start_s", window_start_s, lo=0)
    if window_s is not None:
        check_number("window_s", window_s, lo=0, lo_open=True)
    check_int("max_workers", max_workers, 1)
    check_int("min_workers", min_workers, 0)
    if min_workers > max_workers:
        raise ValueError(f"min_workers ({min_workers}) > max_workers ({max_workers})")
    return _scale_counts(live_counts(events), float(window_start_s), window_s, max_workers, min_workers)


@dataclass(frozen=True)
class ReplayPlan:
    """A validated, time-sorted schedule of :class:`ReplayAction` (see the module docstring for invariants).

    Iterating, ``len()`` and indexing go over :attr:`actions`, so a plan can be used as a list of actions.

    Attributes:
        actions: the schedule.
        max_workers: slots are ``range(max_workers)``.
        duration_s: wall seconds the replayed window lasts (the driver's natural end).
        time_scale: trace seconds per wall second.
        window: the scaled trace window (``None`` for hand-written plans).
        seed, kill_fraction, victim: the inputs that produced the plan.
    """

    actions: tuple[ReplayAction, ...]
    max_workers: int
    duration_s: float
    time_scale: float = 1.0
    window: ScaledWindow | None = None
    seed: int | None = None
    kill_fraction: float = 0.0
    victim: str = "random"

    # ---- list-like view
    def __iter__(self) -> Iterator[ReplayAction]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def __getitem__(self, i: int) -> ReplayAction:
        return self.actions[i]

    def n_actions(self, kind: ActionKind) -> int:
        """How many actions of ``kind`` (``"start"``, ``"preempt"`` or ``"kill"``) the plan holds."""
        return sum(1 for a in self.actions if a.action == kind)

    # ---- constructors
    @classmethod
    def from_trace(cls, events: Iterable[TraceEvent], *, window_start_s: float = 0.0,
                   window_s: float | None = None, time_scale: float = 1.0, max_workers: int,
                   kill_fraction: float = 0.0, seed: int = 0, min_workers: int = 0,
                   victim: Victim = "random") -> "ReplayPlan":
        """Plan the replay of a trace window on ``max_workers`` slots.

        Args:
            events: trace events (any order; replayed after a stable sort by time).
            window_start_s: trace seconds where the replay starts (its state there is started at wall 0).
            window_s: trace seconds replayed; ``None``: to the last event.
            time_scale: trace seconds per wall second (> 0), e.g. 3600 / 150 replays an hour in 150 s.
            max_workers: number of slots (>= 1); the peak of the window maps to it.
            kill_fraction: share (0..1) of removals that are ``kill`` (SIGKILL, no warning) instead of
                ``preempt``; the count is ``floor(kill_fraction * removals + 1/2)``.
            seed: seeds the victim choice (``victim="random"``) and which removals are kills.
            min_workers: lower clamp of the scaled target (0: the trace may leave no slot live).
            victim: ``"random"`` (seeded), ``"oldest"`` or ``"newest"`` live slot is removed.

        Raises:
            ValueError: an argument is out of range (negative start, non-positive window or time scale,
                ``max_workers < 1``, ``kill_fraction`` outside [0, 1], unknown ``victim``).
        """
        check_number("time_scale", time_scale, lo=0, lo_open=True)
        check_number("kill_fraction", kill_fraction, lo=0, hi=1)
        if victim not in ("random", "oldest", "newest"):
            raise ValueError(f"victim must be 'random', 'oldest' or 'newest', got {victim!r}")
        evs = sorted(events, key=lambda e: e.t_s)
        win = scale_window(evs, window_start_s=window_start_s, window_s=window_s, max_workers=max_workers,
                           min_workers=min_workers)
        w0 = float(window_start_s)
        rng = random.Random(seed)
        live: dict[int, float] = {}  # slot -> wall start time
        steps: list[tuple[float, str, int, float, int]] = []  # (at_s, "start"|"remove", slot, trace_t, target)

        def start(at: float, trace_t: float, tgt: int) -> None:
            slot = min(s for s in range(max_workers) if s not in live)
            live[slot] = at
            steps.append((at, "start", slot, trace_t, tgt))

        def remove(at: float, trace_t: float, tgt: int) -> None:
            if victim == "random":
                slot = rng.choice(sorted(live))
            elif victim == "oldest":
                slot = min(live, key=lambda s: (live[s], s))
            else:
                slot = max(live, key=lambda s: (live[s], s))
            del live[slot]
            steps.append((at, "remove", slot, trace_t, tgt))

        for _ in range(win.initial_target):
            start(0.0, w0, win.initial_target)
        for trace_t, _live, tgt in win.changes:
            at = (trace_t - w0) / time_scale
            while len(live) < tgt:
                start(at, trace_t, tgt)
            while len(live) > tgt:
                remove(at, trace_t, tgt)

        removal_idx = [i for i, s in enumerate(steps) if s[1] == "remove"]
        n_kill = math.floor(kill_fraction * len(removal_idx) + 0.5)
        kills = set(rng.sample(removal_idx, n_kill))
        actions = tuple(
            ReplayAction(at, "start" if kind == "start" else ("kill" if i in kills else "preempt"), slot, tt, tgt)
            for i, (at, kind, slot, tt, tgt) in enumerate(steps)
        )
        if window_s is not None:
            duration = window_s / time_scale
        else:
            duration = max(0.0, (evs[-1].t_s - w0) / time_scale) if evs else 0.0
        plan = cls(actions, max_workers, duration, float(time_scale), win, seed, float(kill_fraction), victim)
        plan._validate()
        return plan

    @classmethod
    def from_actions(cls, actions: Iterable[ReplayAction], *, max_workers: int | None = None,
                     duration_s: float | None = None) -> "ReplayPlan":
        """Wrap a hand-written schedule (stable-sorted by ``at_s``) after checking the plan invariants.

        Args:
            max_workers: slot count; default one more than the largest slot used (at least 1).
            duration_s: default the time of the last action.

        Raises:
            ValueError: unknown action kind, negative time, slot outside ``range(max_workers)``, a start of a
                live slot or a removal of a slot that is not live.
        """
        acts = sorted(actions, key=lambda a: a.at_s)
        if max_workers is None:
            max_workers = max([a.slot for a in acts] + [0]) + 1
        if duration_s is None:
            duration_s = acts[-1].at_s if acts else 0.0
        plan = cls(tuple(acts), max_workers, float(duration_s))
        plan._validate()
        return plan

    def _validate(self) -> None:
        check_int("max_workers", self.max_workers, 1)
        live: set[int] = set()
        prev = 0.0
        for i, a in enumerate(self.actions):
            where = f"action {i} {a}"
            if a.action not in ACTION_KINDS:
                raise ValueError(f"{where}: unknown action {a.action!r}")
            check_number(f"{where}: at_s", a.at_s, lo=0)
            if a.at_s < prev:
                raise ValueError(f"{where}: actions are not sorted by time")
            prev = a.at_s
            if isinstance(a.slot, bool) or not isinstance(a.slot, int) or not 0 <= a.slot < self.max_workers:
                raise ValueError(f"{where}: slot outside range({self.max_workers})")
            if a.action == "start":
                if a.slot in live:
                    raise ValueError(f"{where}: slot {a.slot} is already live")
                live.add(a.slot)
            else:
                if a.slot not in live:
                    raise ValueError(f"{where}: slot {a.slot} is not live")
                live.discard(a.slot)

    # ---- analysis
    def live_over_time(self) -> list[tuple[float, int]]:
        """``(at_s, live slots)`` after each distinct action time."""
        out: list[tuple[float, int]] = []
        n = 0
        for a in self.actions:
            n += 1 if a.action == "start" else -1
            if out and out[-1][0] == a.at_s:
                out[-1] = (a.at_s, n)
            else:
                out.append((a.at_s, n))
        return out

    def lifetimes(self) -> list[SlotLifetime]:
        """Every worker life the plan implies, in start order."""
        open_: dict[int, int] = {}
        lives: list[list[Any]] = []
        for a in self.actions:
            if a.action == "start":
                open_[a.slot] = len(lives)
                lives.append([a.slot, a.at_s, None, "end"])
            else:
                rec = lives[open_.pop(a.slot)]
                rec[2], rec[3] = a.at_s, a.action
        return [SlotLifetime(*r) for r in lives]

    def describe(self) -> str:
        """A printable table of the plan (one action per line) with a one-line header."""
        head = (f"plan: {len(self)} actions ({self.n_actions('start')} start, {self.n_actions('preempt')} "
                f"preempt, {self.n_actions('kill')} kill) on {self.max_workers} slots over {self.duration_s:.1f} s")
        if self.window is not None:
            end = self.window.window_end_s
            head += (f"; trace window [{self.window.window_start_s:.0f}, "
                     f"{'end' if math.isinf(end) else f'{end:.0f}'}) s, x{self.time_scale:g}, "
                     f"peak {self.window.peak}")
        lines = [head]
        for a in self.actions:
            lines.append(f"  {a.at_s:8.2f} s  {a.action:<7} slot {a.slot}  (trace t={a.trace_t_s:.0f} s, "
                         f"target {a.target})")
        return "\n".join(lines)


def choose_window(events: Iterable[TraceEvent], window_s: float, min_changes: int, *,
                  max_workers: int = DEFAULT_MAX_WORKERS, min_workers: int = 0, min_starts: int = 0,
                  min_removals: int = 0) -> float:
    """Earliest window start (trace seconds) whose scaled target changes at least ``min_changes`` times.

    Candidate starts are 0 and every distinct event time, in increasing order; the first candidate whose
    window ``[start, start + window_s)`` (scaled as in :func:`scale_window`) has ``>= min_changes`` target
    changes, ``>= min_starts`` slot starts after the initial ones and ``>= min_removals`` slot removals wins.
    Deterministic (no randomness involved).

    Raises:
        ValueError: bad arguments, or no candidate window qualifies (the message repeats the demands).
    """
    check_number("window_s", window_s, lo=0, lo_open=True)
    check_int("min_changes", min_changes, 0)
    check_int("max_workers", max_workers, 1)
    check_int("min_workers", min_workers, 0)
    if min_workers > max_workers:
        raise ValueError(f"min_workers ({min_workers}) > max_workers ({max_workers})")
    counts = live_counts(events)
    for start in sorted({0.0} | {t for t, _ in counts}):
        win = _scale_counts(counts, start, window_s, max_workers, min_workers)
        if (len(win.changes) >= min_changes and win.n_starts >= min_starts
                and win.n_removals >= min_removals):
            return start
    raise ValueError(f"no {window_s:g} s window has >= {min_changes} target changes, >= {min_starts} starts and "
                     f">= {min_removals} removals on {max_workers} slots")
