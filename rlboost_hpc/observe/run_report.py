"""The run's report (``RUN_DIR/report.json``): its schema and the one function that builds it.

Schema (:class:`RunReport`; every key below is always present except the multi-turn ones, written only when
``task.turns.max > 1``). Counts are integers, seconds floats, bytes integers:

- outcome: ``steps`` (step records written), ``resumes`` (times the run was resumed), ``resumed_from_step``
  (``null``: started fresh), held-out reward before/after training (``reward_heldout_*``: sampled; ``_greedy_``:
  greedy decoding), ``pass_at_k_heldout_before/after`` (each k of ``trainer.eval_pass_k``, as text → the unbiased
  pass@k over ``trainer.eval_samples`` samples per held-out prompt, a sample passing with a reward ≥
  ``trainer.eval_correct_at``; ``{}`` without an evaluation), ``reward_functions_heldout_before/after`` (a user's
  task: each reward component's mean over the held-out samples; a weight-0 function is a task metric),
  ``repetition_rate_before/after`` (repeated 3-grams), ``kl_to_reference_nats_per_token`` (KL to the initial
  policy per token, with the estimator and bounds of ``trainer.kl_estimator``),
  ``quality_gate_passed`` and ``quality_gate_failures`` (:func:`quality_gate`: KL below ``trainer.gate_max_kl`` and
  repeated 3-grams below ``trainer.gate_max_repetition``; one line per failure; ``null`` without a held-out
  evaluation: an emulated run), ``objective``
  (the GRPO options trained with: ``trainer.loss_aggregation``, ``advantage_std_norm``, ``clip_eps``,
  ``clip_eps_high``, ``kl_coef``, ``kl_estimator``, ``behaviour_correction``, ``behaviour_cap``,
  ``behaviour_level``, ``mask_truncated``), ``model_out`` (the exported model directory, or ``null``),
  ``model`` (path, architecture, parameters, chat template, devices), ``examples_after`` (held-out samples).
- exactly-once: ``responses_trained``, ``responses_left_out`` (of groups a reward component failed on: not trained,
  ``task.rewards.errors = skip``), ``responses_lost`` (expected − trained − left out), ``responses_duplicated``,
  ``prompts_not_trained_exactly_once``, ``tokens_trained``, ``tokens_trained_off_version`` (must be 0),
  ``tokens_masked_too_stale`` (bounded staleness: tokens older than k versions, loss-masked; must be 0),
  ``off_version_tokens_rejected``, ``late_tokens_dropped``; ``max_staleness`` (k; 0 = strict on-policy) and
  ``tokens_by_staleness`` (generated tokens trained, by how many versions older than the trained one made them).
- truncation (of the responses trained): ``responses_truncated``, ``truncated_share`` (÷ responses trained),
  ``responses_truncated_by_cause`` (``length``, ``turn_cap``, ``trajectory_budget``, ``environment_error``: every
  cause, 0 included).
- engine–trainer mismatch (``engine_trainer_mismatch``, over the steps): ``logprob_diff`` (mean of the steps' mean
  |trainer − engine logprob| per token, nats), ``logprob_diff_max`` (the largest of any token), ``mismatch_kl`` (mean
  k3 KL(engine ‖ trainer) per token), ``mismatch_outside_clip_share`` and ``mismatch_capped_share`` (means of the
  steps' shares), ``behaviour_ess`` (mean of the steps' effective sample size of the importance weights, ÷ units)
  and ``behaviour_dropped_share`` (mean; ``_max``: the largest) of the units MIS dropped; ``{}`` when the backend
  reported none. ``steps_over_dropped_warn``: steps whose dropped share passed ``trainer.behaviour_dropped_warn``.
- faults and migration (summed over every incarnation of a resumed run): ``preemptions`` (=
  ``preemptions_with_warning`` + ``kills_without_warning``), ``worker_starts``, ``responses_migrated``,
  ``tokens_migrated``, ``tokens_from_preemptible`` (tokens preemptible instances — harvested capacity — streamed
  to the manager), ``tokens_regenerated`` (and ``_after_warning``), ``instances_suspected`` /
  ``_recovered`` / ``_lost_without_warning`` / ``_lost_while_pulling`` / ``_preempted_with_warning`` /
  ``_time_limit`` / ``_drained``, ``stalls``, ``link_resets``, ``slow_weight_loads``, ``deltas_out_of_order``,
  ``manager_restarts`` (manager processes the trainer restarted, each continuing the step from its work log),
  ``responses_adopted`` (unfinished responses a restarted manager's instances continued, their tokens kept),
  ``tokens_discarded_stale`` (restored tokens of a version the resumed trainer's checkpoint did not have),
  ``balancer_moves``, ``migrations_by_engine`` (``out_of`` / ``into`` → engine → count),
  ``migrated_responses_trained``, ``protocol_rejects``.
- weights: ``weight_pulls`` (verified loads), ``weight_pull_failures``, ``weight_pull_seconds_mean``
  (every verified pull: pull + verify + load), ``weight_full_pull_seconds_mean`` (of them, the pulls that moved the
  whole version: no delta),
  ``weight_bytes`` (one full version), ``weight_update_bytes_mean`` (bytes a version update takes, deltas
  counted as sent), ``weight_pulled_bytes`` (received by instances), ``weight_trainer_bytes_served`` (sent by the
  trainer; the rest came from relay peers), ``weight_trainer_sealed_bytes_served`` (of it, sent as sealed chunks
  instead of over CURVE), ``weight_checksum_mismatches`` (must be 0), ``weight_shards`` (per
  serving rank: bytes served; gathered exports).
- capacity and speed: ``n_resv`` / ``n_resv_source``, ``rollout_engine``, ``decode_tokens_per_s_by_batch``,
  ``rewards_timed_out``, ``reward_workers_replaced``, ``throughput_tokens_per_s`` (tokens trained per second of
  training wall time), ``train_wall_s``, ``wall_s``, ``trace_window_start_s`` (the replayed spot trace's window, or
  ``null``), and the step timeline's summary: ``step_phase_s_mean``, ``fixed_overhead_s_per_step``,
  ``fixed_overhead_s_by_phase``, ``fixed_overhead_share``.
- chaos runs (``cluster.faults.every_steps``, the local cluster, this incarnation): ``faults_scheduled`` (kind →
  faults injected by progress: preempt, kill, stall, link_reset, slow_load — a slow load counted once taken).
- emulated instances only (``rollout.engine = "emulated"``, this incarnation): ``emulated_modelled_s`` (wall seconds
  their profile asked for), ``emulated_late_s`` (seconds they ran behind it), ``emulated_late_ratio`` ((modelled +
  late) ÷ modelled: 1 on time, 3.2 for a host 3.2× slower than the profile) and ``emulated_represents_profile``
  (false when the ratio passed 1.2: the run's timings are the host's, not the profile's).
- LoRA (``lora``; ``null`` when every weight trains): ``rank``, ``alpha``, ``targets``, ``adapter_bytes`` (one
  version), ``base_checksum`` (hex), ``base_bytes``, ``base_loads`` (instances' base loads by source: ``path``,
  ``cache``, ``pulled``, ``trainer``), ``base_pulled_bytes``, ``adapter_out`` / ``merged_out`` (the exports).
- multi-turn only: ``turns_per_trajectory_mean``, ``environment_calls`` / ``_errors`` / ``_timeouts`` /
  ``_seconds`` / ``_replays`` (stateful environments rebuilt by replay), ``tool_time_share`` (tool seconds ÷ training wall time), ``observation_tokens``,
  ``migrations_by_turn``, ``tokens_in_interrupted_turns``, ``assistant_tokens_in_interrupted_trajectories``.

A run that fails writes :class:`FailedReport` instead (``failed``, ``error``, ``steps``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from rlboost_hpc import defaults as D

from rlboost_hpc.observe.timeline import summarize
from rlboost_hpc.protocol.stats import ManagerStats


class FaultTally(msgspec.Struct, kw_only=True):
    """Fault and migration counts of one incarnation of a run (or, added up, of all of them; a checkpoint keeps
    the sum of the incarnations before it). The first five come from the local cluster that caused them or, under
    Slurm, from what the manager saw; the rest from the manager."""

    preemptions_warned: int = 0
    kills: int = 0
    starts: int = 0
    stalls: int = 0
    link_resets: int = 0
    instances_lost_while_pulling: int = 0
    responses_migrated: int = 0
    tokens_migrated: int = 0
    tokens_regenerated: int = 0
    instances_suspected: int = 0
    instances_recovered: int = 0
    slow_weight_loads: int = 0
    deltas_out_of_order: int = 0
    manager_restarts: int = 0
    responses_adopted: int = 0
    tokens_discarded_stale: int = 0
    tokens_received_preemptible: int = 0

    @classmethod
    def observe(cls, stats: ManagerStats, cluster: dict[str, int] | None) -> "FaultTally":
        """This incarnation's tally: ``cluster`` is the local cluster's summary (``preemptions_warned``,
        ``kills``, ``starts``, ``stalls``, ``link_resets``); ``None`` under Slurm, where the manager's view counts
        (warned preemptions, losses without warning, registrations other than the reserved engine's)."""
        if cluster is not None:
            own = {k: int(cluster[k]) for k in ("preemptions_warned", "kills", "starts", "stalls", "link_resets")}
        else:
            own = {"preemptions_warned": stats.instances_preempted_with_warning, "kills": stats.instances_lost,
                   "starts": max(0, stats.registrations - 1), "stalls": 0, "link_resets": 0}
        manager = {f: getattr(stats, f) for f in cls.__struct_fields__ if f not in own}
        return cls(**own, **manager)

    def __add__(self, other: "FaultTally") -> "FaultTally":
        return FaultTally(**{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__})

    def to_json(self) -> dict[str, int]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, int]) -> "FaultTally":
        """A tally saved by :meth:`to_json` (missing fields: 0)."""
        return cls(**{f: int(d.get(f, 0)) for f in cls.__struct_fields__})


class RunReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``report.json`` of a finished run; the keys are documented in the module docstring. The multi-turn keys
    default to ``None`` and are then omitted."""

    steps: int
    resumes: int
    resumed_from_step: int | None
    reward_heldout_before: float
    reward_heldout_after: float
    reward_heldout_greedy_before: float
    reward_heldout_greedy_after: float
    pass_at_k_heldout_before: dict[str, float]
    pass_at_k_heldout_after: dict[str, float]
    reward_functions_heldout_before: dict[str, float]
    reward_functions_heldout_after: dict[str, float]
    repetition_rate_before: float
    repetition_rate_after: float
    kl_to_reference_nats_per_token: float
    quality_gate_passed: bool | None
    quality_gate_failures: list[str]
    objective: dict[str, Any]
    model_out: str | None
    model: dict[str, Any]
    responses_trained: int
    responses_left_out: int
    responses_lost: int
    responses_duplicated: int
    preemptions: int
    preemptions_with_warning: int
    kills_without_warning: int
    worker_starts: int
    responses_migrated: int
    balancer_moves: int
    rollout_engine: str
    migrations_by_engine: dict[str, dict[str, int]]
    migrated_responses_trained: int
    tokens_migrated: int
    tokens_from_preemptible: int
    tokens_regenerated: int
    tokens_regenerated_after_warning: int
    tokens_trained_off_version: int
    tokens_masked_too_stale: int
    max_staleness: int
    tokens_by_staleness: dict[str, int]
    steps_over_dropped_warn: int
    responses_truncated: int
    truncated_share: float
    responses_truncated_by_cause: dict[str, int]
    engine_trainer_mismatch: dict[str, float]
    off_version_tokens_rejected: int
    late_tokens_dropped: int
    weight_pulls: int
    weight_pull_failures: int
    weight_pull_seconds_mean: float
    weight_full_pull_seconds_mean: float
    weight_bytes: int
    weight_update_bytes_mean: float
    weight_pulled_bytes: int
    weight_checksum_mismatches: int
    weight_trainer_bytes_served: int
    weight_trainer_sealed_bytes_served: int
    weight_shards: list[dict[str, Any]]
    instances_lost_without_warning: int
    instances_suspected: int
    instances_recovered: int
    stalls: int
    link_resets: int
    slow_weight_loads: int
    deltas_out_of_order: int
    manager_restarts: int
    responses_adopted: int
    tokens_discarded_stale: int
    instances_lost_while_pulling: int
    prompts_not_trained_exactly_once: int
    instances_preempted_with_warning: int
    instances_time_limit: int
    rewards_timed_out: int
    reward_workers_replaced: int
    n_resv: float
    n_resv_source: str
    decode_tokens_per_s_by_batch: dict[str, float]
    instances_drained: int
    protocol_rejects: int
    faults_scheduled: dict[str, int] | None = None
    emulated_modelled_s: float | None = None
    emulated_late_s: float | None = None
    emulated_late_ratio: float | None = None
    emulated_represents_profile: bool | None = None
    turns_per_trajectory_mean: float | None = None
    environment_calls: int | None = None
    environment_errors: int | None = None
    environment_timeouts: int | None = None
    environment_seconds: float | None = None
    environment_replays: int | None = None
    tool_time_share: float | None = None
    observation_tokens: int | None = None
    migrations_by_turn: dict[str, int] | None = None
    tokens_in_interrupted_turns: int | None = None
    assistant_tokens_in_interrupted_trajectories: int | None = None
    tokens_trained: int
    throughput_tokens_per_s: float
    train_wall_s: float
    step_phase_s_mean: dict[str, float]
    fixed_overhead_s_by_phase: dict[str, float]
    fixed_overhead_s_per_step: float
    fixed_overhead_share: float
    wall_s: float
    trace_window_start_s: float | None
    examples_after: list[Any]
    #: a user's task: each reward function (and reward model) → calls, failed, timed_out, mean (over the run)
    reward_functions: dict[str, dict[str, Any]] | None = None
    lora: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it (plain JSON types, multi-turn keys only when set)."""
        return msgspec.to_builtins(self)


