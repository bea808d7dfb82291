"""The simulator on a live run's own terms: a profile calibrated from the run, the same trace window, the same
config — so ``rlboost-hpc stats --plot`` can draw the simulator's N_prem beside the controller's live one.

Calibration (every number from the run directory; nothing fitted to N_prem itself):

* **Decode**: the manager's decode rate by batch over the preemptible instances (report
  ``decode_tokens_per_s_by_batch``, tokens/s per batch bucket) gives the time of one decode iteration at batch
  ``B``, ``B / rate(B)``; a least-squares line ``a + b·B`` through those points is the engine model
  (``EnginePerf``; prefill and the KV cache are not modelled: the KV capacity is unbounded). One bucket: ``a = 0``.
* **Training**: seconds per trained token = Σ ``train_s`` / Σ ``tokens`` over the run's steps (micro-batches and
  the optimizer step together); publishing: the mean ``publish_s``.
* **Workload**: ``rollout.prompts_per_step`` × ``group_size``, responses up to ``max_new_tokens`` with the run's
  median mean length (log-normal spread 0.3 per prompt and per response; none when the run's responses all ran to
  ``max_new_tokens``), prompts of the run's mean prompt length.
* **Instances**: one reserved engine and 1-GPU-equivalent instances (N_resv = the run's ``n_resv``), start-up
  ``boot_s``: the median process start → weights loaded of the run's own instances (their ``instance_ready``
  events in ``events.jsonl``; 1 s, ``benchmarks/bench_worker_startup.py``'s figure, when it has none), no
  co-located switch costs (the reserved engine and the trainer share a process).
* **Capacity**: the local cluster's replay plan (the same trace, window, time scale and cap as the run, rebuilt
  deterministically); under Slurm the caller's capacity series (the scavenger's live + idle slots, at most
  ``max_workers``).
* **Policy**: the run's ``policy`` settings and ``policy.t_seed_initial_s`` as the initial T_seed.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlboost_hpc.cluster.traces import TraceEvent
from rlboost_hpc.rundir import RunDir, read_jsonl
from rlboost_hpc.sim.profiles import EnginePerf, ModelSpec, Network, Profile, Workload
from rlboost_hpc.sim.simulator import Simulation
from rlboost_hpc.sim.systems import SystemSpec
from rlboost_hpc.sim.workload import Availability


class CalibrationError(ValueError):
    """The run directory lacks what calibration needs (the message names the file and key)."""


@dataclass(frozen=True)
class CalibratedProfile(Profile):
    """A :class:`Profile` whose engines and trainer are measured, not derived from a GPU data sheet."""

    perf: EnginePerf | None = None
    train_s_per_token: float = 0.0

    def reserved_perf(self) -> EnginePerf:
        return self.perf

    def instance_perf(self) -> EnginePerf:
        return self.perf

    def train_time(self, tokens: float, sq_tokens: float, n_gpus: int | None = None) -> float:
        return self.train_s_per_token * tokens


def fit_decode(rates: dict[str, float], max_batch: int) -> EnginePerf:
    """The engine model ``t_iter(B) = a + b·B`` from ``{batch bucket: tokens/s}`` (see the module docstring).

    Raises:
        CalibrationError: no positive rate.
    """
    pts = [(int(b), int(b) / r) for b, r in rates.items() if r and r > 0]
    if not pts:
        raise CalibrationError("report.json: decode_tokens_per_s_by_batch has no measurement (no preemptible "
                               "instance was busy through a balancer period)")
    if len(pts) == 1:
        a, b = 0.0, pts[0][1] / pts[0][0]
    else:
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        b = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else my / mx
        a = my - b * mx
        if a < 0 or b <= 0:  # noise: fall back to the line through the origin
            a, b = 0.0, sum(y for _, y in pts) / sum(x for x, _ in pts)
    return EnginePerf(a=a, b=b, gamma=0.0, pf_per_token=0.0, pf_quad=0.0, pf_fixed=0.0, kv_capacity=1e12,
                      max_running=max_batch, reserve_tokens=0.0)


def _availability(cfg: dict, capacity: list[tuple[float, float]] | None) -> Availability:
    from rlboost_hpc.config import ClusterCfg

    c = cfg["cluster"]
    if c["kind"] == "local":
        from rlboost_hpc.cluster.local import replay_plan

        plan, _ = replay_plan(ClusterCfg(**{k: v for k, v in c.items() if k != "kind"}, kind="local"))
        k = c.get("instances_per_worker", 1)  # a slot is one worker process hosting k instances
        events = tuple(TraceEvent(a.at_s, "add" if a.action == "start" else "remove", f"slot{a.slot}.{i}")
                       for a in plan for i in range(k))
        return Availability((), events, "local replay plan")
    if not capacity:
        raise CalibrationError("a Slurm run needs its capacity over time (the scavenger's reconcile log)")
    events, live = [], 0
    for t, cap in capacity:
        n = min(c["max_workers"], int(cap))
        while live < n:
            events.append(TraceEvent(t, "add", f"slot{live}"))
            live += 1
        while live > n:
            live -= 1
            events.append(TraceEvent(t, "remove", f"slot{live}"))
    return Availability((), tuple(events), "scavenger capacity")


#: Start-up phases before an instance can serve (``instance_ready`` events), what the simulator's ``boot_s`` is.
BOOT_PHASES = ("process_start->agent_start_s", "agent_start->welcome_s", "welcome->weights_loaded_s")


def measured_boot_s(run_dir: str | Path, default_s: float = 1.0) -> float:
    """Median seconds from a rollout instance's process start to its weights loaded, over the run's
    ``instance_ready`` events; ``default_s`` when there are none (a run from before the event existed)."""
    from rlboost_hpc.events import read_events

    boots = [sum(e[k] for k in BOOT_PHASES) for e in read_events(run_dir)
             if e.get("event") == "instance_ready" and all(isinstance(e.get(k), (int, float)) for k in BOOT_PHASES)]
    return statistics.median(boots) if boots else default_s


def simulate_run(run_dir: str | Path, *, capacity: list[tuple[float, float]] | None = None,
                 boot_s: float | None = None) -> dict[str, Any]:
    """Simulate ``run_dir``'s run (see the module docstring); ``capacity``: for a Slurm run, instances the run
    could hold over time (seconds since the run started, count), e.g. the scavenger's live + idle slots. Returns
    ``{"steps": [{"step", "t_end_s", "step_s", "tokens", "cap_next", "t_seed_s", "n_remote", "staleness_tokens"}...],
    "profile": {...}}``
    — ``cap_next`` is the simulator's N_prem after each step, ``step_s`` its wall seconds, ``tokens`` the tokens it
    trained, ``n_remote`` the preemptible instances that served it, ``staleness_tokens`` its generated tokens by
    staleness (``rollout.max_staleness``: the simulator's "finish" mode).

    Raises:
        CalibrationError: config.json, metrics.jsonl or report.json missing, or no decode measurement.
    """
    run_dir = Path(run_dir)
    try:
        cfg = json.loads(RunDir(run_dir).config.read_text())
        rep = json.loads(RunDir(run_dir).report.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{run_dir}: {e}") from None
    steps = read_jsonl(RunDir(run_dir).metrics)
    if not steps:
        raise CalibrationError(f"{run_dir}/metrics.jsonl has no step")
    r, pol = cfg["rollout"], cfg["policy"]
    perf = fit_decode(rep.get("decode_tokens_per_s_by_batch") or {}, r["max_batch"])
    tokens = sum(m["tokens"] for m in steps)
    train_s_per_token = sum(m["train_s"] for m in steps) / max(1.0, tokens)
    n = r["prompts_per_step"] * r["group_size"]
    resp = statistics.median(m["response_len_mean"] for m in steps)
    prompt = max(1.0, statistics.fmean((m["tokens"] - n * m["response_len_mean"]) / n for m in steps))
    spread = 0.0 if resp >= 0.99 * r["max_new_tokens"] else 0.3  # responses that all run to the budget: no spread
    wl = Workload(prompts=r["prompts_per_step"], group=r["group_size"], max_response=r["max_new_tokens"],
                  min_response=1, response_median=max(1.0, resp), sigma_prompt=spread, sigma_response=spread,
                  prompt_median=prompt, micro_batch=cfg["trainer"]["micro_batch"], min_prompt=1)
    n_resv = float(rep.get("n_resv") or 1.0)
    if boot_s is None:
        boot_s = measured_boot_s(run_dir)
    prof = CalibratedProfile(
        ModelSpec("live", 1e6, 1, 64, 1, 1, 64), reserved_nodes=1, gpus_per_node=max(1, round(n_resv)),
        reserved_tp=1, instance_tp=1, switch_to_rollout_s=0.0, switch_to_train_s=0.0, optimizer_s=0.0,
        boot_s=boot_s, workload=wl, net=Network(publish_s=statistics.fmean(m.get("publish_s", 0.0) for m in steps)),
        perf=perf, train_s_per_token=train_s_per_token)
    system = SystemSpec("live", t_seed_initial_s=cfg["policy"]["t_seed_initial_s"], eta=pol["eta"],
                        floor_s=pol["t_seed_floor_s"], adapt=pol["adaptive_seeding"], memory=pol["t_seed_memory"],
                        use_cap=pol["cap"], dispatch=pol["dispatch"],
                        theta=cfg["manager"]["pending_limit"], balancer=pol["balance"],
                        balance_interval_s=pol["balance_every_s"], max_staleness=r.get("max_staleness", 0))
    sim = Simulation(prof, system, _availability(cfg, capacity), duration_s=1e9, max_steps=len(steps),
                     seed=cfg["trainer"].get("seed", 0), model_name="live")
    res = sim.run()
    return {"steps": [{"step": row["step"], "t_end_s": row["t_end"], "step_s": row["step_s"], "tokens": row["tokens"],
                       "cap_next": row["cap_next"], "t_seed_s": row["t_seed_s"], "n_remote": row["n_remote"],
                       "staleness_tokens": row["staleness_tokens"]}
                      for row in res.timeline],
            "profile": {"decode_a_s": perf.a, "decode_b_s": perf.b, "train_s_per_token": train_s_per_token,
                        "response_median": resp, "prompt_mean": prompt, "n_resv": n_resv, "boot_s": boot_s}}
