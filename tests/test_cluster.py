"""Tests of rlboost_hpc.cluster: trace parsers (real Bamboo/Parcae data), replay planning and the replay driver.

Unit tests use an injected fake clock and :class:`FakeProcess` (a test double); one integration test drives
real child processes (a few hundred milliseconds).
"""
from __future__ import annotations

import logging
import math
import signal
import subprocess
import sys
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost_hpc.cluster.replay import ReplayDriver
from rlboost_hpc.cluster.replay_plan import ReplayAction, ReplayPlan, choose_window, scale_window
from rlboost_hpc.cluster.traces import (
    G4DN_TRACE,
    P3_TRACE,
    TraceEvent,
    TraceFormatError,
    count_at,
    live_counts,
    load_trace,
    parse_bamboo_csv,
    parse_parcae_segment,
    parse_parcae_segments,
    resolve_trace_path,
    trace_stats,
)
from rlboost_hpc.paths import DataFileMissing, data_file

# ============================================================================================ helpers


def ev(t: float, kind: str, name: str) -> TraceEvent:
    return TraceEvent(float(t), kind, name)  # type: ignore[arg-type]


def synthetic() -> list[TraceEvent]:
    """Live counts: t=0 -> 4, 100 -> 3, 200 -> 1, 300 -> 2, 400 -> 4."""
    return (
        [ev(0, "add", n) for n in "abcd"]
        + [ev(100, "remove", "a"), ev(200, "remove", "b"), ev(200, "remove", "c"), ev(300, "add", "e")]
        + [ev(400, "add", "f"), ev(400, "add", "g")]
    )


def triples(plan) -> list[tuple[float, str, int]]:
    return [(a.at_s, a.action, a.slot) for a in plan]