class FailedReport(msgspec.Struct, kw_only=True):
    """``report.json`` of a run that failed: the error (``Type: message``) and the step records written."""

    failed: bool = True
    error: str
    steps: int


def write_report(path: Path, report: RunReport | FailedReport) -> None:
    """Write ``report`` as indented JSON to ``path``."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))


def truncation_summary(by_cause: dict[str, int], trained: int) -> dict[str, Any]:
    """The report's truncation keys from the trained responses' counts by cause."""
    from rlboost_hpc.protocol.messages import TRUNCATION_CAUSES

    n = sum(by_cause.values())
    return {"responses_truncated": n, "truncated_share": n / trained if trained else 0.0,
            "responses_truncated_by_cause": {c: int(by_cause.get(c, 0)) for c in TRUNCATION_CAUSES}}


#: A run whose emulated instances (``rollout.engine = "emulated"``, timed by the simulator's profiles) took more than
#: this times the profile's time (20 % late) does not represent the profile it emulates — the host was too slow: its
#: report and benchmark rows say so.
LATE_RATIO_BOUND = 1.2


def late_ratio(modelled_wall_s: float, late_s: float) -> float:
    """Wall time an emulated engine took ÷ what its profile asked for: (``modelled_wall_s`` + ``late_s``) ÷
    ``modelled_wall_s`` (seconds); 1.0 when nothing was modelled yet."""
    return (modelled_wall_s + late_s) / modelled_wall_s if modelled_wall_s > 0 else 1.0


def late_label(ratio: float | None) -> str:
    """A benchmark table's cell for a run's ``emulated_late_ratio`` (report.json): ``"1.04"``, or ``"3.20 (not the
    profile)"`` past :data:`LATE_RATIO_BOUND`; ``"-"`` for a run without emulated instances (``None``)."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" + (" (not the profile)" if ratio > LATE_RATIO_BOUND else "")


