"""Step timeline, instance activity and fixed overhead (pure; injected clocks)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.observe.timeline import (
    Activity, ActivityClock, Phase, StepTimeline, add_phase, fixed_overhead_s, merge, summarize)
from rlboost_hpc.protocol import messages as M


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_phases_partition_the_step_nested_phases_return_to_what_they_interrupted():
    c = Clock()
    tl = StepTimeline(c)
    c.t += 1.0  # submit
    tl.enter(Phase.SEEDING)
    c.t += 2.0
    with tl.phase(Phase.REWARD):
        c.t += 0.5
    c.t += 1.0  # seeding again
    tl.enter(Phase.PUBLISH)
    c.t += 3.0
    tl.enter(Phase.SET_VERSION)
    tl.split_last(Phase.PUBLISH, Phase.EXPORT, 1.25)
    c.t += 0.25
    wall = tl.finish()
    assert wall == pytest.approx(7.75)
    sec = tl.seconds()
    assert sec == pytest.approx({"submit": 1.0, "seeding": 3.0, "reward": 0.5, "export": 1.25, "publish": 1.75,
                                 "set_version": 0.25})
    assert sum(sec.values()) == pytest.approx(wall)
    spans = tl.spans
    assert all(a[2] == b[1] for a, b in zip(spans, spans[1:])) and spans[0][1] == tl.start and spans[-1][2] == tl.end
    assert tl.compute_intervals() == []
    # the overhead split by phase sums to the step's overhead; generation during seeding is not overhead
    gen = [(101.0, 104.5)]
    by = tl.overhead_by_phase(gen)
    assert sum(by.values()) == pytest.approx(fixed_overhead_s(tl.start, tl.end, gen + tl.compute_intervals()))
    assert by["seeding"] == pytest.approx(0.0) and by["reward"] == pytest.approx(0.0) and by["submit"] == 1.0


def test_an_export_longer_than_its_publish_span_is_clipped_to_it():
    c = Clock()
    tl = StepTimeline(c, initial=Phase.PUBLISH)
    c.t += 1.0
    tl.enter(Phase.POLICY)
    tl.split_last(Phase.PUBLISH, Phase.EXPORT, 5.0)
    tl.finish()
    assert tl.seconds() == {"export": 1.0}


intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)).map(lambda t: (min(t), max(t))),
                     max_size=12)


@settings(max_examples=300, deadline=None)
@given(intervals, st.integers(0, 100), st.integers(100, 200))
def test_fixed_overhead_is_the_uncovered_part_of_the_window(ivs, start, end):
    """Against a brute-force count of uncovered unit cells of the window."""
    uncovered = sum(1 for x in range(start, end) if not any(a <= x and x + 1 <= b for a, b in ivs))
    assert fixed_overhead_s(start, end, ivs) == pytest.approx(uncovered)
    m = merge(ivs)
    assert all(a < b for a, b in m) and all(p[1] < q[0] for p, q in zip(m, m[1:]))


def test_activity_clock_counts_instance_seconds_and_generating_intervals():
    """Events: ``set(key, activity, t)`` = that activity from t on; each interval is charged to what held in it."""
    a = ActivityClock(max_intervals=3)
    a.set("i", Activity.PULLING, 0.0)
    a.set("i", Activity.PULLING, 0.5)  # unchanged: nothing happens
    a.set("i", Activity.BUSY, 1.0)
    a.set("j", Activity.IDLE, 1.0)
    a.set("j", Activity.BUSY, 2.0)
    a.set("i", Activity.IDLE, 3.0)
    a.set("j", Activity.IDLE, 3.0)
    a.set("i", Activity.BUSY, 4.0)
    a.set("j", None, 4.0)
    out = a.take(5.0)
    assert out["instance_s"] == {"busy": 4.0, "idle": 3.0, "pulling": 1.0}
    assert out["by_instance_s"]["i"] == {"busy": 3.0, "idle": 1.0, "pulling": 1.0}
    assert out["generating"] == [[1.0, 3.0], [4.0, 5.0]]
    # i is still busy: the next step is charged from 5 on, and its generating interval starts there
    nxt = a.take(6.0)
    assert nxt["instance_s"] == {"busy": 1.0, "idle": 0.0, "pulling": 0.0} and nxt["generating"] == [[5.0, 6.0]]
    assert a.total_s["busy"] == 5.0  # the running totals stay
    for k in range(10):  # churn: the interval list stays bounded
        a.set("i", Activity.IDLE, 10.0 + 2 * k)
        a.set("i", Activity.BUSY, 11.0 + 2 * k)
    assert len(a.take(40.0)["generating"]) <= 3


def test_activity_clock_flush_brings_per_instance_seconds_to_now_without_double_counting():
    a = ActivityClock()
    a.set("i", Activity.BUSY, 0.0)
    a.flush(2.0)
    a.flush(2.0)
    assert a.by_instance_s["i"]["busy"] == 2.0
    a.set("i", Activity.IDLE, 3.0)
    a.flush(4.0)
    assert a.by_instance_s["i"] == {"busy": 3.0, "idle": 1.0, "pulling": 0.0} and a.total_s["busy"] == 3.0
    a.set("i", None, 5.0)
    a.forget("i")
    assert "i" not in a.by_instance_s and a.total_s["idle"] == 2.0
    assert a.take(9.0)["generating"] == [[0.0, 3.0]]


def test_manager_counts_what_each_instance_did_per_step():
    c = Clock()
    core = ManagerCore(clock=c)
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0))
    core.on_message(b"i", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
    core.tick()
    c.t += 2.0
    core.tick()  # 2 s pulling
    core.on_message(b"i", M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=2.0, load_s=0.0))
    c.t += 1.0
    core.tick()  # 1 s idle, then work arrives
    core.on_message(b"t", M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(
        gid="g", prompt_ids=[1, 2], n=2, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=1, stop_ids=[])]))
    core.tick()
    assert core.fleet.instances["j#0"].inflight
    c.t += 3.0
    core.tick()  # 3 s busy
    assert core.stats().instances["j#0"].activity_s == pytest.approx({"busy": 3.0, "idle": 1.0, "pulling": 2.0})
    core.on_message(b"t", M.StepTimes(step=0, wall_s=6.0, phases={"seeding": 4.0, "train": 2.0},
                                      fixed_overhead_s=0.5))
    assert core.step_account.phase_s == {"seeding": 4.0, "train": 2.0}
    assert core.dist.step_seconds.count == 1 and core.dist.step_seconds.total == 6.0


def test_a_message_costs_the_manager_o1_activity_work_whatever_the_number_of_instances(monkeypatch):
    """Regression (bench_scale at N = 256: two thirds of the manager's CPU): every message re-read the activity of
    all N instances, O(N) per message and O(N²) per step. Now only the instances a message changes are read."""
    c = Clock()
    core = ManagerCore(clock=c)
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0))
    for k in range(256):
        core.on_message(b"p%d" % k, M.Register(job_id=f"j{k}", attempt=0, kind="preemptible", max_batch=4))
        core.on_message(b"p%d" % k, M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=0.0, load_s=0.0))
    reads = []
    real = ManagerCore._activity
    monkeypatch.setattr(ManagerCore, "_activity", lambda self, inst: reads.append(inst.key) or real(self, inst))
    for k in range(0, 256, 8):
        c.t += 0.01
        core.on_message(b"p%d" % k, M.Heartbeat(version=0, active=0, tokens_generated=0))
    assert len(reads) == 0, f"{len(reads)} activity reads for 32 heartbeats of 256 instances"
    c.t += 1.0
    assert core.stats().instance_activity_s["idle"] == pytest.approx(256 * 1.32)


def test_the_response_tail_is_last_completion_minus_the_ninetieth_percentile():
    from rlboost_hpc.observe.timeline import response_tail_s

    assert response_tail_s([]) == 0.0 and response_tail_s([5.0]) == 0.0
    done = [float(t) for t in range(1, 10)] + [30.0]  # 10 responses: the 9th done at 9 s, the last at 30 s
    assert response_tail_s(reversed(done)) == 21.0
    assert response_tail_s(done, fraction=0.5) == 25.0


def test_summaries_and_the_checkpoint_phase():
    steps = [{"wall_s": 2.0, "phase_s": {"seeding": 1.0, "train": 1.0}, "fixed_overhead_s": 0.0,
              "fixed_overhead_s_by_phase": {"seeding": 0.0}},
             {"wall_s": 4.0, "phase_s": {"seeding": 3.0, "train": 1.0}, "fixed_overhead_s": 1.0,
              "fixed_overhead_s_by_phase": {"seeding": 1.0}}]
    add_phase(steps[0], Phase.CHECKPOINT, 1.0)
    assert steps[0]["wall_s"] == 3.0 and steps[0]["fixed_overhead_s"] == 1.0
    s = summarize(steps)
    assert s["fixed_overhead_s_per_step"] == 1.0 and s["fixed_overhead_share"] == pytest.approx(2 / 7)
    assert list(s["step_phase_s_mean"]) == ["seeding", "train", "checkpoint"]  # in Phase order
    assert s["fixed_overhead_s_by_phase"] == {"seeding": 0.5, "checkpoint": 0.5}
    assert summarize([])["fixed_overhead_share"] == 0.0
