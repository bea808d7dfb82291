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