def emulated_lateness(stats: ManagerStats) -> dict[str, Any]:
    """The report's ``emulated_*`` keys from the manager's counters (``{}`` when no emulated engine ran)."""
    modelled, late = stats.emulated_modelled_seconds, stats.emulated_late_seconds
    if modelled <= 0:
        return {}
    ratio = late_ratio(modelled, late)
    return {"emulated_modelled_s": modelled, "emulated_late_s": late, "emulated_late_ratio": ratio,
            "emulated_represents_profile": ratio <= LATE_RATIO_BOUND}


def mismatch_summary(steps: list[dict]) -> dict[str, float]:
    """``engine_trainer_mismatch`` over the step records that carry it: means, and the largest ``logprob_diff_max``."""
    rows = [m for m in steps if "logprob_diff" in m]
    if not rows:
        return {}
    out = {k: sum(m.get(k, 0.0) for m in rows) / len(rows)
           for k in ("logprob_diff", "mismatch_kl", "mismatch_outside_clip_share", "mismatch_capped_share",
                     "behaviour_weight_mean")}
    out["logprob_diff_max"] = max(m.get("logprob_diff_max", 0.0) for m in rows)
    out["behaviour_ratio_max"] = max(m.get("behaviour_ratio_max", 1.0) for m in rows)
    for k in ("behaviour_ess", "behaviour_dropped_share"):  # the correction's effective sample size, MIS's losses
        vals = [m[k] for m in rows if k in m]
        if vals:
            out[k] = sum(vals) / len(vals)
    if any("behaviour_dropped_share" in m for m in rows):
        out["behaviour_dropped_share_max"] = max(m.get("behaviour_dropped_share", 0.0) for m in rows)
    for k in sorted({k for m in rows for k in m if k.startswith("logprob_diff_staleness")}):  # per staleness
        vals = [m[k] for m in rows if k in m]
        out[k] = sum(vals) / len(vals)
    return out


