"""The per-step controller (seeding window + cap) is a pure function of its observation sequence: replaying a
recorded sequence — here recorded from the simulator — reproduces every decision (the live manager feeds the
same StepObservation and so makes the same decisions on the same events)."""
from __future__ import annotations

from rlboost_hpc.policy.controller import RolloutController, StepObservation
from rlboost_hpc.policy.seeding import SeedingWindow
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.sim.simulator import Simulation
from rlboost_hpc.sim.systems import RLBOOST
from rlboost_hpc.sim.workload import segment


def test_replaying_recorded_observations_reproduces_simulator_decisions():
    p = profile("8b")
    sim = Simulation(p, RLBOOST, segment("A"), duration_s=3600.0)
    sim.run()
    history = sim.controller.history
    assert len(history) >= 5
    fresh = RolloutController(n_resv=p.n_resv_equiv, seeding=SeedingWindow(initial_s=150.0, eta=3.0, floor_s=5.0))
    for (obs, dec), rec in zip(history, sim.timeline):
        fresh.begin_step(obs["n_instances_start"])
        got = fresh.end_step(StepObservation(**obs))
        assert got.t_seed_s == dec["t_seed_s"]
        assert got.n_prem_cap == dec["n_prem_cap"]
        assert rec["cap_next"] == dec["n_prem_cap"]


def test_controller_has_no_cap_before_first_observation_and_obeys_availability():
    ctl = RolloutController(n_resv=4)
    assert ctl.cap is None
    assert ctl.begin_step(3) == 150.0
    d = ctl.end_step(StepObservation(t_seed_s=150, t_wait_train_s=0, t_wait_remote_s=30, t_remote_s=100,
                                     n_remote=3, t_train_s=100, n_instances_start=3, n_instances_end=3,
                                     n_available=5))
    assert d.t_seed_s == 140.0
    assert d.n_prem_cap == 5  # raw (300 + 600)/100 = 9, clamped to the 5 available


def test_controller_without_cap_uses_everything_available():
    ctl = RolloutController(n_resv=4, use_cap=False)
    d = ctl.end_step(StepObservation(150, 0, 0, 10, 1, 100, 1, 1, n_available=12))
    assert d.n_prem_cap == 12


def _obs(**kw):
    base = dict(t_seed_s=0.0, t_wait_train_s=0.0, t_wait_remote_s=0.0, t_remote_s=100.0, n_remote=8, t_train_s=300.0,
                n_instances_start=8, n_instances_end=8, n_available=20, step_s=330.0)
    return StepObservation(**{**base, **kw})


def test_under_overlap_t_seed_goes_to_its_floor_and_the_cap_follows_the_pool():
    """Bounded staleness: T_seed goes to its floor (a step is mostly generated before it starts); the cap is the
    overlap law (the paper's would read 8 · 100 / 300 → 3 from the same step, and the pool would fall behind)."""
    ctl = RolloutController(n_resv=4, seeding=SeedingWindow(initial_s=150.0, eta=3.0, floor_s=5.0), overlap=True)
    d = ctl.end_step(_obs(t_wait_remote_s=300.0))  # a pool idle after 30 s of the step
    assert d.t_seed_s == 5.0 and d.n_prem_cap == 1  # 8 · 30 / 330 → 1
    assert ctl.end_step(_obs()).n_prem_cap == 8  # busy the whole step, the trainer never held back
    d = ctl.end_step(_obs(t_seed_s=60.0, t_wait_train_s=50.0))  # behind: seeded 60 s, waited 50 s
    assert d.n_prem_cap == 12 and d.t_seed_s == 5.0  # 8 · 330 / 220
    paper = RolloutController(n_resv=4, seeding=SeedingWindow(initial_s=150.0, eta=3.0, floor_s=5.0))
    assert paper.end_step(_obs()).n_prem_cap == 3


def test_under_overlap_a_step_without_preemptible_instances_still_sizes_a_first_pool():
    """Regression: the overlap law alone gave 0 for a step no preemptible instance served (0 · busy), so a live k = 1
    run never admitted one. With no instance the paper's law, whose seeding term counts the reserved engines'
    work, sizes the first pool."""
    ctl = RolloutController(n_resv=1, seeding=SeedingWindow(initial_s=0.2, eta=3.0, floor_s=0.05), overlap=True)
    d = ctl.end_step(_obs(n_remote=0, t_remote_s=0.0, t_seed_s=0.2, t_train_s=0.5, step_s=0.9, n_available=2))
    assert d.n_prem_cap == 1