class FakeClock:
    """Injected clock for the driver; ``advance`` doubles as the driver's ``sleep``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt

    def set(self, t_rel: float) -> None:
        self.now = 1000.0 + t_rel


class FakeProcess:
    """Test double of ``subprocess.Popen`` for the replay driver (not a process: nothing is started).

    Offers ``pid``, ``returncode``, ``poll()``, ``send_signal(sig)``, ``kill()`` and ``wait(timeout)`` and
    records every signal received in ``signals``. On a catchable signal it exits with ``exit_on_signal``
    (``None``: ignores it); ``kill()`` makes it exit with ``-9`` like a SIGKILLed child. ``exit(code)`` simulates
    the worker ending on its own. Signals sent after the exit raise ``ProcessLookupError`` like ``os.kill``.
    """

    _next_pid = 9_000_000  # far above any real pid_max, never a real process

    def __init__(self, slot: int = 0, attempt: int = 0, exit_on_signal: int | None = 0) -> None:
        FakeProcess._next_pid += 1
        self.pid = FakeProcess._next_pid
        self.slot, self.attempt = slot, attempt
        self.exit_on_signal = exit_on_signal
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            raise subprocess.TimeoutExpired("fake", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.returncode = -signal.SIGKILL
        elif self.exit_on_signal is not None:
            self.returncode = self.exit_on_signal

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exit(self, code: int) -> None:
        self.returncode = code


class Spawner:
    """Records spawns; ``ignore_term`` slots get a FakeProcess that ignores catchable signals."""

    def __init__(self, ignore_term: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.procs: list[FakeProcess] = []
        self.ignore_term = ignore_term

    def __call__(self, slot: int, attempt: int) -> FakeProcess:
        p = FakeProcess(slot, attempt, None if slot in self.ignore_term else 0)
        self.procs.append(p)
        return p

    def of(self, slot: int, attempt: int = 0) -> FakeProcess:
        return next(p for p in self.procs if p.slot == slot and p.attempt == attempt)


def actions_of(records, *kinds):
    return [(r["action"], r["slot"], r["attempt"]) for r in records if not kinds or r["action"] in kinds]


# ============================================================================================ real traces


def test_p3_trace_matches_readme():
    events = parse_bamboo_csv()  # default: the p3 trace through paths.data_file
    assert events.source == str(data_file(P3_TRACE))
    assert len(events) == 344
    assert events.n_skipped == 0
    assert [e.t_s for e in events] == sorted(e.t_s for e in events)
    s = trace_stats(events)
    assert (s.n_add, s.n_remove, s.peak) == (177, 167, 32)
    assert round(s.duration_s / 3600, 1) == 11.4
    assert s.final_live == 10 and s.n_instances == 177
    assert all("\r" not in e.instance for e in events)  # CRLF stripped
    assert events[0] == TraceEvent(0.0, "add", "node1")


def test_p3_live_counts_agree_with_parcae_count_file():
    events = parse_bamboo_csv(P3_TRACE)
    text = data_file("spot_traces/parcae/p3_count.csv").read_text()
    rows = [tuple(map(int, line.split(","))) for line in text.split()]
    assert len(rows) == 344
    last_per_time = {ms / 1000: c for ms, c in rows}  # count after the last event at each time
    assert dict(live_counts(events)) == last_per_time
    assert count_at(live_counts(events), 1500.0) == 32 and count_at(live_counts(events), -1) == 0


def test_g4dn_trace_matches_readme():
    events = load_trace("g4dn")
    assert events.source == str(data_file(G4DN_TRACE))
    assert len(events) == 153 and events.n_skipped == 0
    s = trace_stats(events)
    assert (s.n_add, s.n_remove, s.peak) == (79, 74, 24)
    assert round(s.duration_s / 3600, 1) == 10.8
    assert s.first_t_s == 480.0  # g4dn starts empty; first instance after 8 min


def test_parcae_segments():
    segs = parse_parcae_segments()
    assert list(segs) == ["trace_hh_55_65", "trace_hl_15_25", "trace_lh_80_90", "trace_ll_10_11"]
    peaks = {k: trace_stats(v).peak for k, v in segs.items()}
    assert peaks == {"trace_hh_55_65": 32, "trace_hl_15_25": 32, "trace_lh_80_90": 24, "trace_ll_10_11": 18}
    assert all(v.n_skipped == 0 for v in segs.values())
    hh = segs["trace_hh_55_65"]
    assert len(hh) == 67
    assert [e.instance for e in hh[:32]] == [f"node-{i}" for i in range(32)] and all(e.t_s == 0 for e in hh[:32])
    assert [(e.t_s, e.kind, e.instance) for e in hh[32:35]] == [
        (480.0, "remove", "node-17"), (480.0, "remove", "node-1"), (480.0, "remove", "node-14")]
    # auto-detection and named traces agree with the explicit parser
    assert load_trace("parcae-hh") == parse_parcae_segment(hh.source) == hh


def test_missing_trace_file_is_actionable(tmp_path):
    with pytest.raises(DataFileMissing, match="nope.csv"):
        parse_bamboo_csv(tmp_path / "nope.csv")
    assert resolve_trace_path(None) == data_file(P3_TRACE)


# ============================================================================================ malformed input

GOOD_CSV = "0,add,n1\n1000,add,n2\n"


@pytest.mark.parametrize(
    "bad, why",
    [
        ("abc,add,n3", "not a number"),
        ("2000,launch,n3", "unknown event kind"),
        ("2000,add", "expected 3"),
        ("2000,add,n3,extra", "expected 3"),
        ("-5,add,n3", "negative time"),
        ("2000,add,", "missing instance"),
        ("nan,add,n3", "not finite"),
    ],
)
def test_bamboo_bad_line(tmp_path, bad, why):
    f = tmp_path / "t.csv"
    f.write_text(GOOD_CSV + bad + "\n0,add,n9\n")
    with pytest.raises(TraceFormatError, match=why) as ei:
        parse_bamboo_csv(f)
    msg = str(ei.value)
    assert f"{f}:3:" in msg and repr(bad) in msg


@pytest.mark.parametrize(
    "bad, why",
    [
        ('[0, "add", {"nodes": ["x"]', "invalid JSON"),
        ('[0, "reboot", {"nodes": ["x"]}]', "unknown event kind"),
        ('[0, "add", {"duration": 60000}]', "missing 'nodes'"),
        ('[0, "add"]', "expected a JSON list"),
        ('[-60000, "add", {"nodes": ["x"]}]', "negative time"),
        ('["soon", "add", {"nodes": ["x"]}]', "not a number"),
        ('[0, "add", {"nodes": [3]}]', "non-empty strings"),
        ('[0, "add", {"nodes": []}]', "lists no node"),
        ('[0, "no-op", {"nodes": ["x"]}]', "'no-op' event lists nodes"),
    ],
)
def test_parcae_bad_line(tmp_path, bad, why):
    f = tmp_path / "seg.txt"
    f.write_text('[0, "add", {"nodes": ["a"]}]\n[60000, "no-op", {"nodes": []}]\n' + bad + "\n")
    with pytest.raises(TraceFormatError, match=why) as ei:
        parse_parcae_segment(f)
    assert f"{f}:3:" in str(ei.value)


@pytest.mark.parametrize("content", ["", "\n\n", "\r\n"])
def test_empty_trace_is_an_error(tmp_path, content):
    f = tmp_path / "empty.csv"
    f.write_text(content)
    with pytest.raises(TraceFormatError, match="empty trace"):
        parse_bamboo_csv(f)
    with pytest.raises(TraceFormatError, match="empty trace"):
        load_trace(f)


def test_parcae_only_noops_is_empty(tmp_path):
    f = tmp_path / "noop.txt"
    f.write_text('[0, "no-op", {"nodes": []}]\n')
    with pytest.raises(TraceFormatError, match="empty trace"):
        parse_parcae_segment(f)


def test_inconsistent_events_are_skipped_and_counted(tmp_path, caplog):
    f = tmp_path / "q.csv"
    # out of file order (sorted, stably), a remove of a never-added instance and a double add
    f.write_bytes(b"5000,remove,a\r\n0,add,a\r\n0,add,b\r\n1000,remove,ghost\r\n2000,add,b\r\n")
    with caplog.at_level(logging.WARNING, logger="rlboost_hpc.cluster.traces"):
        events = parse_bamboo_csv(f)
    assert [(e.t_s, e.kind, e.instance) for e in events] == [
        (0.0, "add", "a"), (0.0, "add", "b"), (5.0, "remove", "a")]
    assert events.n_skipped == 2
    assert [(s.line, s.event.instance) for s in events.skipped] == [(4, "ghost"), (5, "b")]
    assert "2 inconsistent event(s) skipped" in caplog.text


def test_only_inconsistent_events_is_empty(tmp_path):
    f = tmp_path / "ghost.csv"
    f.write_text("0,remove,ghost\n")
    with pytest.raises(TraceFormatError, match="empty trace"):
        parse_bamboo_csv(f)


def test_live_counts_collapse_simultaneous_events():
    assert live_counts(synthetic()) == [(0.0, 4), (100.0, 3), (200.0, 1), (300.0, 2), (400.0, 4)]
    assert live_counts([ev(0, "remove", "x")]) == [(0.0, 0)]  # set semantics, never negative


# ============================================================================================ planning


def test_plan_on_synthetic_trace_is_exact():
    # peak 4 -> 2 slots: targets 4->2, 3->2, 1->1 (0.5 rounds up), 2->1, 4->2
    plan = ReplayPlan.from_trace(synthetic(), time_scale=100, max_workers=2, victim="oldest")
    assert triples(plan) == [(0.0, "start", 0), (0.0, "start", 1), (2.0, "preempt", 0), (4.0, "start", 0)]
    assert plan.duration_s == 4.0 and plan.window.peak == 4
    assert [(a.trace_t_s, a.target) for a in plan] == [(0, 2), (0, 2), (200, 1), (400, 2)]
    newest = ReplayPlan.from_trace(synthetic(), time_scale=100, max_workers=2, victim="newest")
    assert triples(newest)[2] == (2.0, "preempt", 1)
    killed = ReplayPlan.from_trace(synthetic(), time_scale=100, max_workers=2, victim="oldest", kill_fraction=1)
    assert triples(killed)[2] == (2.0, "kill", 0)


def test_plan_window_is_exact():
    # window [150, 450): initial count 3 (after t<=150), changes at 200 (1), 300 (2), 400 (4); peak 4
    plan = ReplayPlan.from_trace(synthetic(), window_start_s=150, window_s=300, time_scale=10, max_workers=2,
                                 victim="oldest")
    assert triples(plan) == [(0.0, "start", 0), (0.0, "start", 1), (5.0, "preempt", 0), (25.0, "start", 0)]
    assert plan.duration_s == 30.0
    # events at the window end are excluded; events at the window start are the initial state
    short = ReplayPlan.from_trace(synthetic(), window_start_s=200, window_s=200, max_workers=2)
    assert short.window.initial_live == 1 and short.window.peak == 2  # 400 is outside [200, 400)
    assert triples(short) == [(0.0, "start", 0), (100.0, "start", 1)]
    assert [p.slot for p in plan.lifetimes()] == [0, 1, 0]
    assert plan.lifetimes()[0].end == "preempt" and plan.lifetimes()[1].duration(plan.duration_s) == 30.0


def test_min_workers_clamp_and_zero_peak():
    plan = ReplayPlan.from_trace([ev(0, "add", "a"), ev(10, "remove", "a"), ev(20, "add", "b")],
                                 max_workers=3, min_workers=1, victim="oldest")
    assert triples(plan) == [(0.0, "start", 0), (0.0, "start", 1), (0.0, "start", 2),
                             (10.0, "preempt", 0), (10.0, "preempt", 1), (20.0, "start", 0), (20.0, "start", 1)]
    empty = scale_window([ev(0, "add", "a"), ev(1, "remove", "a")], window_start_s=5, max_workers=3,
                         min_workers=1)
    assert (empty.peak, empty.initial_target, empty.changes) == (0, 1, ())


@pytest.mark.parametrize("kill_fraction, expect", [(0.0, "none"), (1.0, "all"), (0.5, "half")])
def test_kill_fraction(kill_fraction, expect):
    p3 = load_trace("p3")
    plan = ReplayPlan.from_trace(p3, max_workers=4, time_scale=60, kill_fraction=kill_fraction, seed=7)
    n_pre, n_kill = plan.n_actions("preempt"), plan.n_actions("kill")
    assert n_pre + n_kill > 10
    if expect == "none":
        assert n_kill == 0
    elif expect == "all":
        assert n_pre == 0
    else:
        assert n_kill == math.floor(0.5 * (n_pre + n_kill) + 0.5)


def test_plan_is_deterministic_by_seed():
    p3 = load_trace("p3")
    kw = dict(window_start_s=3600, window_s=7200, time_scale=48, max_workers=3, kill_fraction=0.3)
    a = ReplayPlan.from_trace(p3, seed=3, **kw)
    assert a == ReplayPlan.from_trace(list(reversed(p3)), seed=3, **kw)  # input order does not matter
    others = {tuple(triples(ReplayPlan.from_trace(p3, seed=s, **kw))) for s in range(8)}
    assert len(others) > 1  # the seed matters (victims / which removals are kills)
    assert all(sum(1 for x in o if x[1] == "start") == a.n_actions("start") for o in others)


@pytest.mark.parametrize("max_workers", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("trace", ["p3", "g4dn", "parcae-lh"])
def test_scaling_never_exceeds_max_workers_on_real_traces(trace, max_workers):
    events = load_trace(trace)
    for start, window in [(0, None), (3600, 1800), (7200, 14400)]:
        plan = ReplayPlan.from_trace(events, window_start_s=start, window_s=window, max_workers=max_workers,
                                     time_scale=30, kill_fraction=0.3, seed=1)
        assert all(0 <= n <= max_workers for _, n in plan.live_over_time())
        assert max((n for _, n in plan.live_over_time()), default=0) <= max_workers
        assert all(0 <= a.slot < max_workers for a in plan)


@st.composite
def random_trace(draw):
    steps = draw(st.lists(st.tuples(st.integers(0, 50), st.integers(-4, 6)), min_size=1, max_size=40))
    live: list[str] = []
    events, t, k = [], 0, 0
    for dt, delta in steps:
        t += dt
        for _ in range(max(delta, 0)):
            k += 1
            live.append(f"i{k}")
            events.append(ev(t, "add", f"i{k}"))
        for _ in range(min(-delta, len(live))):
            events.append(ev(t, "remove", live.pop(0)))
    return events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=random_trace(), max_workers=st.integers(1, 6), kf=st.sampled_from([0, 0.25, 0.5, 1]),
       seed=st.integers(0, 3), start=st.integers(0, 300), victim=st.sampled_from(["random", "oldest", "newest"]))
def test_plan_properties(events, max_workers, kf, seed, start, victim):
    plan = ReplayPlan.from_trace(events, window_start_s=start, window_s=400, time_scale=2,
                                 max_workers=max_workers, kill_fraction=kf, seed=seed, victim=victim)
    ReplayPlan.from_actions(plan.actions, max_workers=max_workers)  # invariants hold
    win = plan.window
    assert all(n <= max_workers for _, n in plan.live_over_time())
    # the live slot count follows the scaled target exactly
    expected = [(0.0, win.initial_target)] + [((t - start) / 2, tgt) for t, _, tgt in win.changes]
    got = dict(plan.live_over_time())
    for at, tgt in expected:
        assert got.get(at, tgt) == tgt
    removals = plan.n_actions("preempt") + plan.n_actions("kill")
    assert removals == win.n_removals and plan.n_actions("kill") == math.floor(kf * removals + 0.5)
    assert plan == ReplayPlan.from_trace(events, window_start_s=start, window_s=400, time_scale=2,
                                         max_workers=max_workers, kill_fraction=kf, seed=seed, victim=victim)


def test_choose_window():
    events = synthetic()
    # [0,150): 4 -> 3 keeps target 2: no change; [100,250): 3 -> 1 with peak 3: target 2 -> 1
    assert choose_window(events, 150, 1, max_workers=2) == 100.0
    assert choose_window(events, 150, 1, max_workers=2, min_starts=1) == 200.0
    with pytest.raises(ValueError, match="no 150 s window"):
        choose_window(events, 150, 2, max_workers=2)
    p3 = load_trace("p3")
    start = choose_window(p3, 1800, 4, min_removals=2)  # default 3 slots
    assert start == choose_window(p3, 1800, 4, min_removals=2)
    win = scale_window(p3, window_start_s=start, window_s=1800, max_workers=3)
    assert len(win.changes) >= 4 and win.n_removals >= 2
    earlier = [t for t, _ in live_counts(p3) if t < start]
    assert all(len(scale_window(p3, window_start_s=t, window_s=1800, max_workers=3).changes) < 4
               or scale_window(p3, window_start_s=t, window_s=1800, max_workers=3).n_removals < 2
               for t in earlier)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_workers=0), "max_workers"),
        (dict(max_workers=2, time_scale=0), "time_scale"),
        (dict(max_workers=2, kill_fraction=1.5), "kill_fraction"),
        (dict(max_workers=2, window_start_s=-1), "window_start_s"),
        (dict(max_workers=2, window_s=0), "window_s"),
        (dict(max_workers=2, min_workers=3), "min_workers"),
        (dict(max_workers=2, victim="youngest"), "victim"),
    ],
)
def test_plan_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReplayPlan.from_trace(synthetic(), **kwargs)


@pytest.mark.parametrize(
    "actions, match",
    [
        ([ReplayAction(0, "start", 0), ReplayAction(1, "start", 0)], "already live"),
        ([ReplayAction(0, "preempt", 0)], "not live"),
        ([ReplayAction(-1, "start", 0)], "at_s"),
        ([ReplayAction(0, "boot", 0)], "unknown action"),
    ],
)
def test_from_actions_validates(actions, match):
    with pytest.raises(ValueError, match=match):
        ReplayPlan.from_actions(actions)
    with pytest.raises(ValueError, match="slot outside"):
        ReplayPlan.from_actions([ReplayAction(0, "start", 2)], max_workers=2)


# ============================================================================================ driver (fakes)


def make_driver(actions, spawner=None, **kw):
    clock = FakeClock()
    spawner = spawner or Spawner()
    drv = ReplayDriver(ReplayPlan.from_actions(actions), spawner, clock, sleep=clock.advance, **kw)
    return drv, clock, spawner


def test_driver_applies_actions_at_the_right_times():
    drv, clock, sp = make_driver([
        ReplayAction(0, "start", 0), ReplayAction(0, "start", 1), ReplayAction(5, "preempt", 0),
        ReplayAction(8, "start", 0), ReplayAction(10, "kill", 1),
    ])
    assert actions_of(drv.poll()) == [("start", 0, 0), ("start", 1, 0)]
    assert drv.live_slots() == [0, 1] and drv.next_due_in() == 5
    clock.set(4.999)
    assert drv.poll() == []
    clock.set(5.0)
    new = drv.poll()
    assert actions_of(new) == [("preempt", 0, 0)] and new[0]["t"] == 5.0 and new[0]["planned_at_s"] == 5
    assert sp.of(0).signals == [signal.SIGTERM] and drv.live_slots() == [1]
    clock.set(6)
    assert [(r["action"], r["slot"], r["exit_code"], r["cause"]) for r in drv.poll()] == [("exit", 0, 0, "preempt")]
    clock.set(9)
    assert actions_of(drv.poll()) == [("start", 0, 1)]  # second spawn of slot 0: attempt 1
    clock.set(10)
    assert actions_of(drv.poll()) == [("kill", 1, 0)]
    assert sp.of(1).signals == [signal.SIGKILL] and drv.done and drv.next_due_in() is None
    clock.set(10.5)
    drv.poll()
    assert drv.exit_codes() == [(0, 0, 0), (1, 0, -9)]
    assert (drv.n_started, drv.n_preempted, drv.n_killed) == (3, 1, 1)
    summ = drv.summary()
    assert (summ["started"], summ["preempted"], summ["killed"], summ["exited"], summ["live"]) == (3, 1, 1, 2, [0])
    assert set(drv.events[0]) >= {"t", "slot", "attempt", "pid", "action", "exit_code"}
    assert drv.events[0]["pid"] == sp.of(0).pid


def test_driver_late_poll_applies_everything_due_in_order():
    drv, clock, sp = make_driver([ReplayAction(0, "start", 0), ReplayAction(1, "preempt", 0),
                                  ReplayAction(2, "start", 0)])
    drv.start()
    clock.set(3)
    assert actions_of(drv.poll()) == [("start", 0, 0), ("preempt", 0, 0), ("start", 0, 1)]
    assert actions_of(drv.poll(), "exit") == [("exit", 0, 0)]


def test_driver_holds_a_due_removal_until_its_worker_is_busy_and_keeps_plan_order():
    """A fault scheduled by progress: the preemption of slot 0 waits until ``fire_when`` says its worker holds
    work; the start planned after it waits with it; a removal is never held past ``max_hold_s``."""
    busy: set[tuple[int, int]] = set()
    asked: list[tuple[int, int]] = []

    def fire_when(slot, attempt):
        asked.append((slot, attempt))
        return (slot, attempt) in busy

    drv, clock, sp = make_driver([ReplayAction(0, "start", 0), ReplayAction(0, "start", 1),
                                  ReplayAction(5, "preempt", 0), ReplayAction(6, "start", 0),
                                  ReplayAction(7, "kill", 1)], fire_when=fire_when, max_hold_s=10)
    drv.poll()
    clock.set(6.5)
    assert drv.poll() == [] and asked == [(0, 0)] and sp.of(0).signals == []
    busy.add((0, 0))
    clock.set(8)
    new = drv.poll()
    assert actions_of(new) == [("preempt", 0, 0), ("start", 0, 1)] and new[0]["held_s"] == 3.0
    clock.set(16.9)  # the kill of slot 1 (due at 7) is held: its worker never becomes busy
    assert actions_of(drv.poll(), "kill") == []
    clock.set(17)  # ... until it is max_hold_s overdue
    new = drv.poll()
    assert actions_of(new, "kill") == [("kill", 1, 0)] and new[0]["held_s"] == 10.0


def test_driver_custom_preempt_signal():
    drv, clock, sp = make_driver([ReplayAction(0, "start", 0), ReplayAction(1, "preempt", 0)],
                                 preempt_signal=signal.SIGUSR2)
    drv.poll()
    clock.set(1)
    drv.poll()
    assert sp.of(0).signals == [signal.SIGUSR2]
    with pytest.raises(ValueError, match="catchable"):
        ReplayDriver([], Spawner(), preempt_signal=signal.SIGKILL)


def test_driver_cap_holds_retires_and_restarts():
    drv, clock, sp = make_driver([ReplayAction(0, "start", s) for s in range(3)]
                                 + [ReplayAction(1, "preempt", 0), ReplayAction(2, "preempt", 1)], cap=2)
    assert actions_of(drv.poll()) == [("start", 0, 0), ("start", 1, 0)]
    assert drv.live_slots() == [0, 1] and drv.offered_slots() == [0, 1, 2]
    clock.set(1)
    assert actions_of(drv.poll()) == [("preempt", 0, 0), ("start", 2, 0)]  # held slot 2 takes the room
    clock.set(1.5)
    drv.poll()
    assert actions_of(drv.set_cap(1)) == [("retire", 2, 0)]  # newest worker goes, with a warning
    assert sp.of(2).signals == [signal.SIGTERM] and drv.live_slots() == [1] and drv.n_preempted == 1
    clock.set(2)
    recs = drv.poll()
    assert actions_of(recs) == [("exit", 2, 0), ("preempt", 1, 0), ("start", 2, 1)]
    assert drv.set_cap(1) == [] and drv.live_slots() == [2]
    drv.set_cap(0)
    drv.poll()
    assert drv.live_slots() == []
    assert actions_of(drv.set_cap(None)) == [("start", 2, 2)]
    with pytest.raises(ValueError, match="cap"):
        drv.set_cap(-1)


def test_driver_withdraw_of_held_slot():
    drv, clock, sp = make_driver([ReplayAction(0, "start", 0), ReplayAction(0, "start", 1),
                                  ReplayAction(1, "kill", 1)], cap=1)
    drv.poll()
    clock.set(1)
    assert [(r["action"], r["slot"], r["cause"]) for r in drv.poll()] == [("withdraw", 1, "kill")]
    assert drv.n_killed == 0 and drv.offered_slots() == [0]


def test_driver_unexpected_exit():
    acts = [ReplayAction(0, "start", 0), ReplayAction(5, "preempt", 0), ReplayAction(6, "start", 0)]
    drv, clock, sp = make_driver(acts)
    drv.poll()
    sp.of(0).exit(3)
    clock.set(1)
    assert [(r["action"], r["exit_code"], r["cause"]) for r in drv.poll()] == [("exit", 3, None)]
    assert drv.live_slots() == [] and drv.poll() == []  # stays down...
    clock.set(5)
    assert actions_of(drv.poll()) == [("withdraw", 0, None)]
    clock.set(6)
    assert actions_of(drv.poll()) == [("start", 0, 1)]  # ...until the plan starts the slot again
    drv2, clock2, sp2 = make_driver(acts, restart_exited=True)
    drv2.poll()
    sp2.of(0).exit(1)
    clock2.set(1)
    assert actions_of(drv2.poll()) == [("exit", 0, 0), ("start", 0, 1)]


def test_driver_spawn_failure_is_recorded_and_raised():
    def spawn(slot, attempt):
        raise OSError("no such binary")

    drv, clock, _ = make_driver([ReplayAction(0, "start", 0)], spawner=spawn)
    with pytest.raises(OSError):
        drv.poll()
    assert drv.events[-1]["action"] == "spawn_failed" and "no such binary" in drv.events[-1]["error"]
    assert drv.poll() == [] and drv.live_slots() == []


def test_stop_all_escalates_after_grace_with_injected_clock():
    drv, clock, sp = make_driver([ReplayAction(0, "start", s) for s in range(3)] + [ReplayAction(50, "kill", 0)],
                                 spawner=Spawner(ignore_term={1}))
    drv.poll()
    recs = drv.stop_all(grace_s=2.0, poll_interval_s=0.5)
    assert clock.now - 1000 == pytest.approx(2.0)  # waited the whole grace period (fake sleep), no longer
    assert actions_of(recs, "stop_term") == [("stop_term", 0, 0), ("stop_term", 1, 0), ("stop_term", 2, 0)]
    assert actions_of(recs, "stop_kill") == [("stop_kill", 1, 0)]
    assert sorted(drv.exit_codes()) == [(0, 0, 0), (1, 0, -9), (2, 0, 0)]
    assert sp.of(1).signals == [signal.SIGTERM, signal.SIGKILL]
    assert all(p.returncode is not None for p in sp.procs) and drv.live_slots() == [] and drv.dying_pids() == []
    clock.set(60)
    assert drv.poll() == [] and drv.done  # no action after stop


def test_a_frozen_driver_applies_no_more_actions_but_reaps_and_keeps_its_live_workers():
    """The run freezes the cluster when training ends, so no preemption lands while it reports (one fired during
    the final evaluation was counted by the cluster and not yet by the manager)."""
    drv, clock, sp = make_driver([ReplayAction(0, "start", 0), ReplayAction(0, "start", 1),
                                  ReplayAction(5, "preempt", 0), ReplayAction(8, "kill", 1)],
                                 spawner=Spawner(ignore_term={0}))
    drv.poll()
    clock.set(5)
    assert actions_of(drv.poll()) == [("preempt", 0, 0)]  # warned; still draining (it ignores SIGTERM here)
    drv.freeze()
    clock.set(20)
    assert drv.poll() == [] and drv.counts["kill"] == 0 and drv.live_slots() == [1]
    sp.of(0).exit(0)  # the warned worker finishes its drain
    assert actions_of(drv.poll(), "exit") == [("exit", 0, 0)] and drv.dying_pids() == []
    assert drv.counts["preempt"] == 1 and drv.live_slots() == [1]


def test_stop_all_does_not_wait_when_everyone_exits():
    drv, clock, sp = make_driver([ReplayAction(0, "start", 0)])
    with drv:
        drv.poll()
    assert clock.now == 1000.0 and drv.exit_codes() == [(0, 0, 0)]


# ============================================================================================ real processes

CHILD = """
import signal, subprocess, sys, time
if sys.argv[1] == "graceful":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
gpid = 0
if sys.argv[2] == "grandchild":  # something left behind on the 'machine'
    gpid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]).pid
