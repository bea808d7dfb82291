"""The rollout manager's settings as one typed record, derived from the run's configuration in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlboost_hpc import defaults as D

if TYPE_CHECKING:  # the manager process never needs the config models (pydantic): only their values cross
    from rlboost_hpc.config import RunConfig


@dataclass(frozen=True)
class ManagerSettings:
    """What a run's manager is configured with (seconds in ``_s`` fields; counts otherwise). The defaults are
    those of :class:`~rlboost_hpc.manager.core.ManagerCore` (``defaults.py``); a run derives every field from its
    :class:`RunConfig` with :meth:`from_config`; the core takes it whole (picklable: it crosses to the spawned
    manager process).

    ``pending_limit``: Θ, requests in flight per instance before JSQ looks elsewhere. ``heartbeat_s`` /
    ``heartbeat_timeout_s`` / ``instance_expiry_s``: liveness; ``dispatch_silence_s``: silence after which an
    instance gets no new work (it keeps what it runs until ``heartbeat_timeout_s``). ``max_attempts``: dispatches of one response
    before its step fails. ``stream_every_tokens`` / ``stream_every_s``: the engines' streaming cadence (sent in
    ``Welcome``). ``dispatch_policy``: ``jsq`` (RLBoost) or ``round_robin`` (ablation). ``balance``: continuous
    balancing on, every ``balance_every_s``. ``relay_fanout``: pullers a relay holder serves (0: relay off);
    ``relay_trainer_fanout``: pullers the trainer serves while relay is on. ``commit_every_s``: the work log's
    group-commit window (the most a manager kill loses, ``manager/worklog.py``). ``max_staleness``: k, the versions
    a response's tokens may lag the version that trains it (0: strict on-policy); ``on_new_version``: ``finish`` or
    ``continue`` (sent in ``Welcome``: when an instance loads a newer version while it runs responses).
    ``arrival_hold_s``: the longest an instance about to load the latest version keeps its share of the work waiting
    (``manager/assign.py``; 0: never)."""

    pending_limit: int = D.PENDING_LIMIT
    heartbeat_s: float = D.HEARTBEAT_S
    heartbeat_timeout_s: float = D.HEARTBEAT_TIMEOUT_S
    instance_expiry_s: float = D.INSTANCE_EXPIRY_S
    dispatch_silence_s: float = D.DISPATCH_SILENCE_S
    max_attempts: int = D.MAX_ATTEMPTS
    stream_every_tokens: int = D.STREAM_EVERY_TOKENS
    stream_every_s: float = D.STREAM_EVERY_S
    dispatch_policy: Literal["jsq", "round_robin"] = "jsq"
    balance: bool = False
    balance_every_s: float = D.BALANCE_EVERY_S
    relay_fanout: int = 0
    relay_trainer_fanout: int = D.RELAY_TRAINER_FANOUT
    commit_every_s: float = D.WORK_COMMIT_S
    max_staleness: int = D.MAX_STALENESS
    on_new_version: Literal["continue", "finish"] = D.ON_NEW_VERSION
    arrival_hold_s: float = D.ARRIVAL_HOLD_S

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "ManagerSettings":
        """The manager settings of a run: ``manager.*``, the streaming cadence of ``rollout.*``, dispatch and
        balancing of ``policy.*``, relay of ``weights.*`` (``weights.relay = false`` → fan-out 0)."""
        m = cfg.manager
        return cls(pending_limit=m.pending_limit, heartbeat_s=m.heartbeat_s,
                   heartbeat_timeout_s=m.heartbeat_timeout_s, instance_expiry_s=m.instance_expiry_s,
                   dispatch_silence_s=m.dispatch_silence_s,
                   max_attempts=m.max_attempts, stream_every_tokens=cfg.rollout.stream_every_tokens,
                   stream_every_s=cfg.rollout.stream_every_s, dispatch_policy=cfg.policy.dispatch,
                   balance=cfg.policy.balance, balance_every_s=cfg.policy.balance_every_s,
                   relay_fanout=cfg.weights.relay_fanout if cfg.weights.relay else 0,
                   relay_trainer_fanout=cfg.weights.relay_trainer_fanout, commit_every_s=m.commit_every_s,
                   max_staleness=cfg.rollout.max_staleness, on_new_version=cfg.rollout.on_new_version,
                   arrival_hold_s=m.arrival_hold_s)
