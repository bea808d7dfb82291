"""Behaviour of the preemptible-pool cap N_prem (rlboost_hpc/policy/cap.py; RLBoost, arXiv 2510.19225)."""
from __future__ import annotations

import math

import pytest

from rlboost_hpc.policy.cap import n_prem_cap, n_prem_cap_overlap, n_prem_raw, work_seconds

# (name, t_remote, n_prem, t_seed, n_resv, t_train, available, minimum, expected)
CASES = [
    ("formula_exact_integer", 100.0, 4, 50.0, 4, 150.0, None, 0, 4),          # (400+200)/150 = 4
    ("rounds_up_fraction", 100.0, 4, 60.0, 4, 150.0, None, 0, 5),             # 640/150 = 4.27
    ("float_noise_not_bumped", 0.1 * 3, 10, 0.0, 0, 0.3 * 10 / 3, None, 0, 3),
    ("clamped_to_available", 300.0, 10, 100.0, 4, 100.0, 6, 0, 6),
    ("never_below_minimum", 0.0, 0, 0.0, 4, 100.0, None, 1, 1),
    ("available_wins_over_minimum", 0.0, 0, 0.0, 4, 100.0, 0, 1, 0),
    ("zero_work_gives_zero", 0.0, 0, 0.0, 0, 100.0, None, 0, 0),
    ("seeding_only_counts", 0.0, 0, 150.0, 4, 200.0, None, 0, 3),             # 600/200
    ("no_training_time_means_available", 100.0, 4, 50.0, 4, 0.0, 7, 0, 7),
]


@pytest.mark.parametrize("name,tr,n,ts,nr,tt,avail,mn,expected", CASES, ids=[c[0] for c in CASES])
def test_cap_table(name, tr, n, ts, nr, tt, avail, mn, expected):
    assert n_prem_cap(tr, n, ts, nr, tt, available=avail, minimum=mn) == expected


def test_cap_unbounded_without_training_time_and_availability():
    assert n_prem_cap(100.0, 4, 50.0, 4, 0.0) is None
    assert n_prem_raw(100.0, 4, 50.0, 4, 0.0) == math.inf


def test_cap_grows_with_remote_work_and_shrinks_with_training_time():
    a = n_prem_cap(100.0, 4, 50.0, 4, 150.0)
    assert n_prem_cap(200.0, 4, 50.0, 4, 150.0) > a
    assert n_prem_cap(100.0, 4, 50.0, 4, 600.0) < a


@pytest.mark.parametrize("bad", [dict(t_remote_s=-1.0), dict(n_prem=-1), dict(t_seed_s=math.nan),
                                 dict(t_train_s=math.inf), dict(n_resv=-0.5)])
def test_invalid_inputs_raise(bad):
    args = dict(t_remote_s=1.0, n_prem=1, t_seed_s=1.0, n_resv=1, t_train_s=1.0) | bad
    with pytest.raises(ValueError):
        n_prem_cap(**args)


def test_invalid_clamps_raise():
    with pytest.raises(ValueError):
        n_prem_cap(1, 1, 1, 1, 1, minimum=-1)
    with pytest.raises(ValueError):
        n_prem_cap(1, 1, 1, 1, 1, available=-1)


@pytest.mark.parametrize("tokens,peak,expected", [(6000.0, 3000.0, 2.0), (0.0, 3000.0, 0.0), (10.0, None, 0.0),
                                                  (10.0, 0.0, 0.0)])
def test_work_seconds_is_tokens_over_peak_rate(tokens, peak, expected):
    assert work_seconds(tokens, peak) == pytest.approx(expected)


def test_work_seconds_rejects_negative_tokens():
    with pytest.raises(ValueError):
        work_seconds(-1.0, 10.0)


def test_the_overlap_cap_keeps_a_busy_pool_shrinks_an_idle_one_and_grows_one_the_trainer_waited_for():
    # 8 instances busy the whole 300 s step, the trainer never held back: the pool is right
    assert n_prem_cap_overlap(300.0, 8, 300.0) == 8
    # idle for the last 150 s (every admitted step generated): half would do
    assert n_prem_cap_overlap(150.0, 8, 300.0) == 4
    # the trainer waited 100 s of a 300 s step for data: 8 · 300 / 200 = 12
    assert n_prem_cap_overlap(300.0, 8, 200.0, available=20) == 12
    assert n_prem_cap_overlap(300.0, 8, 200.0, available=10) == 10
    assert n_prem_cap_overlap(300.0, 8, 0.0, available=10) == 10  # no information: everything available
    with pytest.raises(ValueError):
        n_prem_cap_overlap(-1.0, 8, 300.0)
