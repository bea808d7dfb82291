"""Scheduling policies of RLBoost: pure, deterministic functions of observed times and
loads, shared verbatim by the live rollout manager and the simulator (``rlboost_hpc.sim``).

* :mod:`.seeding` — adaptive seeding window ``T_seed`` with per-instance-count memory.
* :mod:`.cap` — the preemptible-pool cap ``N_prem``.
* :mod:`.dispatch` — JSQ with pending threshold Θ, round-robin (ablation), online plateau learning and the
  continuous load balancer.
* :mod:`.controller` — the per-step controller combining the window and the cap.
"""
from rlboost_hpc.policy.cap import n_prem_cap, n_prem_raw
from rlboost_hpc.policy.controller import RolloutController, StepDecision, StepObservation
from rlboost_hpc.policy.dispatch import (
    Balancer, InstanceLoad, Move, PlateauEstimator, RoundRobin, Transfer, choose_instance, plan_dispatch,
    select_queued, select_running,
)
from rlboost_hpc.policy.seeding import SeedingWindow

__all__ = [
    "Balancer", "InstanceLoad", "Move", "PlateauEstimator", "RolloutController", "RoundRobin", "SeedingWindow",
    "StepDecision", "StepObservation", "Transfer", "choose_instance", "n_prem_cap", "n_prem_raw",
    "plan_dispatch", "select_queued", "select_running",
]
