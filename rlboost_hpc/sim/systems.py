"""The simulated systems (the paper's baselines and ablations).

* ``colocated`` — verl hybrid engine: the reserved GPUs do the whole rollout (prompts split evenly and
  statically across engines, as verl does), then train; no preemptible capacity.
* ``verl_2x`` — the same on twice the reserved GPUs (priced as such).
* ``disaggregated`` — StreamRL-style balanced disaggregation: the reserved node only trains (streaming
  micro-batches), rollout runs on ``k`` dedicated 2-GPU instances billed on demand, never preempted; ``k`` is
  swept and the most cost-efficient one reported ("sized to match training").
* ``rlboost`` — reserved node + preemptible pool: adaptive seeding with memory, ``N_prem`` cap, JSQ+Θ,
  continuous balancer, per-sample migration.
* ablations: ``rlboost_no_seeding`` (T_seed = 0: reserved GPUs only train, except the co-located fallback when
  no remote instance exists), ``rlboost_no_memory``, ``rlboost_fixed_seed`` (no adaptation: T_seed = 150 s),
  ``rlboost_recompute`` (preempted responses restart from scratch; no running-request moves),
  ``rlboost_round_robin`` (round-robin dispatch, no Θ, no balancer), ``rlboost_no_cap`` (use every
  available instance).
"""
from __future__ import annotations

from rlboost_hpc.sim.simulator import SystemSpec

COLOCATED = SystemSpec("colocated", colocated=True, seeding=False, dispatch="static", balancer=False,
                       use_cap=False)
VERL_2X = SystemSpec("verl_2x", colocated=True, seeding=False, dispatch="static", balancer=False, use_cap=False)
DISAGGREGATED = SystemSpec("disaggregated", seeding=False, adapt=False, use_cap=False, remote_on_demand=True)
RLBOOST = SystemSpec("rlboost")
ABLATIONS = {
    "rlboost_no_seeding": SystemSpec("rlboost_no_seeding", seeding=False),
    "rlboost_no_memory": SystemSpec("rlboost_no_memory", memory=False),
    "rlboost_fixed_seed": SystemSpec("rlboost_fixed_seed", adapt=False),
    "rlboost_recompute": SystemSpec("rlboost_recompute", migration=False),
    "rlboost_round_robin": SystemSpec("rlboost_round_robin", dispatch="round_robin", balancer=False),
    "rlboost_no_cap": SystemSpec("rlboost_no_cap", use_cap=False),
}
SYSTEMS: dict[str, SystemSpec] = {
    "colocated": COLOCATED, "verl_2x": VERL_2X, "disaggregated": DISAGGREGATED, "rlboost": RLBOOST, **ABLATIONS,
}
TRACE_SYSTEMS = ("rlboost", *ABLATIONS)
