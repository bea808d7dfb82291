"""The rollout manager's statistics as typed records: its running counters and the snapshot ``GetStats`` answers.

Invariant: every counter the manager keeps is a field of :class:`ManagerCounters` (a misspelt counter is an
``AttributeError``, never a new key that nothing reads), and every reader — the trainer's step loop, the run's
report, the Prometheus collector, tests — reads :class:`ManagerStats` attributes, so a renamed or removed field
fails where it is read. Both are msgspec structs: the snapshot crosses the manager ↔ trainer socket as-is.
"""
from __future__ import annotations

from typing import Annotated

import msgspec


class ManagerCounters(msgspec.Struct, kw_only=True):
    """Running totals of one manager since it started (counts; ``environment_seconds`` in seconds;
    ``weight_pulled_bytes`` in bytes). Only the manager's core increments them."""

    registrations: int = 0
    messages_received: int = 0  # decoded messages from instances (every kind)
    messages_sent: int = 0  # messages queued to instances (every kind)
    rejected_registrations: int = 0
    dispatched: int = 0
    responses_migrated: int = 0  # unfinished responses moved to another instance
    tokens_migrated: int = 0  # generated tokens carried over by those moves
    tokens_regenerated: int = 0  # tokens lost with an instance (unsent at a kill) and generated again
    tokens_regenerated_after_warning: int = 0
    tokens_received: int = 0
    tokens_received_preemptible: int = 0  # of those, streamed by preemptible instances (harvested capacity)
    late_tokens: int = 0  # dropped: their request had moved on
    off_version_tokens_rejected: int = 0
    instances_preempted_with_warning: int = 0
    instances_fenced: int = 0
    instances_drained: int = 0
    instances_time_limit: int = 0
    weight_loads: int = 0  # complete, verified versions loaded
    weight_load_failures: int = 0
    groups_delivered: int = 0
    responses_delivered: int = 0
    request_failures: int = 0
    protocol_rejects: int = 0
    released_requests: int = 0
    balancer_moves: int = 0
    instances_suspected: int = 0
    instances_recovered: int = 0
    # responses assigned to an instance after its last message and taken back when it was suspected: work handed
    # to a node that had already vanished
    responses_assigned_to_vanished: int = 0
    instances_expired: int = 0
    suspected_while_pulling: int = 0
    recovered_while_pulling: int = 0
    groups_redelivered: int = 0
    connections_closed: int = 0
    deltas_out_of_order: int = 0
    slow_weight_loads: int = 0
    weight_checksum_mismatches: int = 0
    # versions loaded that the current trainer lineage never made (a pull begun before a resumed trainer's version):
    # never routed to; the instance pulls the lineage's latest
    weight_loads_of_another_lineage: int = 0
    weight_pulled_bytes: int = 0
    # emulated engines (rollout.engine = "emulated"): wall seconds their profile asked for, and seconds they ran behind
    # it (a host slower than the profile); the ratio (modelled + late) / modelled says how late the run ran
    emulated_modelled_seconds: float = 0.0
    emulated_late_seconds: float = 0.0
    # LoRA runs: the bases instances loaded, by source (model.path on their node, their node's cache, a pull from the
    # trainer's base server, the trainer's own memory for the reserved engine), and the bytes the pulls received
    base_loads_from_path: int = 0
    base_loads_from_cache: int = 0
    base_loads_pulled: int = 0
    base_loads_in_trainer: int = 0
    base_pulled_bytes: int = 0
    turns_completed: int = 0
    environment_calls: int = 0
    environment_errors: int = 0
    environment_timeouts: int = 0
    environment_seconds: float = 0.0
    environment_replays: int = 0  # stateful environments rebuilt by replaying their trajectory (tasks/environment.py)
    observation_tokens: int = 0
    tokens_in_interrupted_turns: int = 0
    assistant_tokens_in_interrupted_trajectories: int = 0
    # crash recovery (manager/restore.py): restarts of the manager that rebuilt the step in flight from the work log,
    # held responses an instance continued at the logged length (its tokens from the outage kept), and responses of
    # a version a resumed trainer did not have (dropped, with their tokens)
    manager_restarts: int = 0
    responses_adopted: int = 0
    responses_discarded_stale: int = 0
    tokens_discarded_stale: int = 0
    # running totals by key: partial responses handed off by / resumed on instances of each engine kind
    # (``out_of`` / ``into`` → engine → count), partial responses migrated by the assistant turn they were in, and
    # finished responses cut by a budget, by cause (``messages.TRUNCATION_CAUSES``)
    migrations_by_engine: dict[str, dict[str, int]] = msgspec.field(
        default_factory=lambda: {"out_of": {}, "into": {}})
    migrations_by_turn: dict[str, int] = {}
    responses_truncated_by_cause: dict[str, int] = {}