def quality_gate(kl: float, repetition: float, max_kl: float, max_repetition: float) -> list[str]:
    """The quality gate of a finished run: what it failed, one line each (``[]``: passed). The final policy's KL to
    the reference (nats/token) must be below ``max_kl`` and its held-out samples' share of repeated 3-grams below
    ``max_repetition``; a NaN fails. A reward-hacked, collapsed policy (too high a learning rate, or data too
    stale for its correction) fails it while its reward still looks perfect."""
    out = []
    if not kl < max_kl:
        out.append(f"KL to the reference {kl:.3f} nats/token >= trainer.gate_max_kl = {max_kl:g}")
    if not repetition < max_repetition:
        out.append(f"repeated 3-grams {repetition:.3f} >= trainer.gate_max_repetition = {max_repetition:g}")
    return out


def _multi_turn_summary(steps: list[dict], stats: ManagerStats, train_wall_s: float) -> dict[str, Any]:
    """The multi-turn keys of the report (``task.turns.max > 1``)."""
    turns = [m["turns_mean"] for m in steps if "turns_mean" in m]
    return dict(
        turns_per_trajectory_mean=sum(turns) / len(turns) if turns else 0.0,
        environment_calls=stats.environment_calls, environment_errors=stats.environment_errors,
        environment_timeouts=stats.environment_timeouts, environment_seconds=stats.environment_seconds,
        environment_replays=stats.environment_replays,
        tool_time_share=stats.environment_seconds / train_wall_s if train_wall_s > 0 else 0.0,
        observation_tokens=stats.observation_tokens, migrations_by_turn=stats.migrations_by_turn,
        tokens_in_interrupted_turns=stats.tokens_in_interrupted_turns,
        assistant_tokens_in_interrupted_trajectories=stats.assistant_tokens_in_interrupted_trajectories)


