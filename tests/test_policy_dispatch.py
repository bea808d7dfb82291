"""Behaviour of dispatch (JSQ + Θ, round-robin), plateau learning and the balancer
(rlboost_hpc/policy/dispatch.py; RLBoost, arXiv 2510.19225)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlboost_hpc.policy.dispatch import (
    Balancer, InstanceLoad, PlateauEstimator, RoundRobin, choose_instance, plan_dispatch, select_queued,
    select_running,
)

# ---------------------------------------------------------------------------------------------- JSQ + Θ

JSQ_CASES = [
    ("picks_shortest_queue", [3, 1, 2], 8, None, 1),
    ("ties_go_to_lowest_index", [2, 1, 1], 8, None, 1),
    ("holds_request_when_all_at_threshold", [8, 9, 8], 8, None, None),
    ("dispatches_just_below_threshold", [8, 7, 9], 8, None, 1),
    ("no_instances_holds_request", [], 8, None, None),
    ("tiebreak_prefers_less_in_flight", [0, 0, 0], 8, [50, 10, 30], 1),
    ("tiebreak_only_among_equal_loads", [1, 0, 0], 8, [0, 10, 30], 1),
]


@pytest.mark.parametrize("name,loads,theta,tiebreak,expected", JSQ_CASES, ids=[c[0] for c in JSQ_CASES])
def test_choose_instance(name, loads, theta, tiebreak, expected):
    assert choose_instance(loads, theta, tiebreak) == expected


def test_plan_dispatch_spreads_evenly_and_stops_at_threshold():
    out = plan_dispatch(10, [0, 0, 0], theta=3)
    assert out == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # 9 dispatched, the 10th waits at the manager


def test_plan_dispatch_fills_emptiest_first():
    assert plan_dispatch(3, [2, 0, 1], theta=10) == [1, 1, 2]


def test_round_robin_rotates_and_skips_full_instances():
    rr = RoundRobin()
    assert [rr.choose([0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose([0, 5, 0], theta=5) == 2
    assert rr.choose([5, 5, 5], theta=5) is None
    assert rr.choose([]) is None


# ---------------------------------------------------------------------------------------------- plateau


def _curve(b: int, peak: float, half: float) -> float:
    """A saturating throughput curve: peak·b/(b + half)."""
    return peak * b / (b + half)


def test_plateau_returns_prior_until_enough_samples():
    est = PlateauEstimator(prior=48, min_samples=8, min_buckets=3)
    for b in (1, 2):
        est.observe(b, 100.0 * b)
    assert est.plateau == 48


def test_plateau_learned_from_saturating_curve():
    est = PlateauEstimator(prior=999)
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        est.observe(b, _curve(b, 5000.0, 4.0))
    # 95% of the best observed (at 256) is reached first in the 64 bucket for half-saturation 4
    assert est.plateau == 64


def test_plateau_learned_per_instance_for_heterogeneous_gpus():
    bal = Balancer(prior_plateau=999)
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        bal.observe("fast", b, _curve(b, 8000.0, 1.0))    # saturates early
        bal.observe("slow", b, _curve(b, 3000.0, 16.0))   # saturates late
    assert bal.plateau("fast") < bal.plateau("slow")
    assert bal.plateau("unknown") == 999
    assert bal.peak("fast") > bal.peak("slow")


def test_plateau_ignores_invalid_measurements():
    est = PlateauEstimator()
    est.observe(0, 100.0)
    est.observe(4, float("nan"))
    est.observe(4, -1.0)
    assert est.n_samples == 0 and est.peak is None


# ---------------------------------------------------------------------------------------------- balancer


def test_balancer_moves_queued_requests_to_idle_instance():
    bal = Balancer(prior_plateau=8)
    plan = bal.plan([InstanceLoad("a", queued=6, running=8), InstanceLoad("b", queued=0, running=0)])
    assert [(t.src, t.dst, t.kind) for t in plan] == [("a", "b", "queued")]
    assert plan[0].count == 6


def test_balancer_moves_running_beyond_plateau_to_idle_instance():
    bal = Balancer(prior_plateau=16)
    plan = bal.plan([InstanceLoad("a", queued=0, running=40), InstanceLoad("b", queued=0, running=0)])
    assert [(t.src, t.dst, t.kind, t.count) for t in plan] == [("a", "b", "running", 16)]


def test_balancer_leaves_running_below_plateau_alone():
    bal = Balancer(prior_plateau=64)
    assert bal.plan([InstanceLoad("a", 0, 40), InstanceLoad("b", 0, 0)]) == []


def test_balancer_does_not_move_running_without_migration():
    bal = Balancer(prior_plateau=16, move_running=False)
    assert bal.plan([InstanceLoad("a", 0, 40), InstanceLoad("b", 0, 0)]) == []


def test_balancer_respects_receiver_capacity():
    bal = Balancer(prior_plateau=64)
    plan = bal.plan([InstanceLoad("a", 10, 30, capacity=30), InstanceLoad("b", 0, 2, capacity=4)])
    assert sum(t.count for t in plan if t.dst == "b") == 2


def _learned(bal, rates):
    """Teach ``bal`` each instance's throughput (tokens/s) at each batch: {iid: {batch: tokens/s}}."""
    for iid, by_batch in rates.items():
        for b, tp in by_batch.items():
            bal.observe(iid, b, tp)


