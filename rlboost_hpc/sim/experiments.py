"""Smaller experiments of the paper (its figures beyond the main table), run on the same simulator.

* :func:`preemption_overhead` — per-sample migration vs recompute-from-scratch when one instance of a fixed
  pool is preempted ``at_s`` seconds into a step (paper: migration cuts the overhead by 33% at 100 s and 76%
  at 200 s).
* :func:`length_sweep` — throughput vs co-located as the maximum response length grows (paper: 5K→14K gives
  1.47×–2.22×, best instance count 3→6), over fixed pools of never-preempted instances.
"""
from __future__ import annotations

from dataclasses import replace

from rlboost_hpc.cluster.traces import TraceEvent
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.sim.simulator import simulate
from rlboost_hpc.sim.systems import COLOCATED, RLBOOST
from rlboost_hpc.sim.workload import Availability


def preemption_overhead(model: str = "8b", at_s=(100.0, 200.0), *, pool: int = 4, step: int = 3,
                        seed: int = 0) -> dict:
    """Step-time overhead of preempting one of ``pool`` instances ``at_s`` seconds into step ``step``.

    Overhead = step time with the preemption − step time without it (same seed, same earlier steps).
    Returns ``{at_s: {"migration_overhead_s", "recompute_overhead_s", "reduction"}}``.
    """
    p = profile(model)
    base_sys = replace(RLBOOST, use_cap=False)
    base = simulate(p, base_sys, Availability.fixed(pool), max_steps=step + 1, duration_s=1e9, seed=seed)
    t_start, base_s = base.timeline[step]["t_start"], base.timeline[step]["step_s"]
    out = {}
    for at in at_s:
        res = {}
        for mode, mig in (("migration", True), ("recompute", False)):
            av = Availability(Availability.fixed(pool).initial, (TraceEvent(t_start + at, "remove", "fixed-0"),),
                              f"fixed-{pool}-preempt@{at}")
            r = simulate(p, replace(base_sys, migration=mig, name=f"rlboost_{mode}"), av, max_steps=step + 1,
                         duration_s=1e9, seed=seed)
            res[f"{mode}_overhead_s"] = r.timeline[step]["step_s"] - base_s
            res[f"{mode}_tokens_lost"] = r.timeline[step]["tokens_regenerated"]
        ov_m, ov_r = res["migration_overhead_s"], res["recompute_overhead_s"]
        res["reduction"] = 1.0 - ov_m / ov_r if ov_r > 0 else 0.0
        out[float(at)] = res
    return out


def length_sweep(model: str = "8b", max_lengths=(5120, 8192, 11264, 14336), pools=tuple(range(1, 9)), *,
                 duration_s: float = 7200.0, seed: int = 0) -> dict:
    """For each maximum response length (median scaled with it): RLBoost's throughput and cost-efficiency
    ratios over co-located for each fixed pool size, the best pool by throughput and by tokens per dollar."""
    base = profile(model)
    out = {}
    for L in max_lengths:
        w = replace(base.workload, max_response=int(L),
                    response_median=base.workload.response_median * L / base.workload.max_response)
        p = replace(base, workload=w)
        co = simulate(p, COLOCATED, None, duration_s=duration_s, seed=seed)
        ratios, ce = {}, {}
        for n in pools:
            r = simulate(p, replace(RLBOOST, use_cap=False), Availability.fixed(n), duration_s=duration_s,
                         seed=seed)
            ratios[n] = r.throughput / co.throughput
            ce[n] = r.tokens_per_dollar / co.tokens_per_dollar
        best = max(ratios, key=lambda n: ratios[n])
        best_ce = max(ce, key=lambda n: ce[n])
        out[int(L)] = {"colocated_tokens_per_s": co.throughput, "throughput_ratios": ratios,
                       "cost_efficiency_ratios": ce, "best_pool_throughput": best, "best_throughput_ratio": ratios[best],
                       "best_pool_cost_efficiency": best_ce, "throughput_ratio_at_best_cost_pool": ratios[best_ce]}
    return out