def build_report(*, steps: list[dict], stats: ManagerStats, tally: FaultTally, totals: Any,
                 before: dict, after: dict, kl: float, objective: dict[str, Any], model: dict[str, Any],
                 model_out: str | None,
                 publishes: list[dict], served: dict, rewards_timed_out: int, reward_workers_replaced: int,
                 n_resv: float, n_resv_source: str, rollout_engine: str, prompts_not_trained_once: int,
                 multi_turn: bool, resumes: int, resumed_from_step: int | None, train_wall_s: float, wall_s: float,
                 trace_window_start_s: float | None, max_staleness: int = 0,
                 faults_scheduled: dict[str, int] | None = None,
                 gate: tuple[float, float] = (D.GATE_MAX_KL_NATS_PER_TOKEN, D.GATE_MAX_REPETITION),
                 lora: dict[str, Any] | None = None) -> RunReport:
    """The report of a finished run.

    Args:
        steps: every step record of the run (``metrics.jsonl``'s lines, all incarnations).
        stats: the manager's statistics at the end of training. ``tally``: faults of all incarnations.
        totals: the trainer's running totals (``responses_trained``, ``responses_expected``,
            ``responses_duplicated``, ``tokens_trained``, ``tokens_trained_off_version``,
            ``migrated_responses_trained``, ``responses_truncated_by_cause``).
        before, after: held-out evaluations (``reward_sampled``, ``reward_greedy``, ``repetition_rate``;
            ``after`` also ``examples``). ``kl``: nats per token to the reference policy. ``objective``: the GRPO
            options (``trainer.*``).
        publishes: the weight publisher's record per version (``weight_bytes``, ``weight_update_bytes``).
        served: what the trainer's weight servers sent (``bytes_served``, ``delta_bytes_served``,
            ``sealed_bytes_served``, ``shards``).
        train_wall_s: training seconds of all incarnations; ``wall_s``: this incarnation's seconds.
        gate: the quality gate's bounds (KL nats/token, repeated 3-gram share): :func:`quality_gate`.
        lora: a LoRA run's adapter and base (``rank``, ``alpha``, ``targets``, ``base_*``, ``*_out``) or None.
    """
    multi = _multi_turn_summary(steps, stats, train_wall_s) if multi_turn else {}
    evaluated = after.get("responses", 1) > 0  # an emulated run has no policy to judge
    failed = quality_gate(kl, after["repetition_rate"], *gate) if evaluated else []
    return RunReport(
        steps=len(steps), resumes=resumes, resumed_from_step=resumed_from_step,
        reward_heldout_before=before["reward_sampled"], reward_heldout_after=after["reward_sampled"],
        reward_heldout_greedy_before=before["reward_greedy"], reward_heldout_greedy_after=after["reward_greedy"],
        pass_at_k_heldout_before=before.get("pass_at_k", {}), pass_at_k_heldout_after=after.get("pass_at_k", {}),
        reward_functions_heldout_before=before.get("reward_functions", {}),
        reward_functions_heldout_after=after.get("reward_functions", {}),
        repetition_rate_before=before["repetition_rate"], repetition_rate_after=after["repetition_rate"],
        kl_to_reference_nats_per_token=kl, quality_gate_passed=not failed if evaluated else None,
        quality_gate_failures=failed, objective=objective, model_out=model_out, model=model,
        responses_trained=totals.responses_trained,
        responses_left_out=totals.responses_left_out,
        responses_lost=totals.responses_expected - totals.responses_trained - totals.responses_left_out,
        responses_duplicated=totals.responses_duplicated,
        preemptions=tally.preemptions_warned + tally.kills, preemptions_with_warning=tally.preemptions_warned,
        kills_without_warning=tally.kills, worker_starts=tally.starts, responses_migrated=tally.responses_migrated,
        balancer_moves=stats.balancer_moves, rollout_engine=rollout_engine,
        migrations_by_engine=stats.migrations_by_engine,
        migrated_responses_trained=totals.migrated_responses_trained,
        tokens_migrated=tally.tokens_migrated, tokens_from_preemptible=tally.tokens_received_preemptible,
        tokens_regenerated=tally.tokens_regenerated,
        tokens_regenerated_after_warning=stats.tokens_regenerated_after_warning,
        tokens_trained_off_version=totals.tokens_trained_off_version,
        tokens_masked_too_stale=totals.tokens_masked_too_stale, max_staleness=max_staleness,
        tokens_by_staleness=dict(totals.tokens_by_staleness), steps_over_dropped_warn=totals.steps_over_dropped_warn,
        **truncation_summary(totals.responses_truncated_by_cause, totals.responses_trained),
        engine_trainer_mismatch=mismatch_summary(steps),
        off_version_tokens_rejected=stats.off_version_tokens_rejected, late_tokens_dropped=stats.late_tokens,
        **_weights_summary(stats, publishes, served),
        instances_lost_without_warning=stats.instances_lost, instances_suspected=tally.instances_suspected,
        **{f: getattr(tally, f) for f in ("instances_recovered", "stalls", "link_resets", "slow_weight_loads",
                                          "deltas_out_of_order", "manager_restarts", "responses_adopted",
                                          "tokens_discarded_stale", "instances_lost_while_pulling")},
        prompts_not_trained_exactly_once=prompts_not_trained_once,
        instances_preempted_with_warning=stats.instances_preempted_with_warning,
        instances_time_limit=stats.instances_time_limit,
        rewards_timed_out=rewards_timed_out, reward_workers_replaced=reward_workers_replaced,
        n_resv=n_resv, n_resv_source=n_resv_source,
        decode_tokens_per_s_by_batch=stats.decode_tokens_per_s_by_batch,
        instances_drained=stats.instances_drained, protocol_rejects=stats.protocol_rejects,
        **multi, **emulated_lateness(stats),
        tokens_trained=totals.tokens_trained,
        throughput_tokens_per_s=totals.tokens_trained / train_wall_s if train_wall_s > 0 else 0.0,
        train_wall_s=train_wall_s, **summarize(steps), wall_s=wall_s,
        trace_window_start_s=trace_window_start_s, examples_after=after["examples"],
        faults_scheduled=faults_scheduled or None, lora=lora and _lora_summary(lora, publishes, stats))


