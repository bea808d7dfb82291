"""The rollout manager's account of each step: what the preemptible pool did for it and what the trainer says the
step cost — the records the observation law reads (``policy/observation.py``) and the step timeline Prometheus sums.

A collaborator of :class:`~rlboost_hpc.manager.core.ManagerCore` that owns its state (the core's single writer calls
it; pure, no clock of its own: every time is a parameter, in the core's monotonic seconds).
"""
from __future__ import annotations

from rlboost_hpc.manager.state import StepWork
from rlboost_hpc.observe.timeline import response_tail_s
from rlboost_hpc.policy.observation import RemoteWork, observe_remote
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import StepActivity, StepRemote


class StepAccount:
    """One step's rollout, closed into the last step's figures when the weight version changes, and the trainer's
    step timeline summed over the run.

    The open step: ``remote`` (instance key → :class:`StepWork`: when it first and last generated for the step,
    tokens, its learned peak rate; set by dispatch and the balancer, grown by token deltas), ``tokens_by_kind``
    (tokens accepted by instance kind), ``done_s`` (when each response completed, seconds), ``rollout_done_at``
    (when the step's last group completed; None: not yet), ``fallback_since`` / ``fallback_s`` (the co-located
    fallback: seeding closed with no remote capacity; when it began, None when not open, and its seconds so far).
    The closed step: ``last_remote`` (:class:`StepRemote`), ``last_activity`` (:class:`StepActivity`). The trainer's
    timeline (``StepTimes``): ``phase_s`` (phase → seconds summed over the run), ``fixed_overhead_s`` (seconds
    summed), ``last_mismatch`` and ``last_rewards`` (its last step's engine–trainer mismatch and mean reward by
    function).
    """

    def __init__(self, first_activity: StepActivity) -> None:
        self.remote: dict[str, StepWork] = {}
        self.tokens_by_kind: dict[str, int] = {}
        self.done_s: list[float] = []
        self.rollout_done_at: float | None = None
        self.fallback_since: float | None = None
        self.fallback_s = 0.0
        self.last_remote = StepRemote()
        self.last_activity = first_activity
        self.phase_s: dict[str, float] = {}
        self.fixed_overhead_s = 0.0
        self.last_mismatch: dict[str, float] = {}
        self.last_rewards: dict[str, float] = {}

    # ------------------------------------------------------------------ the open step
    def dispatched(self, key: str, now: float, peak: float | None) -> None:
        """A preemptible instance ``key`` took work of the step at ``now``: its record opens (if not open) with its
        learned peak rate so far (tokens/s; None: not learned)."""
        if key not in self.remote:
            self.remote[key] = StepWork(now, now, peak=peak)

    def learned_peak(self, key: str, peak: float) -> None:
        """The balancer learned ``key``'s peak decode rate (tokens/s): kept in its record, also if it leaves."""
        if key in self.remote:
            self.remote[key].peak = peak

    def accepted(self, key: str, kind: str, tokens: int, now: float) -> None:
        """``tokens`` token ids of instance ``key`` (of ``kind``) were accepted at ``now``."""
        self.tokens_by_kind[kind] = self.tokens_by_kind.get(kind, 0) + tokens
        rec = self.remote.get(key)
        if rec is not None:
            rec.last_s = now
            rec.tokens += tokens

    def response_done(self, now: float) -> None:
        """A response of the step completed at ``now`` (the tail's figure)."""
        self.done_s.append(now)

    def rollout_done(self, now: float) -> None:
        """The step's last group completed at ``now``: the rollout is over, and so is any co-located fallback."""
        self.rollout_done_at = now
        self.end_fallback(now)

    def open_fallback(self, now: float) -> None:
        """Seeding closed at ``now`` with no remote capacity: the reserved engines go on generating."""
        self.fallback_since = now

    def end_fallback(self, now: float) -> None:
        """The co-located fallback (if open) ends at ``now``: its seconds add to ``fallback_s``."""
        if self.fallback_since is not None:
            self.fallback_s += max(0.0, now - self.fallback_since)
            self.fallback_since = None

    def close(self, now: float, activity_s: dict) -> None:
        """The weight version changes at ``now``: the open step closes into ``last_activity`` (``activity_s``: the
        activity clock's instance-seconds of the step, ``ActivityClock.take``) and ``last_remote`` (the observation
        law's T_remote, T_wait_remote, N_remote over ``remote``), and the next step opens empty."""
        self.last_activity = StepActivity(**activity_s, response_tail_s=response_tail_s(self.done_s),
                                          tokens_by_kind=dict(self.tokens_by_kind))
        obs = observe_remote([RemoteWork(tokens=r.tokens, peak_tokens_per_s=r.peak, busy_s=r.last_s - r.first_s)
                              for r in self.remote.values()], rollout_done_s=self.rollout_done_at, step_end_s=now)
        self.end_fallback(now)
        self.last_remote = StepRemote(t_remote_s=obs.t_remote_s, t_wait_remote_s=obs.t_wait_remote_s,
                                      n_remote=obs.n_remote, tokens=obs.tokens, fallback_s=self.fallback_s)
        self.remote, self.tokens_by_kind, self.done_s = {}, {}, []
        self.rollout_done_at, self.fallback_s = None, 0.0

    # ------------------------------------------------------------------ the trainer's timeline
    def step_times(self, msg: M.StepTimes) -> None:
        """The trainer's account of a step: its seconds by phase and fixed overhead add up; its mismatch and rewards
        by function become the last step's."""
        self.fixed_overhead_s += msg.fixed_overhead_s
        self.last_mismatch = dict(msg.mismatch)
        self.last_rewards = dict(msg.rewards)
        for phase, sec in msg.phases.items():
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + sec