def test_in_the_tail_an_idle_fast_instance_takes_a_running_request_from_the_slowest():
    """GPUs at speeds 3 : 2 : 1, below every plateau (the plateau rule moves nothing): the idle fastest instance
    takes a request from the instance where one decodes slowest; the middle one is not slow enough to give."""
    bal = Balancer(prior_plateau=64)
    _learned(bal, {"fast": {1: 30.0, 4: 90.0}, "mid": {1: 20.0, 4: 60.0}, "slow": {1: 10.0, 4: 30.0}})
    loads = [InstanceLoad("fast", 0, 0), InstanceLoad("mid", 0, 3), InstanceLoad("slow", 0, 4)]
    assert bal.plan(loads) == []
    assert [(t.src, t.dst, t.kind, t.count) for t in bal.tail_plan(loads)] == [("slow", "fast", "running", 1)]
    moves = bal.moves_for(loads, 0.0, lambda i: [], lambda i: [(f"{i}-{k}", 5 * k) for k in range(4)], tail=True)
    assert [(m.rid, m.src, m.dst) for m in moves] == [("slow-0", "slow", "fast")]
    assert bal.moves_for(loads, 0.0, lambda i: [], lambda i: [], tail=False) == []  # the caller still has a queue


def test_tail_moves_need_a_gain_measurements_and_an_empty_queue():
    bal = Balancer(prior_plateau=64)
    # the same GPU: one request alone decodes 30 tok/s, four together 25 each — below the 1.5× gain
    _learned(bal, {"a": {1: 30.0, 4: 100.0}, "b": {1: 30.0, 4: 100.0}})
    assert bal.tail_plan([InstanceLoad("a", 0, 0), InstanceLoad("b", 0, 4)]) == []
    _learned(bal, {"slow": {4: 20.0}})
    assert bal.tail_plan([InstanceLoad("a", 0, 0), InstanceLoad("slow", 1, 4)]) == []  # queued work: not the tail
    assert bal.tail_plan([InstanceLoad("new", 0, 0), InstanceLoad("slow", 0, 4)]) == []  # never measured
    plan = bal.tail_plan([InstanceLoad("a", 0, 0), InstanceLoad("b", 0, 0), InstanceLoad("slow", 0, 4)])
    assert [(t.src, t.dst) for t in plan] == [("slow", "a")]  # slow at batch 3 was never measured: one move
    _learned(bal, {"slow": {3: 15.0}})
    plan = bal.tail_plan([InstanceLoad("a", 0, 0), InstanceLoad("b", 0, 0), InstanceLoad("slow", 0, 4)])
    assert [(t.src, t.dst) for t in plan] == [("slow", "a"), ("slow", "b")]
    # never back: the faster instance, now running it, is no donor to the slower one
    assert bal.tail_plan([InstanceLoad("a", 0, 1), InstanceLoad("slow", 0, 0)]) == []


def test_balancer_never_makes_receiver_heavier_than_donor():
    bal = Balancer(prior_plateau=100)
    plan = bal.plan([InstanceLoad("a", 3, 5), InstanceLoad("b", 0, 4)])
    # a has 8, b has 4: at most 2 may move (then 6 vs 6)
    assert sum(t.count for t in plan) == 2


def test_balancer_cooldown_prevents_moving_a_request_twice():
    bal = Balancer(prior_plateau=2, cooldown_s=10.0)
    first = bal.moves([("a", [], [("r1", 5), ("r2", 1), ("r3", 9)]), ("b", [], [])], now=0.0)
    assert [m.rid for m in first] == ["r2"]  # fewest generated tokens moves first
    # r2 now sits on b, which is over its plateau; c is idle: r2 is cooling down, so x moves instead
    back = bal.moves([("b", [], [("r2", 1), ("x", 3), ("y", 4)]), ("c", [], [])], now=5.0)
    assert [m.rid for m in back] == ["x"]
    assert bal.cooling(20.0) == set()


