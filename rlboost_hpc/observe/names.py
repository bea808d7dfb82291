"""The naming scheme of a run's figures in experiment trackers (TensorBoard, MLflow, Weights & Biases), and its one
link to the Prometheus names: the one owner of what a figure is called outside ``metrics.jsonl``.

Scheme: ``<section>/<figure>`` in lower case, base units in the figure's name as Prometheus has them (``_seconds``,
``_bytes``, ``_tokens``, ``_dollars``, ``_nats``), ``_total`` on running counts (counters), the value of one step
otherwise. Sections: ``reward/`` (``reward/mean``), ``kl`` and ``loss`` (top level), ``train/`` (the optimizer's
figures), ``mismatch/`` (engine–trainer logprob mismatch), ``staleness/``, ``truncation/``, ``step/`` (a step's
size, time and speed), ``phase/`` (the step's phase seconds), ``policy/`` (T_seed and N_prem), ``preemption/`` (the
fleet and the run's preemptions, migrations and regenerated tokens), ``instances/`` (instance-seconds by activity),
``weights/``, ``manager/``, ``environment/``, ``scavenger/`` (the scavenger daemon's jobs and harvest) and
``cost/`` (its dollars). Where Prometheus exports the same figure (:data:`PROMETHEUS`), the tracker name maps to
that series (name and labels); the tests check every such series is one the collectors export, so the two schemes
cannot drift apart.

Keys of ``metrics.jsonl`` that are no figure (:data:`NOT_FIGURES`: the step index, the Unix time, the seeding
manager's word, the weights' checksum, per-rank lists) are not sent; a numeric key this table does not know (a new
backend's figure) is sent as ``train/<key>`` — nothing numeric is dropped. A user task's reward functions
(``reward_functions``: each function's mean over the step) are ``reward/<function>``. Names hold only the characters every tracker accepts (letters,
digits, ``_ - . /``); no name is a ``/``-prefix of another (MLflow's file store keeps a metric as a file, a section
as a directory).
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

from rlboost_hpc.observe.timeline import Phase

__all__ = ["step_figures", "scavenger_figures", "summary_figures", "flat_params", "prometheus_series",
           "NOT_FIGURES", "PROMETHEUS", "STEP_NAMES", "SCAVENGER_NAMES"]

#: ``metrics.jsonl`` keys that are not figures (identifiers, text, lists): never sent as metrics (a step's
#: ``samples`` rows go to the trackers' tables).
NOT_FIGURES = frozenset({"step", "ts", "seeding_close", "weight_checksum", "per_rank", "samples"})

#: ``metrics.jsonl`` scalar key → tracker name.
STEP_NAMES: dict[str, str] = {
    "reward_mean": "reward/mean",
    "kl": "kl",
    "loss": "loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "clip_frac": "train/clip_frac",
    "ratio_max": "train/ratio_max",
    "behaviour_weight_mean": "train/behaviour_weight_mean",
    "behaviour_ratio_max": "train/behaviour_ratio_max",
    "behaviour_ess": "train/behaviour_effective_sample_size",
    "behaviour_dropped_share": "train/behaviour_dropped_ratio",
    "changed_share": "train/changed_share",
    "logprob_diff": "mismatch/logprob_diff_nats",
    "logprob_diff_max": "mismatch/logprob_diff_max_nats",
    "mismatch_kl": "mismatch/kl_nats",
    "mismatch_outside_clip_share": "mismatch/outside_clip_ratio",
    "mismatch_capped_share": "mismatch/capped_ratio",
    "version": "weights/version",
    "publish_s": "weights/publish_seconds",
    "export_s": "weights/export_seconds",
    "weight_bytes": "weights/version_bytes",
    "weight_update_bytes": "weights/update_bytes",
    "wall_s": "step/wall_seconds",
    "train_s": "step/train_seconds",
    "responses": "step/responses",
    "responses_left_out": "step/responses_left_out",
    "tokens": "step/tokens",
    "throughput_tokens_per_s": "step/throughput_tokens_per_second",
    "response_len_mean": "step/response_length_mean_tokens",
    "turns_mean": "step/turns_mean",
    "response_tail_s": "step/response_tail_seconds",
    "t_s": "step/run_elapsed_seconds",
    "environment_s": "environment/seconds",
    "fixed_overhead_s": "phase/fixed_overhead_seconds",
    "truncated_share": "truncation/share",
    "t_seed_s": "policy/t_seed_seconds",
    "t_seed_next_s": "policy/t_seed_next_seconds",
    "n_prem_cap": "policy/n_prem_cap",
    "n_prem_wanted": "policy/n_prem_wanted",
    "n_prem_target": "policy/n_prem_target",
    "t_wait_train_s": "policy/t_wait_train_seconds",
    "fallback_s": "policy/fallback_seconds",
    "t_remote_s": "policy/t_remote_seconds",
    "t_wait_remote_s": "policy/t_wait_remote_seconds",
    "n_remote": "policy/n_remote",
    "n_available": "policy/n_available",
    "responses_migrated": "preemption/responses_migrated",
    "preemptible_instances_served": "preemption/instances_served",
    "live_preemptible": "preemption/live_instances",
    "routable_preemptible": "preemption/routable_instances",
    "cluster_live": "preemption/cluster_live_workers",
}

#: ``metrics.jsonl`` dict key → tracker name of each entry (``{}``: the entry's key, units normalised).
STEP_FAMILIES: dict[str, str] = {
    "phase_s": "phase/{}_seconds",
    "fixed_overhead_s_by_phase": "phase/fixed_overhead/{}_seconds",
    "instance_s": "instances/{}_seconds",
    "truncated_share_by_cause": "truncation/{}_share",
    "staleness_tokens": "staleness/tokens_{}_versions_old",
    "version_serving": "weights/serving/{}",
    "reward_functions": "reward/{}",
}

#: ``faults`` of a step (the run's cumulative fault tally, every incarnation) → tracker name; a field not listed
#: is ``preemption/<field>_total``.
FAULT_NAMES: dict[str, str] = {
    "preemptions_warned": "preemption/warned_total",
    "kills": "preemption/kills_total",
    "starts": "preemption/worker_starts_total",
    "instances_lost_while_pulling": "preemption/lost_while_pulling_total",
    "slow_weight_loads": "weights/slow_loads_total",
    "deltas_out_of_order": "weights/deltas_out_of_order_total",
    "manager_restarts": "manager/restarts_total",
    "responses_adopted": "manager/responses_adopted_total",
    "tokens_discarded_stale": "manager/tokens_discarded_stale_total",
    "tokens_received_preemptible": "preemption/tokens_from_preemptible_total",
}
#: The run's preemptions so far (warned + killed without warning: the report's ``preemptions``).
PREEMPTIONS_TOTAL = "preemption/preemptions_total"

#: The scavenger's figures (the snapshot its Prometheus collector serves, and ``rlboost-hpc stats``' numbers) →
#: tracker name.
SCAVENGER_NAMES: dict[str, str] = {
    "target": "scavenger/target_jobs",
    "desired": "scavenger/desired_jobs",
    "run_active": "scavenger/run_active",
    "pending": "scavenger/jobs/pending",
    "running": "scavenger/jobs/running",
    "held": "scavenger/jobs_held",
    "leaving": "scavenger/jobs_leaving",
    "idle_slots": "scavenger/idle_slots",
    "ok": "scavenger/up",
    "submitted": "scavenger/submitted_total",
    "cancelled": "scavenger/cancelled_total",
    "signalled": "scavenger/signalled_total",
    "command_failures": "scavenger/command_failures_total",
    "reconciliations": "scavenger/reconciliations_total",
    "preemptions": "scavenger/preemptions_total",
    "requeues": "scavenger/requeues_total",
    "attempts": "scavenger/attempts_total",
    "harvested_gpu_seconds": "scavenger/harvested_gpu_seconds_total",
    "tokens_produced": "scavenger/tokens_produced_total",
    "harvest_cost_dollars": "cost/harvest_dollars_total",
    "cost_per_token_dollars": "cost/per_token_dollars",
    "saving_vs_on_demand_dollars": "cost/saving_vs_on_demand_dollars_total",
    # ``rlboost-hpc stats`` (scavenger/stats.py RunStats) beyond the Prometheus snapshot
    "time_limits": "scavenger/time_limits_total",
    "drains": "scavenger/drains_total",
    "warned": "scavenger/warned_total",
    "open_attempts": "scavenger/open_attempts",
    "lifetime_mean_s": "scavenger/attempt_lifetime_mean_seconds",
    "lifetime_median_s": "scavenger/attempt_lifetime_median_seconds",
    "tokens_handed_off": "scavenger/tokens_handed_off_total",
    "tokens_regenerated": "scavenger/tokens_regenerated_total",
}

#: Tracker name → the Prometheus series that exports the same figure: (metric name, labels). A tracker holds the
#: step's value where Prometheus holds a running sum (``rlboost_step_phase_seconds_total``) or a histogram
#: (``rlboost_step_duration_seconds``): same figure, same name, one sample per step.
PROMETHEUS: dict[str, tuple[str, dict[str, str]]] = {
    "weights/version": ("rlboost_latest_weight_version", {}),
    "step/wall_seconds": ("rlboost_step_duration_seconds", {}),
    "phase/fixed_overhead_seconds": ("rlboost_step_fixed_overhead_seconds_total", {}),
    "environment/seconds": ("rlboost_environment_seconds_total", {}),
    "policy/t_seed_next_seconds": ("rlboost_t_seed_seconds", {}),
    "policy/n_prem_cap": ("rlboost_n_prem_cap", {}),
    "mismatch/logprob_diff_nats": ("rlboost_step_logprob_diff_nats", {}),
    "mismatch/logprob_diff_max_nats": ("rlboost_step_logprob_diff_max_nats", {}),
    "mismatch/kl_nats": ("rlboost_step_mismatch_kl_nats", {}),
    "mismatch/outside_clip_ratio": ("rlboost_step_mismatch_outside_clip_ratio", {}),
    "mismatch/capped_ratio": ("rlboost_step_mismatch_capped_ratio", {}),
    "preemption/responses_migrated_total": ("rlboost_responses_migrated_total", {}),
    "preemption/tokens_migrated_total": ("rlboost_tokens_migrated_total", {}),
    "preemption/tokens_regenerated_total": ("rlboost_tokens_regenerated_total", {}),
    "preemption/instances_suspected_total": ("rlboost_instances_suspected_total", {}),
    "preemption/instances_recovered_total": ("rlboost_instances_recovered_total", {}),
    "preemption/tokens_from_preemptible_total": ("rlboost_tokens_received_preemptible_total", {}),
    **{f"phase/{p.value}_seconds": ("rlboost_step_phase_seconds_total", {"phase": p.value}) for p in Phase},
    **{f"instances/{a}_seconds": ("rlboost_rollout_instance_seconds_total", {"activity": a})
       for a in ("busy", "idle", "pulling")},
    "policy/n_prem_target": ("rlboost_scavenger_target_jobs", {}),
    "scavenger/target_jobs": ("rlboost_scavenger_target_jobs", {}),
    "scavenger/desired_jobs": ("rlboost_scavenger_desired_jobs", {}),
    "scavenger/run_active": ("rlboost_scavenger_run_active", {}),
    "scavenger/jobs/pending": ("rlboost_scavenger_jobs", {"state": "pending"}),
    "scavenger/jobs/running": ("rlboost_scavenger_jobs", {"state": "running"}),
    "scavenger/jobs_held": ("rlboost_scavenger_jobs_held", {}),
    "scavenger/jobs_leaving": ("rlboost_scavenger_jobs_leaving", {}),
    "scavenger/idle_slots": ("rlboost_scavenger_idle_slots", {}),
    "scavenger/up": ("rlboost_scavenger_up", {}),
    **{SCAVENGER_NAMES[k]: (f"rlboost_scavenger_{k}_total", {}) for k in (
        "submitted", "cancelled", "signalled", "command_failures", "reconciliations", "preemptions", "requeues",
        "attempts", "harvested_gpu_seconds", "tokens_produced")},
    "cost/harvest_dollars_total": ("rlboost_scavenger_harvest_cost_dollars_total", {}),
    "cost/per_token_dollars": ("rlboost_scavenger_cost_per_token_dollars", {}),
    "cost/saving_vs_on_demand_dollars_total": ("rlboost_scavenger_saving_vs_on_demand_dollars_total", {}),
}

_BAD = re.compile(r"[^A-Za-z0-9_\-./]")


def _part(key: Any) -> str:
    """One path part of a name: a dict key with its unit spelled out (``_s`` → ``_seconds``) and any character a
    tracker refuses replaced by ``_`` (``reserved#0`` → ``reserved_0``)."""
    s = str(key)
    s = re.sub(r"_per_s$", "_per_second", s)
    s = re.sub(r"_s$", "_seconds", s)
    return _BAD.sub("_", s).strip("/") or "_"


def _number(v: Any) -> float | None:
    """``v`` as a float (bools as 0/1), or ``None`` for what is no number (None, text, lists, dicts)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _leaves(prefix: str, d: dict) -> Iterable[tuple[str, float]]:
    """(``prefix/key[/key…]``, number) of every numeric leaf of ``d``."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(f"{prefix}/{_part(k)}", v)
        elif (x := _number(v)) is not None:
            yield f"{prefix}/{_part(k)}", x


def step_figures(line: dict[str, Any]) -> dict[str, float]:
    """The tracker figures of one ``metrics.jsonl`` line (:meth:`~rlboost_hpc.trainer.record.StepRecord.line`):
    tracker name → value (floats; NaN kept, ``None`` and text left out). Nested figures (phase seconds, truncation
    by cause, instance-seconds by instance and activity, …) become one name per entry."""
    out: dict[str, float] = {}
    for key, v in line.items():
        if key in NOT_FIGURES:
            continue
        if key in STEP_NAMES:
            if (x := _number(v)) is not None:
                out[STEP_NAMES[key]] = x
        elif key in STEP_FAMILIES and isinstance(v, dict):
            for sub, sv in v.items():
                if (x := _number(sv)) is not None:
                    out[STEP_FAMILIES[key].format(_part(sub))] = x
        elif key == "rollout_by_kind" and isinstance(v, dict):
            for kind, figs in v.items():
                for fig, x in (figs or {}).items():
                    if (x := _number(x)) is not None:
                        out[f"rollout/{_part(kind)}/{_part(fig)}"] = x
        elif key == "instance_activity_s" and isinstance(v, dict):
            for inst, acts in v.items():
                for act, sec in (acts or {}).items():
                    if (x := _number(sec)) is not None:
                        out[f"instances/by_instance/{_part(inst)}/{_part(act)}_seconds"] = x
        elif key == "faults" and isinstance(v, dict):
            out.update(_faults(v))
        elif (m := re.fullmatch(r"logprob_diff_staleness(\d+)", key)) and (x := _number(v)) is not None:
            out[f"staleness/logprob_diff_{m.group(1)}_versions_old_nats"] = x
        elif isinstance(v, dict):
            out.update(_leaves(f"train/{_part(key)}", v))
        elif (x := _number(v)) is not None:
            out[f"train/{_part(key)}"] = x
    return out


def _faults(tally: dict[str, Any]) -> dict[str, float]:
    out = {FAULT_NAMES.get(k, f"preemption/{_part(k)}_total"): float(v) for k, v in tally.items()
           if _number(v) is not None}
    out[PREEMPTIONS_TOTAL] = float(tally.get("preemptions_warned", 0)) + float(tally.get("kills", 0))
    return out


def scavenger_figures(snapshot: dict[str, Any], stats: dict[str, Any] | None = None) -> dict[str, float]:
    """The tracker figures of the scavenger: ``snapshot`` is what its Prometheus collector serves
    (:meth:`scavenger.metrics.ScavengerMetrics.snapshot`), ``stats`` the run's statistics
    (``scavenger.stats.RunStats.summary()``) for what Prometheus does not show. A figure that does not exist yet
    (``None``: no target, no token) is left out, as Prometheus leaves out its sample."""
    out: dict[str, float] = {}
    for src in (stats or {}, snapshot):
        for k, v in src.items():
            if k in SCAVENGER_NAMES and (x := _number(v)) is not None:
                out[SCAVENGER_NAMES[k]] = x
    return out


def summary_figures(report: dict[str, Any]) -> dict[str, float]:
    """The numeric leaves of ``report.json`` as ``report/<key>[/<key>…]`` → value (text, lists and ``null`` left
    out: the whole report goes to the tracker as a file as well)."""
    return {k: x for k, x in _leaves("report", report) if not (isinstance(x, float) and math.isinf(x))}


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The run's configuration (``RunConfig.model_dump(mode="json")``) as ``section.key`` → text (what MLflow
    keeps as a run's parameters): lists and ``null`` as JSON, everything else as ``str``."""
    import json

    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


def prometheus_series(name: str) -> tuple[str, dict[str, str]] | None:
    """The Prometheus series (metric name, labels) that exports the figure a tracker holds as ``name``, or
    ``None`` when Prometheus has no such figure."""
    return PROMETHEUS.get(name)
