"""The paper's table (RLBoost vs its baselines and ablations): throughput and tokens per dollar per system, as
ratios to co-located verl, for the 8B/14B/32B profiles.

Layout of :func:`paper_table`'s result (also what ``rlboost-hpc simulate --paper-table --json`` prints)::

    {"8b": {"colocated": {...}, "verl_2x": {...}, "disaggregated": {...}, "rlboost": {...},
            "rlboost_no_seeding": {...}, ..., "rlboost@fixed4": {...}, "rlboost_no_seeding@fixed4": {...}, ...},
     "14b": {...}, "32b": {...},
     "meta": {"targets": {...}, "segments": {...}, "duration_s": ..., "seed": ..., "notes": [...]}}

Every system entry has ``throughput_ratio_vs_colocated``, ``cost_efficiency_ratio_vs_colocated``,
``throughput_tokens_per_s``, ``tokens_per_dollar``, ``cost_per_hour_usd``, ``mean_remote_instances``, ``steps``.
Trace systems are pooled over the segments (total tokens / total time; total tokens / total dollars).
``disaggregated`` is the most cost-efficient of a sweep over its dedicated instance count ``k`` (reported).
``…@fixed4`` entries rerun RLBoost and its ablations on a fixed pool of 4 never-preempted spot instances
(the setting in which the paper's seeding ablation is most directly comparable).
"""
from __future__ import annotations

import contextlib

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from rlboost_hpc.sim.profiles import MODELS, profile
from rlboost_hpc.sim.simulator import RunResult, simulate
from rlboost_hpc.sim.systems import SYSTEMS, TRACE_SYSTEMS
from rlboost_hpc.sim.workload import SEGMENTS, Availability, segment

#: The paper's figures: RLBoost vs co-located throughput and cost efficiency; ablation deltas vs RLBoost.
TARGETS = {
    "8b": {"throughput_ratio": 1.66, "cost_efficiency_ratio": 1.34, "disagg_extra_cost_per_token": 0.62},
    "14b": {"throughput_ratio": 1.97, "cost_efficiency_ratio": 1.49, "disagg_extra_cost_per_token": 0.75},
    "32b": {"throughput_ratio": 1.51, "cost_efficiency_ratio": 1.28, "disagg_extra_cost_per_token": 0.45},
    "ablations": {"no_seeding_throughput_delta": -0.19, "memory_throughput_gain": 0.06,
                  "rlboost_vs_verl_2x_up_to": 0.24},
}
DISAGG_KS = (2, 3, 4, 5, 6, 8, 10, 12)
FIXED_POOL = 4
FIXED_SYSTEMS = ("rlboost", "rlboost_no_seeding", "rlboost_no_memory", "rlboost_fixed_seed", "rlboost_recompute",
                 "rlboost_round_robin")


@dataclass(frozen=True)
class Job:
    model: str
    system: str
    avail: str          # "none" | "fixed:<k>" | "seg:<name>"
    duration_s: float
    seed: int


def _avail(spec: str) -> Availability | None:
    if spec == "none":
        return None
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return Availability.fixed(int(arg))
    if kind == "seg":
        return segment(arg)
    raise ValueError(spec)


def run_job(job: Job) -> RunResult:
    p = profile(job.model)
    if job.system == "verl_2x":
        p = p.doubled()
    return simulate(p, SYSTEMS[job.system], _avail(job.avail), duration_s=job.duration_s, seed=job.seed,
                    model_name=job.model)


def _pooled(results: list[RunResult]) -> dict:
    tokens = sum(r.tokens for r in results)
    wall = sum(r.wall_s for r in results)
    cost = sum(r.cost_usd for r in results)
    inst_h = sum(r.remote_instance_hours for r in results)
    return {
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "tokens_per_dollar": tokens / cost if cost else 0.0,
        "cost_per_hour_usd": cost / (wall / 3600.0) if wall else 0.0,
        "mean_remote_instances": inst_h / (wall / 3600.0) if wall else 0.0,
        "steps": sum(r.steps for r in results),
        "preemptions": sum(r.counters["preemptions"] for r in results),
        "tokens_migrated": sum(r.counters["tokens_migrated"] for r in results),
        "tokens_regenerated": sum(r.counters["tokens_regenerated"] for r in results),
    }