def test_select_running_prefers_fewest_tokens_and_skips_excluded():
    assert select_running([("a", 9), ("b", 1), ("c", 1), ("d", 4)], 3, exclude={"c"}) == ["b", "d", "a"]


def test_select_queued_prefers_most_recent():
    assert select_queued(["a", "b", "c"], 2) == ["c", "b"]


# ---------------------------------------------------------------------------------------------- property


ops = st.lists(st.tuples(st.sampled_from(["arrive", "complete", "preempt", "join", "balance", "dispatch"]),
                         st.integers(0, 1 << 30)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops=ops, theta=st.integers(1, 12), plateau=st.integers(1, 16), seed=st.integers(0, 1 << 16))
def test_balancer_never_loses_or_duplicates_requests(ops, theta, plateau, seed):
    """Random arrivals, completions, preemptions, joins, dispatches and balancer moves: every live request is
    in exactly one place (manager queue or one instance), every move names a request where the plan says."""
    rnd = random.Random(seed)
    bal = Balancer(prior_plateau=plateau, cooldown_s=3.0, max_moves=rnd.randint(1, 64))
    manager: list[int] = []
    inst: dict[str, dict[str, dict]] = {}   # iid -> {"queued": {rid: None}, "running": {rid: tokens}}
    live: set[int] = set()
    next_rid = 0
    now = 0.0

    def check():
        seen: list[int] = list(manager)
        for s in inst.values():
            seen += list(s["queued"]) + list(s["running"])
        assert len(seen) == len(set(seen)), "a request is in two places"
        assert set(seen) == live, "a request was lost or invented"

    for op, x in ops:
        now += 1.0
        if op == "arrive":
            for _ in range(1 + x % 5):
                manager.append(next_rid)
                live.add(next_rid)
                next_rid += 1
        elif op == "join":
            inst[f"i{x % 1000}"] = inst.get(f"i{x % 1000}") or {"queued": {}, "running": {}}
        elif op == "dispatch" and inst:
            ids = sorted(inst)
            while manager:
                i = choose_instance([len(inst[k]["queued"]) + len(inst[k]["running"]) for k in ids], theta)
                if i is None:
                    break
                rid = manager.pop(0)
                tgt = inst[ids[i]]
                (tgt["running"] if len(tgt["running"]) < plateau * 2 else tgt["queued"])[rid] = 0
        elif op == "complete" and inst:
            s = inst[sorted(inst)[x % len(inst)]]
            if s["running"]:
                rid = sorted(s["running"])[x % len(s["running"])]
                del s["running"][rid]
                live.discard(rid)
            for rid in s["running"]:
                s["running"][rid] += 1
        elif op == "preempt" and inst:
            k = sorted(inst)[x % len(inst)]
            s = inst.pop(k)
            manager[:0] = sorted(s["running"]) + list(s["queued"])  # migration: back to the head
            bal.forget(k)
        elif op == "balance" and len(inst) >= 2:
            for k, s in inst.items():
                if s["running"]:
                    bal.observe(k, len(s["running"]), 100.0 * len(s["running"]) / (len(s["running"]) + 3))
            view = [(k, list(s["queued"]), list(s["running"].items())) for k, s in sorted(inst.items())]
            moves = bal.moves(view, now=now)
            assert len({m.rid for m in moves}) == len(moves), "a request moved twice in one plan"
            for m in moves:
                assert m.src != m.dst and m.src in inst and m.dst in inst
                src = inst[m.src][m.kind]
                assert m.rid in src, "move names a request that is not where the plan says"
                tokens = src.pop(m.rid)
                inst[m.dst]["queued"][m.rid] = tokens  # it resumes after a re-prefill on the receiver
        check()


def test_arrival_share_is_an_equal_share_over_serving_and_arriving_instances():
    from rlboost_hpc.policy.dispatch import arrival_share

    assert arrival_share(64, 1, 1) == 32 and arrival_share(65, 2, 1) == 22 and arrival_share(0, 1, 3) == 0
    assert arrival_share(64, 3, 0) is None  # nothing arrives: Θ alone bounds
    for bad in ((-1, 1, 1), (5, 0, 0), (1, -1, 2)):
        with pytest.raises(ValueError):
            arrival_share(*bad)