print("ready", gpid, flush=True)
while True:
    time.sleep(0.02)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.integration
def test_driver_with_real_processes():
    # slot 0: preempted (SIGTERM handler exits 0); 1: killed (-9); 2: ignores SIGTERM, so stop_all SIGKILLs it;
    # 3: exits 0 on stop_all's SIGTERM. Slots 0, 1 and 3 leave a grandchild behind that must not survive.
    modes = {0: ("graceful", "grandchild"), 1: ("graceful", "grandchild"), 2: ("stubborn", "-"),
             3: ("graceful", "grandchild")}
    procs: list[subprocess.Popen] = []
    grandchildren: list[int] = []

    def spawn(slot: int, attempt: int) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", CHILD, *modes[slot]], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        word, gpid = p.stdout.readline().split()  # handler installed before any signal
        assert word == "ready"
        if int(gpid):
            grandchildren.append(int(gpid))
        return p

    plan = ReplayPlan.from_actions([ReplayAction(0, "start", s) for s in range(4)]
                                   + [ReplayAction(0.1, "preempt", 0), ReplayAction(0.1, "kill", 1)])
    drv = ReplayDriver(plan, spawn)
    try:
        drv.poll()
        pids = [p.pid for p in procs]
        assert drv.live_slots() == [0, 1, 2, 3] and len(grandchildren) == 3
        deadline = time.monotonic() + 4
        while len(drv.exit_codes()) < 2 and time.monotonic() < deadline:
            drv.poll()
            time.sleep(0.02)
        assert sorted(drv.exit_codes()) == [(0, 0, 0), (1, 0, -signal.SIGKILL)]
        assert drv.live_slots() == [2, 3] and (drv.n_preempted, drv.n_killed) == (1, 1)
        t = time.monotonic()
        drv.stop_all(grace_s=0.4)
        assert time.monotonic() - t < 2
        assert sorted(drv.exit_codes()) == [(0, 0, 0), (1, 0, -9), (2, 0, -9), (3, 0, 0)]
        assert [r["slot"] for r in drv.events if r["action"] == "stop_kill"] == [2]
        children = {c.pid for c in psutil.Process().children(recursive=True)}
        assert not children & set(pids + grandchildren)
        deadline = time.monotonic() + 1
        while not all(gone(pid) for pid in pids + grandchildren) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(gone(pid) for pid in pids + grandchildren)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
        for pid in grandchildren:
            if not gone(pid):
                psutil.Process(pid).kill()
