"""The rollout manager's state machine: instance registry + token-level request table + dispatch.

Pure logic, no sockets: messages go in through :meth:`ManagerCore.on_message`, time through an injected
clock, and replies accumulate in :attr:`ManagerCore.outbox` as ``(peer, message)`` pairs that the service
sends. Holds no policy arithmetic (T_seed, N_prem live in ``policy/``).

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
   only to an instance holding a version in its window) ∧ not draining ∧ (preemptible, or reserved while seeding is
   open or no preemptible instance is routable — the co-located fallback, which the first preemptible instance
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
from collections import deque
from typing import Callable

from rlboost_hpc.observe.timeline import Activity, ActivityClock
from rlboost_hpc.policy.dispatch import Balancer, PlateauEstimator, RoundRobin
from rlboost_hpc.policy.relay import RelayTree, Source
from rlboost_hpc.manager.state import (ALLOWED_TRANSITIONS, ENV_PEER, Group, Instance, InstanceState, Request,
                                       RequestState, StepWork)
from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.assign import dispatch
from rlboost_hpc.manager.balance import balance
from rlboost_hpc.manager.restore import adopt, release_held, take_over, unsent_tokens
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.manager.stats import ManagerDistributions, VersionServingClock, manager_stats
from rlboost_hpc.manager.trainer_calls import TrainerCalls
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import ManagerCounters, ManagerStats, StepActivity, StepRemote

S, R = InstanceState, RequestState

log = logging.getLogger("rlboost.manager")


#: Identities of ended attempts the manager remembers (≈ 150 bytes each), to reject their re-registration: the
#: oldest is forgotten first. A requeued job registers under a new attempt number, so only a process stopped for
#: longer than this many other attempts took to end could ever register under a forgotten identity.
ENDED_KEPT = 100_000

#: The counter of each kind of warned end (``Deregister.cause``): one definition, shared by the report and
#: Prometheus.
_LEAVE_COUNTER = {"preempted": "instances_preempted_with_warning", "time_limit": "instances_time_limit",
                  "drained": "instances_drained", "stopped": "instances_drained"}


class ManagerCore(TrainerCalls):
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
        self.dispatch_policy = s.dispatch_policy
        self.environment = environment
        self.epoch = epoch  # incarnation of the run's manager (manager/journal.py); 0 without a journal
        self.alive_every_s = alive_every_s
        # bounded staleness: k; a routable instance holds at least latest − route_lag (k with "continue", else 0)
        self.max_staleness, self.on_new_version, self.route_lag = s.max_staleness, s.on_new_version, (
            s.max_staleness if s.on_new_version == "continue" else 0)
        self.on_version: Callable[[int], None] | None = None  # set by the service (manager/journal.py)
        # The balancer's rate learner always runs (its peak rates measure remote work for the observation law,
        # policy/observation.py); it moves work only when balancing is on.
        self.balancing = balancer is not None or s.balance
        self.balancer = balancer if balancer is not None else Balancer()
        self.balance_every_s = s.balance_every_s
        self._last_balance: float | None = None
        self._rate_marks: dict[str, tuple[int, int]] = {}  # key -> (tokens_received, running) at the last tick
        # decode rate by batch over every preemptible instance (tokens/s per bucket): the simulator's calibration
        self.pool_rates = PlateauEstimator()
        self._last_alive = -1e9
        self._rr = RoundRobin()  # the ablation's rule, the same object the simulator uses
        # per-step view of the preemptible pool (the observation law's records), when its last response completed
        self.step_remote: dict[str, StepWork] = {}
        self.step_rollout_done_at: float | None = None
        self.fallback_since, self.step_fallback_s = None, 0.0  # the step's co-located fallback (StepRemote.fallback_s)
        self.last_step_remote = StepRemote()
        # instance-seconds busy / idle / pulling, and when some engine was generating (told after every change)
        self.activity = ActivityClock()
        self.step_done_s: list[float] = []  # when each of the step's responses completed (the tail's figure)
        self.last_step_activity = StepActivity(**self.activity.take())
        # the trainer's step timeline (StepTimes): wall time per step, seconds per phase and fixed overhead, summed
        self.dist = ManagerDistributions()  # pulls, steps, instance silences: bounded histograms
        self.version_serving = VersionServingClock()  # SetVersion → each live instance serving it
        self.step_phase_s, self.step_fixed_overhead_s = {}, 0.0
        self.last_step_mismatch: dict[str, float] = {}  # the trainer's engine–trainer mismatch of its last step
        self.clock = clock
        self.policy_decision: M.PolicyState | None = None  # the controller's last T_seed and N_prem cap
        self._told_unknown: dict[bytes, float] = {}
        self.pending_limit = s.pending_limit
        self.heartbeat_s, self.heartbeat_timeout_s = s.heartbeat_s, s.heartbeat_timeout_s
        self.instance_expiry_s, self.dispatch_silence_s = s.instance_expiry_s, s.dispatch_silence_s
        self.max_attempts = s.max_attempts
        self.stream_every_tokens, self.stream_every_s = s.stream_every_tokens, s.stream_every_s
        self.outbox: list[tuple[bytes, M._Msg]] = []
        self.instances: dict[str, Instance] = {}  # every instance not gone: what liveness and dispatch scan
        self.ended: dict[str, str] = {}  # identity → why, of the last ENDED_KEPT attempts that are gone (never scanned)
        self.by_peer: dict[bytes, str] = {}
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, Group] = {}
        self.queue: deque[str] = deque()
        self.trainer_peer: bytes | None = None
        self.weights_endpoint = ""
        self.weights_shards = ""  # the assembly manifest of sharded versions (JSON), "" = one weight server
        self.model_config, self.model_arch = {}, {}  # the trainer's config.json and parsed ModelArch
        self.latest_version = -1
        self.latest_checksum = 0  # whole-version checksum of latest_version's manifest (0: not given)
        # who serves the latest version to whom (policy/relay.py); reserved instances pull in-process, never relay
        self.relay = RelayTree(fanout=s.relay_fanout, trainer_fanout=s.relay_trainer_fanout)
        self.step, self.seeding_open, self.failed_step, self.train_step = -1, False, None, -1  # failed_step: why it failed
        self.counters = ManagerCounters()  # every counter is a field: a misspelt one fails where it is used
        self.migrations_by_turn: dict[str, int] = {}  # partial responses migrated, by the turn they were in
        self.responses_truncated_by_cause: dict[str, int] = {}  # finished responses cut by a budget (M.TRUNCATION_CAUSES)
        # partial responses handed off by / resumed on instances of each engine kind ("torch", "sglang")
        self.migrations_by_engine: dict[str, dict[str, int]] = {"out_of": {}, "into": {}}
        # crash recovery (manager/worklog.py, restore.py): records for the work log (None: not journaled), those since
        # the last compaction (bounded staleness), the last Tokens frame's responses whose delta was not applied, and
        # the unfinished responses a restarted manager holds for the instances that ran them, since held_since
        self.worklog: list[W.Record] | None = None
        self.held, self.held_since, self.since_compact, self.dropped = {}, None, [], []

    # ------------------------------------------------------------------ helpers
    def send(self, peer: bytes, msg: M._Msg) -> None:
        self.counters.messages_sent += 1
        self.outbox.append((peer, msg))

    def log_work(self, rec: W.Record) -> None:
        """Journal ``rec`` in the work log (when the manager keeps one; under bounded staleness also kept until the
        next compaction, which keeps the records of the steps still in flight)."""
        if self.worklog is not None:
            self.worklog.append(rec)
            if self.max_staleness:
                self.since_compact.append(rec)

    def serves(self, inst: Instance) -> bool:
        """Ready with a version new work may go to: the latest, or (``on_new_version = "continue"``) one of the
        k before it."""
        return inst.state == S.READY and inst.version >= self.latest_version - self.route_lag

    def routable(self, inst: Instance) -> bool:
        if not self.serves(inst):
            return False
        if inst.kind == "reserved":
            return self.seeding_open or not any(
                i.kind == "preemptible" and self.serves(i) for i in self.instances.values())
        return True

    def live_instances(self) -> list[Instance]:
        """Instances that still talk to us (not gone; a suspect is not presumed alive)."""
        return [i for i in self.instances.values() if i.state not in (S.GONE, S.SUSPECT)]

    def _set_state(self, inst: Instance, new: InstanceState) -> None:
        """The one place an instance's state changes (transitions in ``ALLOWED_TRANSITIONS``).

        Raises:
            RuntimeError: a transition the state machine does not have (a manager bug, never the peer's input).
        """
        if new == inst.state:
            return
        if new not in ALLOWED_TRANSITIONS[inst.state]:
            raise RuntimeError(f"instance {inst.key}: no transition {inst.state} → {new}")
        inst.state = new
        self._note_activity(inst)
        if new in (S.GONE, S.SUSPECT, S.FENCED, S.DRAINING):  # it neither serves nor needs relay capacity now
            self._hand_out(self.relay.gone(inst.key))

    def _pull_source(self, inst: Instance) -> Source:
        """Where ``inst`` fetches the latest version (relay); the trainer for reserved instances."""
        return self.relay.want(inst.key) if inst.kind == "preemptible" else Source()

    def _new_version(self, inst: Instance) -> None:
        src = self._pull_source(inst)
        self.send(inst.peer, M.NewVersion(version=self.latest_version, peers=list(src.peers), wait=src.wait))

    def _hand_out(self, handed: list[tuple[str, Source]]) -> None:
        for key, src in handed:
            i = self.instances.get(key)
            if i is not None:
                self.send(i.peer, M.PullFrom(version=self.latest_version, peers=list(src.peers)))

    def _suspect(self, inst: Instance, reason: str) -> None:
        """Invariant 7: out of routing now, its unfinished responses migrate; it may come back."""
        if inst.state in (S.SUSPECT, S.GONE):
            return
        taken = list(inst.inflight)
        self.counters.responses_assigned_to_vanished += sum(
            1 for rid in taken if rid in self.requests and self.requests[rid].assigned_at > inst.last_seen)
        for rid in taken:
            self._requeue(rid, inst, reason)
        inst.taken_back.update(taken)
        unsent = unsent_tokens(inst)
        self.counters.tokens_regenerated += unsent
        self.counters.instances_suspected += 1
        if inst.state == S.PULLING and inst.kind == "preemptible":
            self.counters.suspected_while_pulling += 1
        inst.suspect_from, inst.suspect_since = inst.state, self.clock()
        self._set_state(inst, S.SUSPECT)
        self.log_work(W.Silent(inst.key, True))
        log.info("instance %s suspect (%s); %d responses migrated, %d unsent tokens", inst.key, reason,
                 len(taken), unsent)

    def _recover(self, inst: Instance) -> None:
        """A suspect spoke again under its identity: back where it was, without re-registering."""
        self.log_work(W.Silent(inst.key, False))
        back = inst.suspect_from or S.PULLING
        if back in (S.DRAINING, S.FENCED):
            new = back
        elif inst.version == self.latest_version:
            new = S.READY
        else:
            new = S.PULLING
        self._set_state(inst, new)
        if new == S.PULLING:
            self._new_version(inst)
        self.counters.instances_recovered += 1
        if back == S.PULLING and inst.kind == "preemptible":
            self.counters.recovered_while_pulling += 1
        # Whatever it still generates for what was taken from it (now, or in an earlier silence whose Release may
        # have been lost with a connection) was resumed elsewhere: none of it is dispatched to it again until it
        # confirms (Released); the Release goes out again for all of it.
        inst.releasing |= inst.taken_back
        inst.taken_back.clear()
        if inst.releasing:
            self.send(inst.peer, M.Release(rids=sorted(inst.releasing)))
        log.info("instance %s answers again after %.1f s suspect; now %s", inst.key,
                 self.clock() - inst.suspect_since, new)

    def _requeue(self, rid: str, inst: Instance, why: str) -> None:
        """Take ``rid`` back from ``inst`` and put it at the head of the queue (a migration)."""
        req = self.requests.get(rid)
        inst.inflight.discard(rid)
        inst.releasing.discard(rid)
        self._note_activity(inst)
        if req is None or req.state != R.RUNNING or req.instance != inst.key:
            return
        req.move(R.QUEUED)
        req.migrations += 1
        self.counters.responses_migrated += 1
        if req.n:
            out = self.migrations_by_engine["out_of"]
            out[inst.engine] = out.get(inst.engine, 0) + 1
            t = str(req.turn)
            self.migrations_by_turn[t] = self.migrations_by_turn.get(t, 0) + 1
            # what restarting the interrupted turn / the whole trajectory would regenerate (the benchmark's
            # alternatives to resuming at the token)
            self.counters.tokens_in_interrupted_turns += req.n - req.turn_start
            self.counters.assistant_tokens_in_interrupted_trajectories += req.n - req.observation_tokens()
        self.counters.tokens_migrated += req.n
        self.queue.appendleft(rid)
        log.debug("migrating %s (%d tokens) off %s: %s", rid, req.n, inst.key, why)

    def _instance_gone(self, inst: Instance, reason: str, *, cause: str | None) -> None:
        """Remove ``inst`` for good: it deregistered (``cause``: its :data:`M.LeaveCause`), or a suspect expired
        (``cause=None``); unfinished responses resume elsewhere. A suspect's work and unsent tokens were
        accounted when it went silent."""
        if inst.state == S.GONE:
            return
        unsent = 0
        if inst.state != S.SUSPECT:
            for rid in list(inst.inflight):
                self._requeue(rid, inst, reason)
            unsent = unsent_tokens(inst)
            self.counters.tokens_regenerated += unsent
        if cause is not None:  # it deregistered: a warned end, counted by its kind
            self.counters.tokens_regenerated_after_warning += unsent
            field = _LEAVE_COUNTER[cause]
            setattr(self.counters, field, getattr(self.counters, field) + 1)
        else:
            self.counters.instances_expired += 1
        self._set_state(inst, S.GONE)
        self.activity.forget(inst.key)
        inst.gone_reason = reason
        self.by_peer.pop(inst.peer, None)
        self.log_work(W.Left(inst.key))
        # A gone attempt leaves the registry, so that nothing a week-long run does per tick or per dispatch grows
        # with the attempts that ever ran; its identity is remembered (bounded) so it can never register again.
        del self.instances[inst.key]
        self.ended[inst.key] = reason
        if len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]
        log.info("instance %s gone (%s); %d unsent tokens", inst.key, reason, unsent)

    def _fence(self, inst: Instance, reason: str) -> None:
        """Stop routing to ``inst`` and take its work back; it may recover only by loading the latest version."""
        if inst.state in (S.GONE, S.FENCED, S.SUSPECT):
            return
        taken = sorted(inst.inflight)
        for rid in taken:
            self._requeue(rid, inst, reason)
        inst.releasing.update(taken)  # not given back to it before it confirmed the Release below
        self._set_state(inst, S.FENCED)
        self.counters.instances_fenced += 1
        log.warning("instance %s fenced: %s", inst.key, reason)
        if taken:  # tell it to stop working on them; whatever it still sends is dropped as late
            self.send(inst.peer, M.Release(rids=taken))

    # ------------------------------------------------------------------ input
    def disconnected(self, peer: bytes) -> None:
        """The connection of ``peer`` is closed (the service found it unreachable): a live instance becomes
        suspect at once (invariant 7) — a killed process leaves routing without waiting for its silence. Not an
        instance restored after a manager restart: it is reconnecting (its silence deadline judges it)."""
        key = self.by_peer.get(peer)
        inst = self.instances.get(key) if key else None
        if inst is not None and inst.state not in (S.SUSPECT, S.GONE) and not inst.restored:
            self.counters.connections_closed += 1
            self._suspect(inst, "connection closed")

    def on_message(self, peer: bytes, msg: M._Msg) -> None:
        """Apply one decoded message from ``peer``. Unknown peers may only Register or speak as the trainer."""
        now = self.clock()
        self.counters.messages_received += 1
        key = self.by_peer.get(peer)
        inst = self.instances.get(key) if key else None
        if inst is not None:
            if now - inst.last_seen > 2 * self.heartbeat_s:  # it missed a heartbeat: how long it was silent
                self.dist.silence_seconds.observe(now - inst.last_seen)
            inst.last_seen, inst.spoke = now, True
            if inst.state == S.SUSPECT:
                self._recover(inst)
        handler = getattr(self, "_on_" + type(msg).__name__, None)
        if handler is None:
            self.counters.protocol_rejects += 1
            log.warning("peer %r sent %s, which the manager does not accept", peer, type(msg).__name__)
            return
        handler(peer, inst, msg)

    # agent messages ------------------------------------------------------------
    def _on_Register(self, peer: bytes, inst: Instance | None, msg: M.Register) -> None:
        key = f"{msg.job_id}#{msg.attempt}"
        existing = self.instances.get(key)
        if existing is not None and existing.peer != peer and not existing.spoke:  # its process, a new connection
            take_over(self, existing, peer)
        if existing is not None and existing.peer == peer:
            pass  # a retried Register from the same identity (a reconnect keeps it): answer again
        elif existing is not None or key in self.ended:
            self.counters.rejected_registrations += 1
            why = ("identity %s is already registered (live)" if existing is not None
                   else "identity %s belongs to an attempt that already ended; a requeued job must register "
                        "with a new attempt number")
            self.send(peer, M.Reject(reason=why % key))
            log.warning("rejected registration of %s from %r", key, peer)
            return
        else:
            now = self.clock()
            self.instances[key] = Instance(key=key, peer=peer, kind=msg.kind, max_batch=msg.max_batch,
                                           registered_at=now, last_seen=now, engine=msg.engine,
                                           relay_endpoint=msg.relay_endpoint)
            self.by_peer[peer] = key
            self.log_work(W.Joined(key, peer, msg.kind, msg.max_batch, msg.engine, msg.relay_endpoint))
            self.counters.registrations += 1
            self._note_activity(self.instances[key])
        inst = self.instances[key]
        src = self._pull_source(inst) if self.latest_version >= 0 and inst.version != self.latest_version \
            else Source()
        self.send(peer, M.Welcome(
            instance=key, latest_version=self.latest_version, weights_endpoint=self.weights_endpoint,
            model_config=self.model_config, model_arch=self.model_arch, heartbeat_s=self.heartbeat_s,
            stream_every_tokens=self.stream_every_tokens, stream_every_s=self.stream_every_s, epoch=self.epoch,
            peers=list(src.peers), wait=src.wait, weights_shards=self.weights_shards,
            latest_checksum=self.latest_checksum, resend=inst.restored, on_new_version=self.on_new_version))

    def _unknown(self, peer: bytes, what: str) -> None:
        """A message from a peer that is not (or no longer) a registered instance: drop it and tell the peer
        once a second, so an instance declared lost (e.g. starved of CPU past the heartbeat deadline) learns it
        and re-registers as a new attempt instead of talking into the void."""
        self.counters.protocol_rejects += 1
        now = self.clock()
        if now - self._told_unknown.get(peer, -1e9) >= 1.0:
            if len(self._told_unknown) > 10_000:
                self._told_unknown.clear()
            self._told_unknown[peer] = now
            log.warning("%s from unregistered peer %r dropped", what, peer)
            if peer != self.trainer_peer:
                self.send(peer, M.Reject(reason=f"unknown instance ({what} from a peer that is not registered: "
                                                "declared lost or never registered); register as a new attempt"))

    def _on_Heartbeat(self, peer: bytes, inst: Instance | None, msg: M.Heartbeat) -> None:
        if inst is None:
            return self._unknown(peer, "heartbeat")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)

    def _on_WeightsLoaded(self, peer: bytes, inst: Instance | None, msg: M.WeightsLoaded) -> None:
        if inst is None:
            return self._unknown(peer, "weights-loaded")
        self.counters.weight_loads += 1
        if msg.load_s > self.heartbeat_timeout_s:
            self.counters.slow_weight_loads += 1  # longer than the deadline: it had to keep heartbeating
        self.dist.pull_seconds.observe(msg.pull_s)
        if msg.wire_bytes >= msg.nbytes > 0:
            self.dist.full_pull_seconds.observe(msg.pull_s)
        self.counters.weight_pulled_bytes += msg.wire_bytes
        if msg.version == self.latest_version and self.latest_checksum and msg.checksum != self.latest_checksum:
            # bytes other than the trainer's export: never routable; it is asked to leave (a replacement pulls anew)
            self.counters.weight_checksum_mismatches += 1
            self.counters.weight_load_failures += 1
            reason = (f"loaded version {msg.version} with checksum {msg.checksum:x}, the trainer published "
                      f"{self.latest_checksum:x}")
            self._fence(inst, reason)
            self.send(inst.peer, M.Drain(reason=reason))
            return
        inst.version = msg.version
        delay = self.version_serving.loaded(inst.key, msg.version, self.clock())
        if delay is not None:
            self.dist.version_serving_seconds.observe(delay)
        self._note_activity(inst)
        if msg.version == self.latest_version and inst.kind == "preemptible":  # it holds it: it serves it too
            self._hand_out(self.relay.done(inst.key, inst.relay_endpoint))
        if inst.state in (S.PULLING, S.FENCED) and msg.version >= self.latest_version - self.route_lag:
            self._set_state(inst, S.READY)
            inst.ready_at = inst.ready_at or self.clock()
            if inst.kind == "preemptible" and not self.seeding_open:  # the end of a co-located fallback
                self.release_reserved()

    def _on_WeightsFailed(self, peer: bytes, inst: Instance | None, msg: M.WeightsFailed) -> None:
        if inst is None:
            return self._unknown(peer, "weights-failed")
        self.counters.weight_load_failures += 1
        log.warning("instance %s failed to load version %d: %s", inst.key, msg.version, msg.error)
        if inst.state == S.READY:
            self._fence(inst, f"weight load failed: {msg.error}")
        elif inst.state == S.PULLING:
            self._set_state(inst, S.FENCED)
            self.counters.instances_fenced += 1

    def _on_Tokens(self, peer: bytes, inst: Instance | None, msg: M.Tokens) -> None:
        """Append each delta to its request (the hot path: one frame carries many deltas)."""
        counts = msg.counts
        total = sum(counts)
        self.counters.tokens_received += total
        self.dropped = dropped = []  # responses whose delta was not applied (the work log's Frame.dropped)
        if inst is None:
            self.counters.late_tokens += total
            dropped += msg.rids
            return self._unknown(peer, "tokens")
        inst.tokens_received += total
        requests, key, latest = self.requests, inst.key, self.latest_version
        ids, lps = memoryview(msg.ids), memoryview(msg.logprobs)
        lo = late = 0
        for i, (rid, off, cnt, ver, fin) in enumerate(zip(msg.rids, msg.offsets, counts, msg.versions, msg.finish)):
            hi = lo + 4 * cnt
            req = requests.get(rid)
            if req is not None and req.instance != key and self.held:  # (after a restart: held for its instance)
                skip = adopt(self, req, inst, off, ids[lo:hi])  # tokens of the delta the work log already holds
                if skip:
                    lo, off, cnt, late = lo + 4 * skip, off + skip, cnt - skip, late + skip
            if req is None or req.instance != key or req.state != R.RUNNING:
                late += cnt
                dropped.append(rid)
            elif not req.version <= ver <= latest:  # (k = 0: ver == req.version == latest)
                self.counters.off_version_tokens_rejected += cnt
                self._fence(inst, f"sent {cnt} tokens of version {ver} for {rid} of version {req.version}"
                                  + (f"..{latest}" if self.max_staleness else ""))
                dropped += msg.rids[i:]
                break
            elif off + cnt > req.max_new_tokens or off + cnt > req.max_trajectory_tokens - req.turn_start:
                # (= past req.turn_budget(), spelt out: a method call per delta costs ~15 % of this loop)
                self._fence(inst, f"delta for {rid} at {off}+{cnt} exceeds the budget {req.turn_budget()}")
                dropped += msg.rids[i:]
                break
            elif req.turn_start + off != req.n:  # (offsets count from the turn's start) frames lost with a
                late += cnt  # connection: drop the rest, resume from what arrived once the instance released it
                dropped.append(rid)
                # (Released requeues it; never racing a re-dispatch)
                if rid not in inst.releasing:
                    self.counters.deltas_out_of_order += 1
                    inst.releasing.add(rid)
                    self.send(inst.peer, M.Release(rids=[rid]))
            else:
                req.ids += ids[lo:hi]
                req.logprobs += lps[lo:hi]
                req.n += cnt
                runs = req.runs
                if runs and runs[-2] == ver:
                    runs[-1] += cnt
                else:
                    runs += (ver, cnt)
                if fin:
                    inst.inflight.discard(rid)
                    inst.releasing.discard(rid)
                    self._note_activity(inst)
                    self._turn_done(req, fin)
            lo = hi
        self.counters.late_tokens += late
        if msg.resent:  # it sent all it holds: nothing more to adopt from it, nothing unsent (manager/restore.py)
            inst.restored, inst.tokens_received, inst.tokens_generated = False, msg.generated, msg.generated
        rec = self.step_remote.get(key)
        if rec is not None:
            rec.last_s = self.clock()
            rec.tokens += total - late

    def _turn_done(self, req: Request, fin: int) -> None:
        """An assistant turn finished: a tool call goes to the environment (the trajectory waits, owned by no
        instance), anything else finishes the response."""
        self.counters.turns_completed += 1
        if fin == M.FINISH_STOP and req.calls_tool():
            req.move(R.ENVIRONMENT)
            self.log_work(W.ToolCall(req.rid))
            self.counters.environment_calls += 1
            self.send(ENV_PEER, M.EnvCall(rid=req.rid, turn=req.turn, turn_ids=req.turn_ids()))
            return
        self._finish(req, req.end_reason(fin))

    def _finish(self, req: Request, reason: str) -> None:
        """``req`` is done for ``reason`` (one of ``M.FINISH_REASONS``; truncations counted by cause)."""
        req.move(R.DONE, finish_reason=reason)
        self.log_work(W.Finished(req.rid, reason))
        self.step_done_s.append(self.clock())
        if reason != "stop":
            self.responses_truncated_by_cause[reason] = self.responses_truncated_by_cause.get(reason, 0) + 1
        self._group_progress(req)

    def _on_EnvResult(self, peer: bytes, inst: Instance | None, msg: M.EnvResult) -> None:
        """The environment's observation for a trajectory's tool call: appended, and the next turn is queued
        first (it is the tail of its step); no room left for it and one more token finishes the trajectory."""
        if peer != ENV_PEER:
            return self._unknown(peer, "environment result")
        req = self.requests.get(msg.rid)
        if req is None or req.state != R.ENVIRONMENT or req.turn != msg.turn:
            self.counters.protocol_rejects += 1
            return
        self.counters.environment_seconds += msg.tool_s
        if msg.status != "ok":
            if msg.status == "error":
                self.counters.environment_errors += 1
            else:
                self.counters.environment_timeouts += 1
        if req.n + len(msg.obs_ids) // 4 >= req.max_trajectory_tokens or not msg.obs_ids:
            self._finish(req, "trajectory_budget" if msg.obs_ids else "environment_error")
            return
        self.counters.observation_tokens += len(msg.obs_ids) // 4
        req.append_observation(msg.obs_ids)
        self.log_work(W.Observation(req.rid, msg.obs_ids))
        req.move(R.QUEUED)
        self.queue.appendleft(req.rid)

    def _on_RequestFailed(self, peer: bytes, inst: Instance | None, msg: M.RequestFailed) -> None:
        if inst is None:
            return self._unknown(peer, "request-failed")
        self.counters.request_failures += 1
        req = self.requests.get(msg.rid)
        log.warning("instance %s failed request %s: %s", inst.key, msg.rid, msg.error)
        if req is not None and req.instance == inst.key and req.state == R.RUNNING:
            self._requeue(msg.rid, inst, "engine failure")
            if req.attempts >= self.max_attempts:
                self._fail_step(f"request {msg.rid} failed {req.attempts} times; last error: {msg.error}")

    def _on_Draining(self, peer: bytes, inst: Instance | None, msg: M.Draining) -> None:
        if inst is None:
            return self._unknown(peer, "draining")
        if inst.state != S.GONE:
            self._set_state(inst, S.DRAINING)

    def _on_Released(self, peer: bytes, inst: Instance | None, msg: M.Released) -> None:
        if inst is None:
            return self._unknown(peer, "released")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)
        self.counters.released_requests += len(msg.rids)
        for rid in msg.rids:
            self._requeue(rid, inst, "released")

    def _on_Deregister(self, peer: bytes, inst: Instance | None, msg: M.Deregister) -> None:
        if inst is None:
            return self._unknown(peer, "deregister")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)
        self._instance_gone(inst, f"deregistered: {msg.reason}", cause=msg.cause)

    def _activity(self, inst: Instance) -> Activity | None:
        """What ``inst`` is doing now, for the instance-seconds (None: suspect, fenced, gone, or draining with
        nothing left in flight — not counted)."""
        if inst.state in (S.GONE, S.SUSPECT, S.FENCED):
            return None
        if inst.inflight:
            return Activity.BUSY
        if inst.state == S.PULLING or (inst.state == S.READY and inst.version != self.latest_version):
            return Activity.PULLING
        return Activity.IDLE if inst.state == S.READY else None

    def _note_activity(self, inst: Instance) -> None:
        """Tell the activity clock what ``inst`` does from now on. Called after every change of what
        :meth:`_activity` reads — the instance's state, version or responses in flight, and the latest version —
        so each interval is charged to the activity that held during it, at O(1) per change."""
        self.activity.set(inst.key, self._activity(inst), self.clock())

    def tick(self) -> None:
        """Liveness (invariant 7: silent → suspect; suspect past the expiry → gone), then dispatch queued requests
        (JSQ with Θ)."""
        now = self.clock()
        self.end_fallback(now)
        for inst in list(self.instances.values()):
            if inst.state == S.SUSPECT:
                if now - inst.suspect_since > self.instance_expiry_s:
                    self._instance_gone(inst, f"silent for {now - inst.last_seen:.1f}s", cause=None)
            elif inst.state != S.GONE and now - inst.last_seen > self.heartbeat_timeout_s:
                self._suspect(inst, f"no heartbeat for {now - inst.last_seen:.1f}s")
        balance(self, now)  # invariant 6
        release_held(self, now)
        if now - self._last_alive >= (0.1 if self.held else self.alive_every_s):  # (a restart: tell them soon)
            self._last_alive = now
            for inst in self.instances.values():
                if inst.state not in (S.GONE, S.SUSPECT):
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