class InstanceSnapshot(msgspec.Struct, kw_only=True):
    """One registered rollout instance that is not gone: its ``kind`` (``reserved`` / ``preemptible``),
    ``engine``, ``state`` (an ``InstanceState`` value), weight ``version`` (-1: none loaded), ``inflight``
    (responses it owns), ``partial`` (those with ≥ 1 token already received: what a preemption of it would hand
    over), ``tokens_received`` and ``activity_s`` (seconds by activity: busy, idle, pulling)."""

    kind: str
    engine: str
    state: str
    version: int
    inflight: int
    partial: int
    tokens_received: int
    activity_s: dict[str, float]


class StepRemote(msgspec.Struct, kw_only=True):
    """Remote (preemptible) rollout of the last finished step: seconds the remote instances generated
    (``t_remote_s``), seconds the trainer waited for them after the reserved engine finished
    (``t_wait_remote_s``), how many took part (``n_remote``) and the tokens they generated; ``fallback_s``: seconds
    after seeding closed with no remote capacity until a preemptible instance was pulling or ready (or the rollout
    was done) — the co-located fallback, in which the reserved engine kept generating: seeding in all but name, so
    the trainer does not count it as waiting for data."""

    t_remote_s: float = 0.0
    t_wait_remote_s: float = 0.0
    n_remote: int = 0
    tokens: int = 0
    fallback_s: float = 0.0


class StepActivity(msgspec.Struct, kw_only=True):
    """Instance activity of the last finished step: instance-seconds per activity over all instances
    (``instance_s``), per instance (``by_instance_s``), and the intervals ``[start, end]`` (the manager's
    monotonic clock, seconds) in which at least one engine generated (``generating``); ``response_tail_s``: seconds
    from the completion by which 90 % of the step's responses were done to its last completion (the long-response
    tail that load balancing shortens); ``tokens_by_kind``: tokens accepted from each kind of instance
    (``reserved``, ``preemptible``)."""

    instance_s: dict[str, float] = {}
    by_instance_s: dict[str, dict[str, float]] = {}
    generating: list[tuple[float, float]] = []
    response_tail_s: float = 0.0
    tokens_by_kind: dict[str, int] = {}


class VersionServing(msgspec.Struct, kw_only=True):
    """How the last replaced weight version reached the fleet: of the ``live`` preemptible instances at its
    ``SetVersion``, ``served`` reported it loaded before the next ``SetVersion``; seconds from the ``SetVersion`` to
    the first, median and last of those loads (0 when none). ``version`` −1: no version replaced yet."""

    version: int = -1
    live: int = 0
    served: int = 0
    first_s: float = 0.0
    median_s: float = 0.0
    last_s: float = 0.0


class HeldOutEvaluation(msgspec.Struct, kw_only=True):
    """One held-out evaluation of the run (``trainer/eval.py``): of weight version ``version``, the mean reward of
    the sampled responses and of the greedy ones, and the unbiased pass@k of Chen et al. (2021) for each k of
    ``trainer.eval_pass_k`` (k as text → the mean over prompts, in [0, 1])."""

    version: int
    reward_sampled: float
    reward_greedy: float
    pass_at_k: Annotated[dict[Annotated[str, msgspec.Meta(max_length=8)], float], msgspec.Meta(max_length=32)] = {}


class ManagerStats(ManagerCounters, kw_only=True):
    """What ``GetStats`` answers: the counters (inherited fields) plus a snapshot of instances, queue, the last
    step and the policy's decision in force (every field defaults to the state of a manager that has seen nothing).

    ``instances_lost`` / ``instances_lost_while_pulling``: instances that went silent (suspect) and have not come
    back, expired or not. ``routable_preemptible``: preemptible instances the manager would route to now;
    ``live_preemptible``: those neither gone nor suspect. ``t_seed_s`` / ``n_prem_cap``: the seeding window T_seed
    (seconds) and the cap N_prem the trainer's controller set last (``None``: not set / no cap).
    ``last_step_mismatch``: the engine–trainer mismatch of the trainer's last step (``StepTimes.mismatch``);
    ``last_step_rewards``: a user's task, each reward function's mean over that step (``StepTimes.rewards``).
    ``heldout``: the run's held-out evaluations the trainer told (``"before"``: the starting policy, ``"after"``:
    the trained one)."""

    instances_lost: int = 0
    instances_lost_while_pulling: int = 0
    instances: dict[str, InstanceSnapshot] = {}
    decode_tokens_per_s_by_batch: dict[str, float] = {}
    latest_version: int = -1
    step: int = -1
    queued: int = 0
    running: int = 0
    instances_by_state: dict[str, int] = {}
    routable_preemptible: int = 0
    live_preemptible: int = 0
    pull_seconds_mean: float = 0.0
    full_pull_seconds_mean: float = 0.0
    failed_step: str | None = None
    last_step_remote: StepRemote = msgspec.field(default_factory=StepRemote)
    last_version_serving: VersionServing = msgspec.field(default_factory=VersionServing)
    last_step_activity: StepActivity = msgspec.field(default_factory=StepActivity)
    instance_activity_s: dict[str, float] = {}
    last_step_mismatch: dict[str, float] = {}
    last_step_rewards: dict[str, float] = {}
    heldout: dict[str, HeldOutEvaluation] = {}
    environment_pending: int = 0
    t_seed_s: float | None = None
    n_prem_cap: int | None = None
