"""The rollout manager's state machine: instance registry + token-level request table + dispatch.

Pure logic, no sockets: messages go in through :meth:`ManagerCore.on_message`, time through an injected
clock, and replies accumulate in :attr:`ManagerCore.outbox` as ``(peer, message)`` pairs that the service
sends. Holds no policy arithmetic (T_seed, N_prem live in ``policy/``).

This module holds the state, the entry points of the I/O service (:meth:`ManagerCore.on_message`,
:meth:`~ManagerCore.disconnected`, :meth:`~ManagerCore.tick`, :meth:`~ManagerCore.stats`) and routing: which
instance holds a version new work may go to (:meth:`~ManagerCore.serves`, :meth:`~ManagerCore.routable`). The core
is the mediator: it holds the state owners (the :class:`~rlboost_hpc.manager.fleet.Fleet`, the
:class:`~rlboost_hpc.manager.request_book.RequestBook`, the :class:`VersionLineage`, the :class:`StepAccount`) and
three collaborators that handle the messages, each found by the core's dispatch table:
``instance_registry.py`` (instances: registration, liveness, weight loads, fencing, the end of an attempt; who is
registered and in which state is the :class:`~rlboost_hpc.manager.fleet.Fleet`'s),
``request_table.py`` (responses: token deltas, turns and tool calls, finishes, migrations; the responses, their
groups and the queue are the :class:`~rlboost_hpc.manager.request_book.RequestBook`'s) and
``trainer_calls.py`` (the trainer: versions, steps, the delivery of GRPO groups). Dispatch (``assign.py``),
balancing (``balance.py``) and crash recovery (``restore.py``) are functions of the core.

Invariants (each has a test in tests/test_manager_core.py):
1. Strict on-policy: a request carries its step's weight version; a token delta of any other version is
   rejected and its instance fenced. The version only changes between steps (SetVersion is refused while
   requests of the old version are unfinished: the explicit in-flight policy). Bounded staleness
   (``max_staleness`` = k ≥ 1) widens this to a window: a request carries the oldest version whose tokens it may
   hold (the version that trains its step, minus k); a delta of a version below it or above the latest is
   rejected; SetVersion is refused while a request whose window the new version would leave is unfinished.
2. Exactly once: a request is owned by at most one instance at a time; deltas from any other instance are
   dropped as late; each group is delivered to the trainer once.
3. Ids are ids: a delta must start exactly at the response's current length (no gap, no overlap).
4. Routable ⇔ state ready ∧ version == latest (``on_new_version = "continue"``: ≥ latest − k, and a request goes
   only to an instance holding a version in its window) ∧ that version is of the current lineage — its checksum is
   the one the trainer gave for that number (a trainer resumed from an older checkpoint starts a new lineage: an
   instance holding a version it never made, even a higher number, is not routed to and is told the new latest)
   ∧ not draining ∧ (preemptible, or reserved while seeding is open or no preemptible instance is routable — the co-located fallback, which the first preemptible instance
   ready ends: the reserved engines release their unfinished responses to the remote pool). The reserved engines
   share the trainer's devices: they take only work of the step the trainer trains (or seeds), never of a step
   submitted ahead (bounded staleness), so they never generate while the trainer trains another step.
7. Busy is not dead, dead is not alive (:class:`InstanceState`, one transition function): an instance silent past
   ``heartbeat_timeout_s`` (instances heartbeat from a thread that does nothing else, so weight loads and engine
   steps of any length never silence them) becomes SUSPECT at once — out of routing, its unfinished responses
   migrate (tokens already received are kept; whatever it sends later for them is counted late and dropped).
   A suspect that speaks again under the same identity returns without re-registering: to READY when it holds
   the latest version (else to PULLING, told the latest version), and is told to release what was taken from
   it. It is GONE (and told to register anew if it ever speaks again) only after ``instance_expiry_s`` of
   silence, or when it deregisters; a gone attempt leaves the registry and only its identity is kept (the last
   ``ENDED_KEPT``), so it can never register again. Before its deadline, an instance silent for
   ``dispatch_silence_s`` gets no new work (it keeps what it runs).
5. Resumed budget: a migrated request continues from prompt + generated ids with ``Work.tokens_left`` =
   ``max_new_tokens − generated`` (``max_new_tokens`` is always the original budget; what is left is
   ``tokens_left``); a delta that would exceed the budget is rejected.
8. Trajectories (multi-turn): the manager owns every turn and observation as token ids; an instance only ever
   generates the current turn (its prompt: the original prompt + earlier turns and observations; its budget: what
   the turn and the trajectory have left, invariant 5 per turn). A turn that ends with a tool-call stop id waits
   for the environment (``ENV_PEER``, in the manager's own process), owned by no instance; its observation is
   appended and the next turn queued first. A trajectory is unfinished while it waits, so the version never
   changes under it (invariant 1).
6. Continuous balancing (``policy.dispatch.Balancer``): every ``balance_every_s`` the manager
   feeds each routable preemptible instance's measured decode rate at its running batch into that instance's
   plateau estimator (always: the learned peaks measure remote work for the step observation,
   ``policy/observation.py``), and, only when a ``balancer`` is given, releases running requests beyond a donor's
   learned plateau (fewest generated tokens first) when another routable instance has headroom; released
   requests migrate per sample (invariant 5) and JSQ gives them to the least-loaded instance.
"""
from __future__ import annotations

