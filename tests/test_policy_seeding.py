"""Behaviour of the adaptive seeding window (rlboost_hpc/policy/seeding.py; RLBoost, arXiv 2510.19225)."""
from __future__ import annotations

import math

import pytest

from rlboost_hpc.policy.seeding import SeedingWindow

# (name, initial, eta, floor, t_wait_train, t_wait_remote, expected T_seed after one update)
UPDATE_CASES = [
    ("grows_when_trainer_waits", 150.0, 3.0, 5.0, 30.0, 0.0, 160.0),
    ("shrinks_when_remote_waits", 150.0, 3.0, 5.0, 0.0, 60.0, 130.0),
    ("unchanged_when_waits_balance", 150.0, 3.0, 5.0, 42.0, 42.0, 150.0),
    ("difference_is_divided_by_eta", 100.0, 4.0, 5.0, 20.0, 8.0, 103.0),
    ("clamped_at_floor", 10.0, 3.0, 5.0, 0.0, 300.0, 5.0),
    ("floor_zero_allows_zero", 10.0, 3.0, 0.0, 0.0, 300.0, 0.0),
]


@pytest.mark.parametrize("name,initial,eta,floor,wt,wr,expected", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_seed_window_update_rule(name, initial, eta, floor, wt, wr, expected):
    w = SeedingWindow(initial_s=initial, eta=eta, floor_s=floor)
    assert w.update(wt, wr, 4, 4) == pytest.approx(expected)
    assert w.value == pytest.approx(expected)


def test_seed_window_grows_when_trainer_waits():
    w = SeedingWindow()
    assert w.update(t_wait_train_s=45.0, t_wait_remote_s=0.0, n_instances_start=3, n_instances_end=3) > 150.0


def test_seed_window_shrinks_when_remote_waits():
    w = SeedingWindow()
    assert w.update(t_wait_train_s=0.0, t_wait_remote_s=45.0, n_instances_start=3, n_instances_end=3) < 150.0


def test_seed_window_never_below_floor_over_many_steps():
    w = SeedingWindow(initial_s=150, floor_s=5)
    for _ in range(100):
        w.update(0.0, 500.0, 2, 2)
    assert w.value == 5.0


def test_seed_window_respects_ceiling():
    w = SeedingWindow(initial_s=150, ceil_s=200)
    for _ in range(10):
        w.update(500.0, 0.0, 2, 2)
    assert w.value == 200.0


def test_memory_stores_adapted_value_when_count_held():
    w = SeedingWindow(initial_s=150)
    w.update(30.0, 0.0, 4, 4)  # -> 160, stored for n=4
    assert w.mem == {4: pytest.approx(160.0)}


def test_memory_not_stored_when_count_changed_during_step():
    w = SeedingWindow(initial_s=150)
    w.update(30.0, 0.0, 4, 5)
    assert w.mem == {}


def test_memory_recalls_on_count_change_within_step():
    w = SeedingWindow(initial_s=150)
    w.update(30.0, 0.0, 2, 2)      # M[2] = 160
    w.update(0.0, 300.0, 4, 4)     # adapt down to 60, M[4] = 60
    assert w.value == pytest.approx(60.0)
    # count drops 4 -> 2 during this step: adapt (60 -> 60), then recall M[2]
    assert w.update(0.0, 0.0, 4, 2) == pytest.approx(160.0)


def test_memory_recalls_on_count_change_between_steps():
    w = SeedingWindow(initial_s=150)
    w.update(30.0, 0.0, 2, 2)      # M[2] = 160, last count 2
    w.update(0.0, 300.0, 4, 4)     # M[4] = 60
    assert w.begin_step(2) == pytest.approx(160.0)
    assert w.begin_step(2) == pytest.approx(160.0)  # same count again: nothing changes
    assert w.begin_step(4) == pytest.approx(60.0)


def test_first_sight_of_a_count_keeps_the_adapted_value():
    w = SeedingWindow(initial_s=150)
    w.update(30.0, 0.0, 2, 2)      # 160, M[2]
    assert w.update(3.0, 0.0, 2, 7) == pytest.approx(161.0)  # 7 never seen: keep adapted value
    assert w.begin_step(9) == pytest.approx(161.0)            # 9 never seen either
    assert 7 not in w.mem and 9 not in w.mem


def test_no_memory_ablation_never_stores_or_recalls():
    w = SeedingWindow(initial_s=150, memory=False)
    w.update(30.0, 0.0, 2, 2)
    w.update(0.0, 300.0, 4, 4)
    assert w.mem == {}
    assert w.begin_step(2) == pytest.approx(60.0)


def test_no_adaptation_ablation_keeps_initial_window():
    w = SeedingWindow(initial_s=150, adapt=False)
    for wt, wr in ((100.0, 0.0), (0.0, 100.0)):
        assert w.update(wt, wr, 3, 3) == 150.0
    assert w.mem == {}


def test_begin_step_before_any_update_is_a_no_op():
    w = SeedingWindow(initial_s=120)
    assert w.begin_step(5) == 120.0


@pytest.mark.parametrize("kwargs", [dict(eta=0), dict(eta=-1), dict(floor_s=-1), dict(initial_s=math.nan),
                                    dict(ceil_s=1, floor_s=5)])
def test_invalid_configuration_raises(kwargs):
    with pytest.raises(ValueError):
        SeedingWindow(**kwargs)


@pytest.mark.parametrize("args", [(-1.0, 0.0, 1, 1), (0.0, math.inf, 1, 1), (0.0, 0.0, -1, 1), (math.nan, 0, 1, 1)])
def test_invalid_observation_raises(args):
    with pytest.raises(ValueError):
        SeedingWindow().update(*args)


def test_snapshot_restore_roundtrip():
    w = SeedingWindow()
    w.update(30.0, 0.0, 2, 2)
    w.update(0.0, 60.0, 3, 3)
    w2 = SeedingWindow()
    w2.restore(w.snapshot())
    assert (w2.value, w2.mem, w2.last_n) == (w.value, w.mem, w.last_n)
    assert w2.update(5.0, 1.0, 3, 2) == w.update(5.0, 1.0, 3, 2)