def paper_table(models=MODELS, segments=tuple(SEGMENTS), *, duration_s: float = 7200.0, seed: int = 0,
                jobs: int = 1, fixed_pool: bool = True, on_run=None) -> dict:
    """Run every system for every model and return the table (see the module docstring). ``on_run(done, total)``
    is called after each simulated run (a progress bar)."""
    plan: list[Job] = []
    for m in models:
        plan.append(Job(m, "colocated", "none", duration_s, seed))
        plan.append(Job(m, "verl_2x", "none", duration_s, seed))
        plan.extend(Job(m, "disaggregated", f"fixed:{k}", duration_s, seed) for k in DISAGG_KS)
        for s in TRACE_SYSTEMS:
            plan.extend(Job(m, s, f"seg:{g}", duration_s, seed) for g in segments)
        if fixed_pool:
            plan.extend(Job(m, s, f"fixed:{FIXED_POOL}", duration_s, seed) for s in FIXED_SYSTEMS)
    results: list[RunResult] = []
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else contextlib.nullcontext() as ex:
        for r in (ex.map(run_job, plan, chunksize=4) if ex is not None else map(run_job, plan)):
            results.append(r)
            if on_run is not None:
                on_run(len(results), len(plan))
    by: dict[tuple, list[RunResult]] = {}
    for j, r in zip(plan, results):
        key = (j.model, j.system if not j.avail.startswith("fixed") or j.system == "disaggregated"
               else f"{j.system}@fixed{FIXED_POOL}")
        if j.system == "disaggregated":
            key = (j.model, f"disaggregated:{j.avail.split(':')[1]}")
        by.setdefault(key, []).append(r)
    out: dict = {}
    for m in models:
        entry: dict = {}
        names = [n for (mm, n) in by if mm == m]
        for n in names:
            entry[n] = _pooled(by[(m, n)])
        disagg = {n: v for n, v in entry.items() if n.startswith("disaggregated:")}
        for n in disagg:
            del entry[n]
        best = max(disagg, key=lambda n: disagg[n]["tokens_per_dollar"])
        entry["disaggregated"] = {**disagg[best], "instances": int(best.split(":")[1]),
                                  "sweep": {n.split(":")[1]: {"throughput_tokens_per_s": v["throughput_tokens_per_s"],
                                                              "tokens_per_dollar": v["tokens_per_dollar"]}
                                            for n, v in disagg.items()}}
        base = entry["colocated"]
        for v in entry.values():
            v["throughput_ratio_vs_colocated"] = v["throughput_tokens_per_s"] / base["throughput_tokens_per_s"]
            v["cost_efficiency_ratio_vs_colocated"] = v["tokens_per_dollar"] / base["tokens_per_dollar"]
        rl = entry["rlboost"]
        for n, v in entry.items():
            ref = entry.get(f"rlboost@fixed{FIXED_POOL}") if n.endswith(f"@fixed{FIXED_POOL}") else rl
            if n.startswith("rlboost") and ref is not None:
                v["throughput_delta_vs_rlboost"] = v["throughput_tokens_per_s"] / ref["throughput_tokens_per_s"] - 1
                v["cost_efficiency_delta_vs_rlboost"] = v["tokens_per_dollar"] / ref["tokens_per_dollar"] - 1
        entry["disaggregated"]["extra_cost_per_token_vs_rlboost"] = (
            rl["tokens_per_dollar"] / entry["disaggregated"]["tokens_per_dollar"] - 1)
        entry["verl_2x"]["rlboost_throughput_gain_over_this"] = (
            rl["throughput_tokens_per_s"] / entry["verl_2x"]["throughput_tokens_per_s"] - 1)
        t = TARGETS[m]
        rl["target_throughput_ratio"] = t["throughput_ratio"]
        rl["target_cost_efficiency_ratio"] = t["cost_efficiency_ratio"]
        rl["throughput_error_vs_target"] = rl["throughput_ratio_vs_colocated"] / t["throughput_ratio"] - 1
        rl["cost_efficiency_error_vs_target"] = rl["cost_efficiency_ratio_vs_colocated"] / t["cost_efficiency_ratio"] - 1
        out[m] = entry
    out["meta"] = {
        "targets": TARGETS,
        "segments": {g: {"trace": SEGMENTS[g][0], "start_s": SEGMENTS[g][1], "duration_s": SEGMENTS[g][2]}
                     for g in segments},
        "duration_s": duration_s, "seed": seed, "fixed_pool": FIXED_POOL, "disaggregated_sweep": list(DISAGG_KS),
        "notes": ["ratios pool all segments: total tokens / total time and total tokens / total dollars",
                  "profile numbers and their sources: docs/simulator.md"],
    }
    return out


def format_table(t: dict) -> str:
    """Human-readable rendering of :func:`paper_table`'s result."""
    lines = []
    for m, entry in t.items():
        if m == "meta":
            continue
        tg = TARGETS.get(m, {})
        lines.append(f"Qwen3-{m.upper()}  (paper: {tg.get('throughput_ratio')}x throughput, "
                     f"+{(tg.get('cost_efficiency_ratio', 1) - 1) * 100:.0f}% tokens/$)")
        lines.append(f"  {'system':28s} {'tok/s':>8s} {'x thr':>6s} {'tok/$':>9s} {'x tok/$':>7s} {'$/h':>7s} "
                     f"{'inst':>5s} {'vs RLB':>7s}")
        for n, v in entry.items():
            d = v.get("throughput_delta_vs_rlboost")
            extra = f"{d:+7.1%}" if d is not None and n != "rlboost" else ""
            if n == "disaggregated":
                extra = f" k={v['instances']}"
            lines.append(f"  {n:28s} {v['throughput_tokens_per_s']:8.0f} {v['throughput_ratio_vs_colocated']:6.2f} "
                         f"{v['tokens_per_dollar']:9.0f} {v['cost_efficiency_ratio_vs_colocated']:7.2f} "
                         f"{v['cost_per_hour_usd']:7.2f} {v['mean_remote_instances']:5.1f} {extra}")
        rl = entry["rlboost"]
        lines.append(f"  → RLBoost vs target: throughput {rl['throughput_error_vs_target']:+.1%}, "
                     f"cost efficiency {rl['cost_efficiency_error_vs_target']:+.1%}; disaggregated pays "
                     f"{entry['disaggregated']['extra_cost_per_token_vs_rlboost']:+.0%} per token vs RLBoost "
                     f"(paper {tg.get('disagg_extra_cost_per_token', 0):+.0%}); RLBoost vs verl 2x: "
                     f"{entry['verl_2x']['rlboost_throughput_gain_over_this']:+.0%}")
        lines.append("")
    return "\n".join(lines)