def _weights_summary(stats: ManagerStats, publishes: list[dict], served: dict) -> dict[str, Any]:
    """The report's ``weight_*`` entries: the instances' pulls (the manager's count), one version's bytes and the mean
    update's (the publisher's record), what the trainer's weight servers sent."""
    updates = [p["weight_update_bytes"] for p in publishes[1:]]
    return dict(
        weight_pulls=stats.weight_loads, weight_pull_failures=stats.weight_load_failures,
        weight_pull_seconds_mean=stats.pull_seconds_mean,
        weight_full_pull_seconds_mean=stats.full_pull_seconds_mean,
        weight_bytes=publishes[-1]["weight_bytes"] if publishes else 0,
        weight_update_bytes_mean=sum(updates) / len(updates) if updates else 0.0,
        weight_pulled_bytes=stats.weight_pulled_bytes, weight_checksum_mismatches=stats.weight_checksum_mismatches,
        weight_trainer_bytes_served=served["bytes_served"] + served["delta_bytes_served"],
        weight_trainer_sealed_bytes_served=served.get("sealed_bytes_served", 0),
        weight_shards=served["shards"])


def _lora_summary(lora: dict[str, Any], publishes: list[dict], stats: ManagerStats) -> dict[str, Any]:
    """The report's ``lora`` entry: the run's adapter and base, one version's bytes, the instances' base loads."""
    return {**lora, "adapter_bytes": publishes[-1]["weight_bytes"] if publishes else 0,
            "base_loads": {"path": stats.base_loads_from_path, "cache": stats.base_loads_from_cache,
                           "pulled": stats.base_loads_pulled, "trainer": stats.base_loads_in_trainer},
            "base_pulled_bytes": stats.base_pulled_bytes}
