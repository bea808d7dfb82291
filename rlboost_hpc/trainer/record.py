"""One RL step's record: the typed form of a ``metrics.jsonl`` line (as :class:`~rlboost_hpc.observe.report.RunReport`
is of ``report.json``).

The trainer's loop fills the step's own fields, the run adds the fleet at the step's end, and :meth:`StepRecord.line`
flattens it into the JSON object written to ``metrics.jsonl`` — the shape every reader of that file (the report,
resume, plots, benchmarks) reads by key. Figures whose names depend on the trainer backend and the weight publisher
(loss, KL, grad norm, the publish's seconds and bytes, …) travel in :attr:`StepRecord.backend` and are flattened
after the fields, so a backend figure of a field's name wins (``tokens``: the tokens the backend trained).
"""
from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["StepRecord"]


class StepRecord(msgspec.Struct, kw_only=True):
    """One step (seconds, tokens and instance counts as named).

    Trainer loop: ``step``; ``version`` (published at the step's end); ``wall_s``; ``t_seed_s`` (the seeding
    window as run); ``seeding_close`` (the manager's word at the close); ``train_s`` (trainer compute: micro-batches
    + optimizer); ``reward_mean``; ``response_len_mean`` (tokens); ``responses`` / ``responses_migrated`` trained;
    ``tokens`` (prompt + response tokens of the step); ``turns_mean``; ``environment_s`` (tool calls' seconds);
    ``preemptible_instances_served``; ``throughput_tokens_per_s``; the timeline — ``phase_s`` (seconds per phase,
    summing to ``wall_s``), ``fixed_overhead_s`` and ``fixed_overhead_s_by_phase``, ``instance_s`` /
    ``instance_activity_s`` (instance-seconds by activity: all instances, by instance), ``rollout_by_kind`` (the
    reserved engines' and the preemptible instances' tokens and busy / idle / pulling seconds: ``{kind: {"tokens",
    "busy_s", "idle_s", "pulling_s"}}``), ``response_tail_s``; the
    controller's observation and decision — ``t_seed_next_s``, ``n_prem_cap`` (None: no cap), ``n_prem_wanted`` (the
    cap's law before its clamp to the capacity seen: what the run could use; None: unbounded), ``t_wait_train_s``,
    ``fallback_s``, ``t_remote_s``, ``t_wait_remote_s``, ``n_remote``, ``n_available``; truncation —
    ``truncated_share`` and ``truncated_share_by_cause``; ``staleness_tokens`` (bounded staleness: generated tokens
    trained, by how many versions older than the trained one made them; {} under strict on-policy);
    ``reward_functions`` (a user's task: each reward function's mean value over the step's responses, ``None``
    values — not applicable, or failed — left out: TRL's ``rewards/<name>``; {} for built-in tasks),
    ``responses_left_out`` (responses of groups a reward component failed on: not trained); ``samples`` (the step's
    first ``trainer.log_samples`` responses as rows — ``prompt``, ``response``, ``reward``, ``failed``, ``parts``:
    written to ``samples.jsonl`` and the trackers' tables, not to ``metrics.jsonl``).

    Run (after the step): ``t_s`` (seconds since the run started), ``ts`` (Unix time), ``live_preemptible``,
    ``routable_preemptible``, ``cluster_live``, ``version_serving`` (how the step's version reached the fleet),
    ``n_prem_target`` (the rollout jobs asked of the scavenger for the next step), ``faults`` (the run's fault and
    migration tally so far, every incarnation summed: :class:`~rlboost_hpc.observe.run_report.FaultTally` as a
    dict — preemptions warned, kills, worker starts, responses and tokens migrated, tokens regenerated, …).
    """

    step: int
    version: int
    wall_s: float
    t_seed_s: float
    seeding_close: str
    train_s: float
    reward_mean: float
    response_len_mean: float
    responses: int
    responses_migrated: int
    tokens: int
    turns_mean: float
    environment_s: float
    preemptible_instances_served: int
    throughput_tokens_per_s: float
    phase_s: dict[str, float]
    fixed_overhead_s: float
    fixed_overhead_s_by_phase: dict[str, float]
    instance_s: dict[str, float]
    instance_activity_s: dict[str, dict[str, float]]
    rollout_by_kind: dict[str, dict[str, float]]
    response_tail_s: float
    t_seed_next_s: float
    n_prem_cap: int | None
    n_prem_wanted: int | None
    t_wait_train_s: float
    fallback_s: float
    t_remote_s: float
    t_wait_remote_s: float
    n_remote: int
    n_available: int | None
    truncated_share: float
    truncated_share_by_cause: dict[str, float]
    staleness_tokens: dict[str, int] = {}
    reward_functions: dict[str, float] = {}
    responses_left_out: int = 0
    samples: list[dict[str, Any]] = []
    backend: dict[str, Any] = {}
    t_s: float | None = None
    ts: float | None = None
    live_preemptible: int | None = None
    routable_preemptible: int | None = None
    cluster_live: int | None = None
    version_serving: dict[str, Any] | None = None
    n_prem_target: int | None = None
    faults: dict[str, int] | None = None

    def line(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` object: the fields (the run's only once set) then the backend's figures."""
        out = {k: v for k, v in msgspec.structs.asdict(self).items() if k not in ("backend", "samples")}
        for k in ("t_s", "ts", "live_preemptible", "routable_preemptible", "cluster_live", "version_serving",
                  "n_prem_target", "faults"):
            if out[k] is None:
                del out[k]
        out.update(self.backend)
        return out