import logging
from typing import Callable

from rlboost_hpc.observe.timeline import Activity, ActivityClock
from rlboost_hpc.policy.dispatch import Balancer, PlateauEstimator, RoundRobin
from rlboost_hpc.policy.relay import RelayTree
from rlboost_hpc.manager.state import Instance, InstanceState, VersionLineage
from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.assign import dispatch
from rlboost_hpc.manager.balance import balance
from rlboost_hpc.manager.fleet import Fleet
from rlboost_hpc.manager.instance_registry import InstanceRegistry
from rlboost_hpc.manager.request_book import RequestBook
from rlboost_hpc.manager.request_table import RequestTable
from rlboost_hpc.manager.restore import release_held
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.manager.step_account import StepAccount
from rlboost_hpc.manager.stats import ManagerDistributions, VersionServingClock, manager_stats
from rlboost_hpc.manager.trainer_calls import TrainerCalls
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import HeldOutEvaluation, ManagerCounters, ManagerStats, StepActivity

S = InstanceState

log = logging.getLogger("rlboost.manager")


class ManagerCore:
    """See the module docstring. ``clock`` returns seconds (monotonic). ``settings``: dispatch, liveness,
    streaming, balancing and relay (:class:`ManagerSettings`; its defaults when None). ``balancer``: a balancer of
    one's own (balancing on whatever ``settings.balance`` says). ``epoch``: this incarnation of the run's manager.
    ``alive_every_s``: seconds between Alive messages. ``environment``: an environment answers tool calls
    (multi-turn trajectories accepted).

    Raises:
        ValueError: an unknown ``settings.dispatch_policy``.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        settings: ManagerSettings | None = None,
        balancer: Balancer | None = None,
        epoch: int = 0,
        alive_every_s: float = 1.0,
        environment: bool = False,
    ) -> None:
        s = self.settings = settings if settings is not None else ManagerSettings()
        if s.dispatch_policy not in ("jsq", "round_robin"):
            raise ValueError(f"dispatch_policy must be 'jsq' or 'round_robin', not {s.dispatch_policy!r}")
        self.environment = environment
        self.epoch = epoch  # incarnation of the run's manager (manager/journal.py); 0 without a journal
        self.alive_every_s = alive_every_s
        self.on_version: Callable[[int], None] | None = None  # set by the service (manager/journal.py)
        # The balancer's rate learner always runs (its peak rates measure remote work for the observation law,
        # policy/observation.py); it moves work only when balancing is on.
        self.balancing = balancer is not None or s.balance
        self.balancer = balancer if balancer is not None else Balancer()
        self._last_balance: float | None = None
        self._rate_marks: dict[str, tuple[int, int]] = {}  # key -> (tokens_received, running) at the last tick
        # decode rate by batch over every preemptible instance (tokens/s per bucket): the simulator's calibration
        self.pool_rates = PlateauEstimator()
        self._last_alive = -1e9
        self._rr = RoundRobin()  # the ablation's rule, the same object the simulator uses
        # instance-seconds busy / idle / pulling, and when some engine was generating (told after every change)
        self.activity = ActivityClock()
        # each step's rollout (the observation law's records) and the trainer's step timeline (StepTimes)
        self.step_account = StepAccount(StepActivity(**self.activity.take()))
        self.dist = ManagerDistributions()  # pulls, steps, instance silences: bounded histograms
        self.version_serving = VersionServingClock()  # SetVersion → each live instance serving it
        self.clock = clock
        self.policy_decision: M.PolicyState | None = None  # the controller's last T_seed and N_prem cap
        self.heldout: dict[str, HeldOutEvaluation] = {}  # the run's held-out evaluations ("before", "after")
        self.outbox: list[tuple[bytes, M._Msg]] = []
        # the message handlers, each a collaborator that works on this core (the mediator) and the state owners it holds
        self.registry, self.table, self.trainer_calls = InstanceRegistry(self), RequestTable(self), TrainerCalls(self)
        self._handlers = {name[len("_on_"):]: getattr(part, name) for part in (self.registry, self.table,
                          self.trainer_calls) for name in dir(part) if name.startswith("_on_")}
        self.fleet = Fleet(self.registry.state_changed)  # the registered instances, their states, the ended ones
        self.book = RequestBook()  # the responses of the steps in flight, their GRPO groups and the queue
        # who speaks as the trainer (its peer; b"": none yet) and what its hello said, as the work log holds it: the
        # weight server, the assembly manifest of sharded versions (JSON; "" = one weight server), the trainer's
        # config.json and parsed ModelArch, a LoRA run's AdapterSpec (versions are adapters on its base)
        self.trainer = W.Hello(b"", "", "", {}, {})
        # the versions of the current trainer lineage and the latest (routing): a routable instance holds one of the
        # last k + 1 with on_new_version = "continue", else the latest
        self.lineage = VersionLineage(s.max_staleness if s.on_new_version == "continue" else 0)
        # who serves the latest version to whom (policy/relay.py); reserved instances pull in-process, never relay
        self.relay = RelayTree(fanout=s.relay_fanout, trainer_fanout=s.relay_trainer_fanout)
        self.step, self.seeding_open, self.failed_step, self.train_step = -1, False, None, -1  # failed_step: why it failed
        self.counters = ManagerCounters()  # every counter is a field: a misspelt one fails where it is used
        # crash recovery (manager/worklog.py, restore.py): records for the work log (None: not journaled), those since
        # the last compaction (bounded staleness), the last Tokens frame's responses whose delta was not applied, and
        # the unfinished responses a restarted manager holds for the instances that ran them, since held_since
        self.worklog: list[W.Record] | None = None
        self.held, self.held_since, self.since_compact, self.dropped = {}, None, [], []
        self.other_trainer = False  # a trainer other than the one the work log names said hello: its version rules

    # ------------------------------------------------------------------ helpers
    @property
    def trainer_peer(self) -> bytes | None:
        """The trainer's peer id (None: no trainer said hello)."""
        return self.trainer.peer or None

    def send(self, peer: bytes, msg: M._Msg) -> None:
        self.counters.messages_sent += 1
        self.outbox.append((peer, msg))

    def log_work(self, rec: W.Record) -> None:
        """Journal ``rec`` in the work log (when the manager keeps one; under bounded staleness also kept until the
        next compaction, which keeps the records of the steps still in flight)."""
        if self.worklog is not None:
            self.worklog.append(rec)
            if self.settings.max_staleness:
                self.since_compact.append(rec)

    # ------------------------------------------------------------------ routing (invariant 4)
    def serves(self, inst: Instance) -> bool:
        """Ready with a version new work may go to: the latest, or (``on_new_version = "continue"``) one of the
        k before it — of the current lineage (number and checksum: :class:`VersionLineage`), so an instance holding
        a version a resumed trainer never made is never routed to, whatever its number."""
        return inst.state == S.READY and self.lineage.holds(inst.identity)  # (held: within the lineage's window)

    def holds_latest(self, inst: Instance) -> bool:
        """``inst`` loaded the latest version of the current lineage (its number and its checksum)."""
        return self.lineage.is_latest(inst.identity)

    def routable(self, inst: Instance) -> bool:
        if not self.serves(inst):
            return False
        if inst.kind == "reserved":
            return self.seeding_open or not any(
                i.kind == "preemptible" and self.serves(i) for i in self.fleet.values())
        return True

    # ------------------------------------------------------------------ input
    def disconnected(self, peer: bytes) -> None:
        """The connection of ``peer`` is closed (the service found it unreachable): a live instance becomes
        suspect at once (invariant 7) — a killed process leaves routing without waiting for its silence. Not an
        instance restored after a manager restart: it is reconnecting (its silence deadline judges it)."""
        inst = self.fleet.of_peer(peer)
        if inst is not None and inst.state not in (S.SUSPECT, S.GONE) and not inst.restored:
            self.counters.connections_closed += 1
            self.registry.suspect(inst, "connection closed")

    def on_message(self, peer: bytes, msg: M._Msg) -> None:
        """Apply one decoded message from ``peer``. Unknown peers may only Register or speak as the trainer."""
        now = self.clock()
        self.counters.messages_received += 1
        inst = self.fleet.of_peer(peer)
        if inst is not None:
            if now - inst.last_seen > 2 * self.settings.heartbeat_s:  # it missed a heartbeat: how long it was silent
                self.dist.silence_seconds.observe(now - inst.last_seen)
            inst.last_seen, inst.spoke = now, True
            if inst.state == S.SUSPECT:
                self.registry.recover(inst)
        handler = self._handlers.get(type(msg).__name__)
        if handler is None:
            self.counters.protocol_rejects += 1
            log.warning("peer %r sent %s, which the manager does not accept", peer, type(msg).__name__)
            return
        handler(peer, inst, msg)

    # ------------------------------------------------------------------ instance-seconds, liveness, dispatch
    def _activity(self, inst: Instance) -> Activity | None:
        """What ``inst`` is doing now, for the instance-seconds (None: suspect, fenced, gone, or draining with
        nothing left in flight — not counted)."""
        if inst.state in (S.GONE, S.SUSPECT, S.FENCED):
            return None
        if inst.inflight:
            return Activity.BUSY
        if inst.state == S.PULLING or (inst.state == S.READY and not self.holds_latest(inst)):
            return Activity.PULLING
        return Activity.IDLE if inst.state == S.READY else None

    def note_activity(self, inst: Instance) -> None:
        """Tell the activity clock what ``inst`` does from now on. Called after every change of what
        :meth:`_activity` reads — the instance's state, version or responses in flight, and the latest version —
        so each interval is charged to the activity that held during it, at O(1) per change."""
        self.activity.set(inst.key, self._activity(inst), self.clock())

    def tick(self) -> None:
        """Liveness (invariant 7: silent → suspect; suspect past the expiry → gone), then dispatch queued requests
        (JSQ with Θ)."""
        now = self.clock()
        self.trainer_calls.end_fallback(now)
        for inst in list(self.fleet.values()):
            if inst.state == S.SUSPECT:
                if now - inst.suspect_since > self.settings.instance_expiry_s:
                    self.registry.instance_gone(inst, f"silent for {now - inst.last_seen:.1f}s", cause=None)
            elif inst.state != S.GONE and now - inst.last_seen > self.settings.heartbeat_timeout_s:
                self.registry.suspect(inst, f"no heartbeat for {now - inst.last_seen:.1f}s")
        balance(self, now)  # invariant 6
        release_held(self, now)
        if now - self._last_alive >= (0.1 if self.held else self.alive_every_s):  # (a restart: tell them soon)
            self._last_alive = now
            for inst in self.fleet.live():
                self.send(inst.peer, M.Alive(epoch=self.epoch))
        self.dispatch()

    def dispatch(self) -> None:
        """Give queued responses to routable instances (:func:`rlboost_hpc.manager.assign.dispatch`)."""
        dispatch(self)

    # ------------------------------------------------------------------ reporting

    def stats(self) -> ManagerStats:
        """Counters plus a snapshot of instances and queue: :func:`manager_stats` (instance-seconds charged up to
        now)."""
        self.activity.flush(self.clock())
        return manager_stats(self)
