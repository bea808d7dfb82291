"""Per-step rollout controller: the seeding window and the pool cap, fed by one observation per step.

This is the single object the live manager and the simulator both drive ("policy/ ... shared
verbatim by the manager and the simulator"). The protocol, once per RL step:

1. at step start: ``t_seed = ctl.begin_step(n_instances)`` — ``n_instances`` = preemptible instances held now
   (recalls ``M[n]`` when the count changed since the last step, see :mod:`.seeding`);
2. run the step with that window; the pool may not exceed ``ctl.cap`` (``None`` = no cap yet);
3. at step end: ``decision = ctl.end_step(StepObservation(...))`` — updates ``T_seed`` (η rule + memory) and
   recomputes ``N_prem`` (:mod:`.cap`) from the same observation; ``decision.t_seed_s`` and
   ``decision.n_prem_cap`` are what the next step should use, and what the scavenger/local cluster obeys.

Pure and deterministic: the decisions are a function of the sequence of observations (the replay test in
``tests/test_policy_controller.py`` checks that re-feeding a recorded sequence reproduces them exactly).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rlboost_hpc.policy.cap import n_prem_cap, n_prem_cap_overlap
from rlboost_hpc.policy.seeding import SeedingWindow


@dataclass(frozen=True)
class StepObservation:
    """What one finished step exhibited (seconds unless noted).

    Attributes:
        t_seed_s: the seeding window the step used (0 when it had none: bounded staleness, the step was generated
            ahead and trained at once).
        t_wait_train_s: trainer idle time after switching to training, waiting for completed groups.
        t_wait_remote_s: remote pool idle time after its last response, waiting for the next version
            (0 when no remote instance took part).
        t_remote_s: mean rollout work per remote instance that took part, instance-seconds at full efficiency
            (its tokens ÷ its learned peak decode rate; busy seconds only when no peak is known yet —
            :func:`rlboost_hpc.policy.observation.observe_remote`).
        n_remote: remote instances that took part in the step.
        t_train_s: trainer compute time of the step (micro-batches + optimizer step; waits excluded).
        n_instances_start / n_instances_end: preemptible instances held at step start / end.
        n_available: instances that could be held now (the cap's upper clamp); ``None``: unknown/unbounded.
        step_s: the step's wall seconds (start to the next version); used by the cap under overlap.
    """

    t_seed_s: float
    t_wait_train_s: float
    t_wait_remote_s: float
    t_remote_s: float
    n_remote: int
    t_train_s: float
    n_instances_start: int
    n_instances_end: int
    n_available: int | None = None
    step_s: float = 0.0


@dataclass(frozen=True)
class StepDecision:
    """What the next step should use: its seeding window and the preemptible-pool cap (``None``: none).

    ``n_prem_wanted``: the same law before its clamp to the capacity that could be held now (``n_available``) —
    how many instances the run could use. It is what a run asks a shared pool for (the harvest service's demand):
    asking for the clamped cap would tie the demand to the share it is meant to obtain, and a run whose share starts
    at 0 would never ask for more. ``None``: no measurement bounds it yet (or the cap is off): as many as allowed.
    Invariant: ``n_prem_cap == min(n_prem_wanted, n_available)`` with ``None`` as "no bound"."""

    t_seed_s: float
    n_prem_cap: int | None
    n_prem_wanted: int | None = None


@dataclass
class RolloutController:
    """Seeding window + pool cap. ``n_resv``: reserved rollout engines in preemptible-instance equivalents.

    ``use_cap=False`` disables the cap (every available instance is used). ``cap_minimum``: lower clamp of the
    cap (0 by default: with zero instances the manager falls back to co-located rollout). ``overlap``: rollout
    overlaps training (bounded staleness, ``rollout.max_staleness`` ≥ 1): the cap's law for overlap.
    """

    n_resv: float
    seeding: SeedingWindow = field(default_factory=SeedingWindow)
    use_cap: bool = True
    cap_minimum: int = 0
    overlap: bool = False
    cap: int | None = None
    history: list = field(default_factory=list)

    def begin_step(self, n_instances: int) -> float:
        """The window for the step that starts now, given the preemptible instances held now."""
        return self.seeding.begin_step(n_instances)

    def end_step(self, obs: StepObservation) -> StepDecision:
        """Feed the finished step's observation; returns (and remembers) the decision for the next step.

        Bounded staleness (``overlap``): T_seed goes to its floor (a step is mostly generated before it starts,
        and a longer window would hold training back), and once a preemptible instance took part the cap is
        :func:`~rlboost_hpc.policy.cap.n_prem_cap_overlap` over the step's seconds (``step_s``; before, the paper's
        law, whose seeding term sizes a first pool). ``t_wait_remote_s`` then counts from when every admitted step
        was generated."""
        if self.overlap:  # a step is mostly generated before it starts: seeding would only hold training back
            t_seed = self.seeding.to_floor()
        else:
            t_seed = self.seeding.update(obs.t_wait_train_s, obs.t_wait_remote_s,
                                         obs.n_instances_start, obs.n_instances_end)
        wanted: int | None = None  # the law unclamped by capacity: what the run could use (None: unbounded)
        if self.use_cap and self.overlap and obs.n_remote:  # no instance took part: the paper's law bootstraps
            busy = max(0.0, obs.step_s - obs.t_wait_remote_s)
            wanted = n_prem_cap_overlap(busy, obs.n_remote, max(0.0, obs.step_s - obs.t_wait_train_s - obs.t_seed_s),
                                        minimum=self.cap_minimum)
        elif self.use_cap:
            wanted = n_prem_cap(obs.t_remote_s, obs.n_remote, obs.t_seed_s, self.n_resv, obs.t_train_s,
                                minimum=self.cap_minimum)
        avail = obs.n_available
        self.cap = avail if wanted is None else wanted if avail is None else min(wanted, avail)
        decision = StepDecision(t_seed_s=t_seed, n_prem_cap=self.cap, n_prem_wanted=wanted)
        self.history.append((asdict(obs), asdict(decision)))
        return decision

    @property
    def t_seed_s(self) -> float:
        return self.seeding.value

    def state_dict(self) -> dict:
        """The controller's learned state as plain JSON data: the seeding window's, the cap in force and the
        history of (observation, decision) pairs. Its settings (``n_resv``, ``use_cap``, …) come from config."""
        return {"seeding": self.seeding.snapshot(), "cap": self.cap, "history": [list(h) for h in self.history]}

    def load_state_dict(self, st: dict) -> None:
        """Continue from a :meth:`state_dict` taken earlier (same settings)."""
        self.seeding.restore(st["seeding"])
        self.cap = st["cap"]
        self.history = [tuple(h) for h in st["history"]]
