"""The rollout manager's statistics: its counters and a snapshot of instances, requests and the step's records as
one :class:`~rlboost_hpc.protocol.stats.ManagerStats` (what ``GetStats`` answers, the report and Prometheus read)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from rlboost_hpc.manager.state import InstanceState as S, RequestState as R
from rlboost_hpc.observe.histogram import PULL_BUCKETS_S, SILENCE_BUCKETS_S, STEP_BUCKETS_S, Histogram
from rlboost_hpc.protocol.stats import InstanceSnapshot, ManagerStats, VersionServing


@dataclass
class ManagerDistributions:
    """The manager's distributions (seconds), each a bounded :class:`Histogram` — a week-long run makes ~10^6
    weight pulls and ~10^5 steps, and neither its memory nor a scrape may grow with them.

    ``pull_seconds``: each verified weight pull (``WeightsLoaded.pull_s``); ``full_pull_seconds``: those of them that
    moved the whole version (no delta: an instance's first pull, a pull without a usable base). ``step_seconds``: each RL step's wall time
    (``StepTimes.wall_s``). ``silence_seconds``: each silence between two messages of one instance longer than two
    heartbeat intervals (a missed heartbeat), measured when it spoke again — what ``heartbeat_timeout_s`` is chosen
    from. ``version_serving_seconds``: :class:`VersionServingClock`'s delays."""

    pull_seconds: Histogram = field(default_factory=lambda: Histogram(PULL_BUCKETS_S))
    full_pull_seconds: Histogram = field(default_factory=lambda: Histogram(PULL_BUCKETS_S))
    #: each preemptible instance live at a ``SetVersion``: seconds from it to the instance's load of that version
    version_serving_seconds: Histogram = field(default_factory=lambda: Histogram(PULL_BUCKETS_S))
    step_seconds: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    silence_seconds: Histogram = field(default_factory=lambda: Histogram(SILENCE_BUCKETS_S))


class VersionServingClock:
    """SetVersion → every instance serving: for each weight version, the seconds from its ``SetVersion`` until each
    preemptible instance live at that moment reports it loaded (``WeightsLoaded``). Instances that join later are not
    counted (their first pull is a start-up, not a version change). Memory: one key and one delay per live
    instance of the current version. Pure: the caller passes the clock's time."""

    def __init__(self) -> None:
        self.version, self.set_at = -1, 0.0
        self.waiting: set[str] = set()
        self.reported: set[str] = set()  # instances that reported a load (of any version) since the set
        self.live, self.delays = 0, []
        self.last = VersionServing()

    def set_version(self, version: int, now: float, live_keys) -> None:
        """``version`` is current from ``now``; ``live_keys``: the preemptible instances that must load it. The
        version it replaces is summarised into :attr:`last`."""
        if self.version >= 0:
            d = sorted(self.delays)
            self.last = VersionServing(version=self.version, live=self.live, served=len(d),
                                       first_s=d[0] if d else 0.0, median_s=d[len(d) // 2] if d else 0.0,
                                       last_s=d[-1] if d else 0.0)
        self.version, self.set_at = version, now
        self.waiting, self.reported = set(live_keys), set()
        self.live, self.delays = len(self.waiting), []

    def loaded(self, key: str, version: int, now: float) -> float | None:
        """An instance loaded ``version``: its delay (seconds) when it was awaited, else None."""
        self.reported.add(key)
        if version != self.version or key not in self.waiting:
            return None
        self.waiting.discard(key)
        self.delays.append(now - self.set_at)
        return self.delays[-1]


def manager_stats(core) -> ManagerStats:
    """Counters of ``core`` (a :class:`~rlboost_hpc.manager.core.ManagerCore`) plus a snapshot of its instances
    (every one that is not gone) and queue; the fields are documented on :class:`ManagerStats`."""
    states: dict[str, int] = {}
    for i in core.fleet.values():
        states[i.state] = states.get(i.state, 0) + 1
    reqs = core.book.requests
    c = core.counters
    decision = core.policy_decision
    return ManagerStats(
        **msgspec.msgpack.decode(msgspec.msgpack.encode(c)),  # (a deep copy: the tallies by key are dicts)
        # went silent and have not come back (expired, or still suspect): lost without warning
        # (≥ 0: a manager restarted from its work log has the counters of the last commit, so a silence in the
        # commit window before the kill may be lost while the return after it is counted)
        instances_lost=max(0, c.instances_suspected - c.instances_recovered),
        instances_lost_while_pulling=max(0, c.suspected_while_pulling - c.recovered_while_pulling),
        instances={i.key: InstanceSnapshot(
            kind=i.kind, engine=i.engine, state=str(i.state), version=i.version, inflight=len(i.inflight),
            tokens_received=i.tokens_received, activity_s=dict(core.activity.by_instance_s.get(i.key, {})),
            partial=sum(1 for r in i.inflight if r in reqs and reqs[r].n > 0))
            for i in core.fleet.values() if i.state != S.GONE},
        decode_tokens_per_s_by_batch={str(b): v for b, v in sorted(core.pool_rates.ema.items())},
        latest_version=core.lineage.latest.number,
        step=core.step,
        queued=len(core.book.queue),
        running=sum(len(i.inflight) for i in core.fleet.values()),
        instances_by_state={str(k): v for k, v in states.items()},
        routable_preemptible=sum(1 for i in core.fleet.values() if i.kind == "preemptible" and core.routable(i)),
        live_preemptible=sum(1 for i in core.fleet.values()
                             if i.kind == "preemptible" and i.state not in (S.GONE, S.SUSPECT)),
        pull_seconds_mean=core.dist.pull_seconds.mean(),
        full_pull_seconds_mean=core.dist.full_pull_seconds.mean(),
        failed_step=core.failed_step,
        last_step_remote=core.step_account.last_remote,
        last_version_serving=core.version_serving.last,
        last_step_activity=core.step_account.last_activity,
        instance_activity_s=dict(core.activity.total_s),
        last_step_mismatch=dict(core.step_account.last_mismatch),
        last_step_rewards=dict(core.step_account.last_rewards), heldout=dict(core.heldout),
        environment_pending=sum(1 for r in reqs.values() if r.state == R.ENVIRONMENT),
        t_seed_s=decision.t_seed_s if decision else None,
        n_prem_cap=decision.n_prem_cap if decision else None,
    )
