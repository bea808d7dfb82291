"""The simulated systems: what a system is (:class:`SystemSpec`, the knobs the simulator reads) and the named
ones (the paper's baselines and ablations).

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
* bounded staleness (``rlboost_k1``, ``rlboost_k2``): RLBoost with ``max_staleness`` = 1 / 2 — the next steps'
  prompts generate while a step trains (``on_new_version = "finish"``); every token trained is at most k versions
  older than the version that trains it. Not on-policy: a choice the live system offers as ``rollout.max_staleness``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SystemSpec:
    """How a system behaves. See :data:`SYSTEMS` for the named ones."""

    name: str
    colocated: bool = False        # verl: reserved GPUs do the whole rollout, then train (no remote pool)
    seeding: bool = True           # reserved GPUs seed for T_seed (False: T_seed = 0, fallback only)
    t_seed_initial_s: float = 150.0
    eta: float = 3.0
    floor_s: float = 5.0
    adapt: bool = True
    memory: bool = True
    use_cap: bool = True
    max_staleness: int = 0         # k ≥ 1: the next k steps' prompts generate while a step trains (module docstring)
    overlap_controller: bool = True  # k ≥ 1: T_seed at its floor, the overlap cap (False: the paper's, ablation)
    dispatch: Literal["jsq", "round_robin", "static"] = "jsq"  # the manager's names; static: a fixed split (colocated)
    theta: int = 96                # Θ: most requests in flight (running + waiting) per instance
    balancer: bool = True
    migration: bool = True         # per-sample migration on preemption (False: recompute from scratch)
    remote_on_demand: bool = False  # remote instances billed at the on-demand rate (disaggregated)
    balance_interval_s: float = 2.0


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
STALENESS = {f"rlboost_k{k}": SystemSpec(f"rlboost_k{k}", max_staleness=k) for k in (1, 2)}
SYSTEMS: dict[str, SystemSpec] = {
    "colocated": COLOCATED, "verl_2x": VERL_2X, "disaggregated": DISAGGREGATED, "rlboost": RLBOOST, **ABLATIONS,
    **STALENESS,
}
TRACE_SYSTEMS = ("rlboost", *ABLATIONS, *STALENESS)
