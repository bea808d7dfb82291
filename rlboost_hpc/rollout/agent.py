"""The rollout agent: registers with the manager, pulls weights, serves requests, streams tokens, drains.

Runs in a preemptible worker process (``rlboost_hpc.rollout.worker``) or, for the reserved side's seeding,
in a thread of the trainer process. Invariants:
- Serves only after it loaded a complete, verified version equal to the manager's latest; a
  failed pull is reported with its cause and retried; the manager keeps the instance fenced meanwhile.
- Nothing produced is lost on a warning: on preemption/drain/release every token the engine produced is
  flushed before ``Released`` (ZeroMQ keeps per-connection order), so the manager resumes those responses
  from exactly where they stopped (``tokens_regenerated = 0`` for warned preemptions) — a manager restarted around
  the drain included: a warned end waits for the manager's ``Farewell`` and hands its responses to the restarted
  manager when the drain was lost with the old one (:meth:`RolloutAgent._await_farewell`).
- Weights change only while the engine is idle (the synchronous-RL policy for in-flight work);
  every load flushes the KV cache (inside the engine).
- Busy is not dead: the connection to the manager belongs to :class:`ManagerLink`, whose I/O thread does
  nothing else — it forwards what the agent sends, receives (noting when the manager last spoke) and sends
  the heartbeats — so a weight load or an engine step of any length never silences the instance, and the
  manager's silence is judged from frames already received, never from a loop that was busy. Pulls and the
  first engine build (an SGLang server start takes tens of seconds) run on one long-lived builder thread
  (long-lived because a server's PR_SET_PDEATHSIG is tied to the thread that started it). The engine is
  closed when the agent ends.
- Identity survives reconnects: the socket's ZeroMQ routing id is fixed for the agent's life
  (``job_id#attempt/<pid>-<nonce>``), so after a transparent reconnect (a TCP reset) the manager knows the
  instance as before; another process claiming the same (job, attempt) has another id and is refused.
- Every wait has a deadline: no Welcome within ``register_timeout_s`` → exit code 3 with a clear message; a
  manager silent for ``manager_timeout_s`` (it sends ``Alive`` every second) → exit code 3 too, so the worker
  can reconnect to a restarted run.
- An engine failure loses no token: a request whose stream fails alone (:class:`RequestError`) is handed back —
  its tokens, then ``RequestFailed`` — while the engine serves the rest; an engine that fails as a whole ends the
  agent with exit code 4 after flushing what it produced (the manager resumes those responses elsewhere).
- Weight versions are (manager epoch, version): after a manager restart (new epoch) an engine's weights count
  as unknown until a version of the new epoch is loaded, even if the version numbers happen to match — or until the
  restarted manager's ``Welcome`` names the version the engine holds with the engine's own whole-version checksum.
  Within an epoch a version is (number, checksum): the agent takes the manager's latest whenever it differs from what
  it holds, a lower number included (a trainer resumed from an older checkpoint: ``rollout/agent_weights.py``).
  An agent that hears a new epoch in ``Alive`` registers again under the same identity and keeps the responses it
  runs: a manager restarted from its work log knows it and takes them back at the length it logged.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.identity import instance_key
from rlboost_hpc.rollout.agent_responses import AgentResponses, ResponseTokens
from rlboost_hpc.rollout.agent_weights import WeightSlot, weights_loaded
from rlboost_hpc.rollout.engines.base import Engine, EngineError, RequestError
from rlboost_hpc.rollout.engines.factory import EngineFactory, torch_engine_factory
from rlboost_hpc.rollout.manager_link import ManagerLink
from rlboost_hpc.rollout.remote_weights import RemoteWeights
from rlboost_hpc.weights.source import PulledVersion, WeightSource

log = logging.getLogger("rlboost.agent")

EXIT_OK, EXIT_REJECTED, EXIT_UNREACHABLE, EXIT_FAILED = 0, 2, 3, 4

#: A manager that sent no frame for this long (seconds) is taken for dead by a drain (it sends ``Alive`` every
#: second to every registered instance).
MANAGER_SILENT_S = 2.5


class RolloutAgent:
    """One rollout instance. ``kind`` is ``"preemptible"`` or ``"reserved"``; identity = (job_id, attempt).

    Two collaborators own its state: :attr:`weight_slot` (:class:`~rlboost_hpc.rollout.agent_weights.WeightSlot`:
    the engine, the version wanted, pulls and loads) and :attr:`responses`
    (:class:`~rlboost_hpc.rollout.agent_responses.AgentResponses`); this class is the request loop: registration,
    the manager's messages, the engine steps, the deadlines, the drain."""

    def __init__(
        self,
        manager_endpoint: str,
        job_id: str,
        attempt: int = 0,
        *,
        kind: str = "preemptible",
        max_batch: int = D.MAX_BATCH,
        engine_factory: EngineFactory | None = None,
        weights: WeightSource | None = None,
        register_timeout_s: float = 15.0,
        manager_timeout_s: float = 10.0,
        node: str = "",
        ctx: zmq.Context | None = None,
        keys: RunKeys | None = None,
        engine_name: str = "torch",
        engine: Engine | None = None,
        engine_epoch: int | None = None,
        close_engine: bool = True,
        builder: ThreadPoolExecutor | None = None,
        fault_load_delay_s: float = 0.0,
        fault_slow_load: Callable[[], float] | None = None,
        relay_endpoint: str = "",
        relay_wait_s: float = D.RELAY_WAIT_S,
    ) -> None:
        self.manager_endpoint = manager_endpoint
        self.relay_endpoint = relay_endpoint  # where this instance serves the versions it holds ("" = it does not)
        self.on_ready: Callable[[dict[str, float]], None] | None = None  # told startup_phases() at the first token
        self.keys = keys
        self.job_id, self.attempt, self.kind = job_id, attempt, kind
        self.max_batch = max_batch
        self.engine_name = engine_name
        self.register_timeout_s = register_timeout_s
        self.manager_timeout_s = manager_timeout_s
        self.node = node or socket.gethostname()
        self.ctx = ctx or zmq.Context.instance()
        self.close_engine = close_engine
        self.stop_reason: str | None = None  # set (signal-safe) to drain and exit
        self.stop_cause: M.LeaveCause = "stopped"
        #: After a stop without a known cause, how long (seconds) the Deregister waits for a refining one — Slurm
        #: preempts with SIGTERM *and* the warning signal, in either order (the worker sets it under Slurm).
        self.cause_settle_s = 0.0
        #: true once nothing can refine a "stopped" cause any more (set by the worker's warning handler); the
        #: Deregister then waits no longer for it
        self.cause_settled: Callable[[], bool] = lambda: False
        #: Longest wait (seconds) of a warned end's drain for the manager's Farewell (:meth:`_await_farewell`).
        self.drain_confirm_s = D.DRAIN_CONFIRM_S
        self._run_ending = False  # the manager said Drain: the run ends, nothing to hand to a restarted manager
        self.welcome: M.Welcome | None = None
        self._own_builder = builder is None  # a caller's builder outlives this agent (worker reconnects)
        self._builder = builder or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"agent-{job_id}-pull")
        self._startup_logged = False
        self._asked_epoch = -1  # the restarted manager's epoch this agent registered again with
        self.timings: dict[str, float] = {"agent_start": time.time()}  # wall-clock seconds (comparable across processes)
        self.responses = AgentResponses(send=self._send, engine=lambda: self.weight_slot.engine,
                                        servable=lambda v: self.weight_slot.servable(v),
                                        held_version=lambda: self.weight_slot.held_version(),
                                        on_first_token=lambda: self.timings.setdefault("first_token", time.time()))
        self.weight_slot = WeightSlot(
            source=weights or RemoteWeights(D.WEIGHT_STREAMS, D.WEIGHT_WINDOW, D.PULL_TIMEOUT_S),
            engine_factory=engine_factory or torch_engine_factory(max_batch), keys=keys, builder=self._builder,
            send=self._send, welcome=lambda: self.welcome, wake=lambda: self.link.wake(), responses=self.responses,
            label=lambda: f"{self.job_id}#{self.attempt}",
            on_loaded=lambda: self.timings.setdefault("weights_loaded", time.time()), engine=engine,
            engine_epoch=engine_epoch, relay_wait_s=relay_wait_s, fault_load_delay_s=fault_load_delay_s,
            fault_slow_load=fault_slow_load)

    @property
    def engine(self) -> Engine | None:
        """The engine (the weight slot's; None before the first pull built it)."""
        return self.weight_slot.engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self.weight_slot.engine = engine

    @property
    def engine_epoch(self) -> int | None:
        """The manager epoch the engine's weights were loaded in (the weight slot's)."""
        return self.weight_slot.engine_epoch

    @engine_epoch.setter
    def engine_epoch(self, epoch: int | None) -> None:
        self.weight_slot.engine_epoch = epoch

    def held_version(self) -> int:
        """The version the engine holds in the current manager epoch (-1: none; :meth:`WeightSlot.held_version`)."""
        return self.weight_slot.held_version()

    @property
    def tokens_generated(self) -> int:
        """Every token this instance produced."""
        return self.responses.tokens_generated

    @property
    def tokens_handed_off(self) -> int:
        """Response tokens of unfinished responses handed back (released)."""
        return self.responses.tokens_handed_off

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str, cause: M.LeaveCause = "stopped") -> None:
        """Ask the agent to drain and exit (safe from a signal handler or another thread). ``cause`` is the
        counted kind of end its Deregister carries; the first request wins, except that a cause refines
        ``"stopped"`` until the Deregister is sent (see :attr:`cause_settle_s`) — and its ``reason`` with it, so the
        manager never logs "stopped (SIGTERM)" for an end it counts as a preemption."""
        if self.stop_reason is None:
            self.stop_cause = cause
            self.stop_reason = reason
        elif self.stop_cause == "stopped" and cause != "stopped":
            self.stop_cause, self.stop_reason = cause, reason

    def _send(self, msg: M._Msg) -> None:
        self.link.send(M.encode(msg))

    def _heartbeat_frame(self) -> bytes:
        """The heartbeat (built on the link's I/O thread: plain attribute reads only — never an engine call,
        which may hold the engine's lock through a long weight load)."""
        eng = self.engine
        return M.encode(M.Heartbeat(version=self.held_version(), active=self.responses.active,
                                    tokens_generated=self.tokens_generated,
                                    modelled_s=float(getattr(eng, "modelled_wall_seconds", 0.0)),
                                    late_s=float(getattr(eng, "late_seconds", 0.0))))

    def startup_phases(self) -> dict[str, float]:
        """Seconds spent in each start-up phase: process start → agent start (interpreter, imports) →
        Welcome (registration) → weights loaded (pull + verify + load) → first token produced."""
        spawned = os.environ.get("RLBOOST_SPAWNED_AT")  # wall time set by the spawner (precise)
        if spawned is None:
            import psutil

            spawned = psutil.Process().create_time()  # kernel start time (coarse: clock-tick resolution)
        t = dict(self.timings, process_start=float(spawned))
        order = ["process_start", "agent_start", "welcome", "weights_loaded", "first_token"]
        out = {}
        for a, b in zip(order, order[1:]):
            if a in t and b in t:
                out[f"{a}->{b}_s"] = round(t[b] - t[a], 4)
        return out

    def _drain(self, reason: str) -> None:
        if self._confirms_drain():
            self._await_manager()
        self._send(M.Draining(reason=reason))
        rids = self.responses.running()
        handed = self.responses.release(rids)
        settle = time.monotonic() + self.cause_settle_s
        while self.stop_cause == "stopped" and time.monotonic() < settle and not self.cause_settled():
            time.sleep(0.01)  # a warning signal, or Slurm's word that the job is being preempted, may refine it
        self.link.heartbeat_s = None  # no heartbeat after the Deregister: the manager would warn of a stranger
        self._send(self._deregister())
        if self._confirms_drain() and self.stop_cause != "stopped":
            self._await_farewell(rids, handed)

    def _confirms_drain(self) -> bool:
        """Whether this drain hands its responses to a manager that may have died meanwhile: a preemptible
        instance's, registered, not ended by the manager's own ``Drain`` (the run's end)."""
        return self.kind == "preemptible" and self.welcome is not None and not self._run_ending

    def _await_manager(self) -> None:
        """A drain that finds the manager silent (no frame for :data:`MANAGER_SILENT_S`: it sends ``Alive`` every
        second) waits up to :attr:`drain_confirm_s` for the manager restarted on the same address, handling its
        frames as usual — its ``Alive`` of a new epoch is answered by registering again, its ``Welcome`` by the
        resend — so the responses are then handed to a manager that hears them, not queued for a dead one. A
        manager that was only slow ends the wait when it speaks again; a restarted one when it answered the new
        registration."""
        if time.monotonic() - self.link.last_rx < MANAGER_SILENT_S:
            return
        t0 = time.monotonic()
        log.warning("draining while the manager is silent (%.1fs): waiting up to %.0fs for it to restart",
                    t0 - self.link.last_rx, self.drain_confirm_s)
        while not self._run_ending and time.monotonic() < t0 + self.drain_confirm_s:
            if time.monotonic() - self.link.last_rx < MANAGER_SILENT_S and self._asked_epoch <= self.welcome.epoch:
                log.info("the manager (epoch %d) answers again after %.1fs; draining", self.welcome.epoch,
                         time.monotonic() - t0)
                return
            for frame in self.link.take(0.05):
                try:
                    self._handle(M.decode(frame))
                except ProtocolError as e:
                    log.warning("bad frame from manager dropped: %s", e)
                except _Rejected as e:  # it does not know this instance: nothing of it to hand back there
                    log.warning("the manager does not know this draining instance (%s)", e)
                    return

    def _deregister(self) -> M.Deregister:
        return M.Deregister(reason=self.stop_reason or "stopped", tokens_generated=self.tokens_generated,
                            cause=self.stop_cause)  # (the reason of the cause as refined meanwhile)

    def _await_farewell(self, rids: list[str], handed: dict[str, ResponseTokens]) -> None:
        """A warned end (preempted, time limit, drained) waits up to :attr:`drain_confirm_s` for the manager's
        ``Farewell`` before the process exits, so the responses it handed back migrate even when the manager dies
        around the drain: frames queued while it was down reach the manager restarted on the same address (ZeroMQ
        reconnects), and a restarted manager that never applied the Deregister — it still knows the instance, so
        it sends ``Alive`` with its new epoch — is answered by registering again, resending every token of the
        handed-back responses ``rids`` (``handed``: what was sent of each, from its assigned offset) and of those
        finished lately, then ``Released`` and ``Deregister`` again. A ``Reject`` (the manager does not know the
        instance: it resumes those responses from what its log holds) ends the wait too; so does the deadline."""
        deadline, epoch = time.monotonic() + self.drain_confirm_s, self.welcome.epoch
        while time.monotonic() < deadline:
            for frame in self.link.take(0.05):
                try:
                    msg = M.decode(frame)
                except ProtocolError:
                    continue
                if isinstance(msg, M.Farewell):
                    log.info("the manager (epoch %d) confirmed the drain of %d responses", epoch, len(rids))
                    return
                if isinstance(msg, M.Reject):
                    log.warning("the manager does not know this draining instance (%s)", msg.reason)
                    return
                if isinstance(msg, M.Alive) and msg.epoch != epoch:
                    log.warning("manager restarted (epoch %d → %d) during the drain; handing %d responses back to "
                                "it", epoch, msg.epoch, len(rids))
                    epoch = msg.epoch
                    self._send(self._register())
                elif isinstance(msg, M.Welcome) and msg.epoch == epoch:
                    self.welcome = msg
                    if msg.resend:
                        self.responses.resend(handed)
                    self._send(M.Draining(reason=self.stop_reason or "stopped"))
                    self._send(M.Released(rids=rids, tokens_generated=self.tokens_generated))
                    self._send(self._deregister())
        log.warning("no Farewell from the manager within %.0fs of the drain: it resumes the %d responses handed back "
                    "from what it received", self.drain_confirm_s, len(rids))

    # ------------------------------------------------------------------ messages
    def _handle(self, msg: M._Msg) -> None:
        if isinstance(msg, M.Welcome):
            if (self.engine is not None and self.engine_epoch != msg.epoch and msg.latest_checksum
                    and VersionId(self.engine.version, self.engine.weights_checksum) == msg.latest):
                # a restarted manager confirms the version these weights are (its checksum): keep them
                log.info("manager epoch %d confirms version %d held since epoch %s", msg.epoch, msg.latest_version,
                         self.engine_epoch)
                self.engine_epoch = msg.epoch
            self.welcome = msg
            self.link.heartbeat_s = msg.heartbeat_s
            if msg.resend:
                self.responses.resend()
            self.weight_slot.want_version(msg.latest, msg.peers, msg.wait, (msg.weights_endpoint, msg.weights_shards))
            # a re-registration with the same weights: they count as loaded at once
            if self.held_version() == msg.latest_version >= 0 and not self.weight_slot.stale():
                self._send(weights_loaded(self.engine.version, PulledVersion({}, self.engine.weights_checksum), 0.0))
            self.timings.setdefault("welcome", time.time())
        elif isinstance(msg, M.Assign):
            self.responses.assign(msg.works)
        elif isinstance(msg, M.Release):
            self.responses.release(msg.rids)
        elif isinstance(msg, M.NewVersion):
            self.weight_slot.want_version(msg.identity, msg.peers, msg.wait,
                                          (msg.weights_endpoint, msg.weights_shards))
        elif isinstance(msg, M.PullFrom):
            self.weight_slot.pull_from(msg.identity, msg.peers)
        elif isinstance(msg, M.Alive):
            if self.welcome is not None and msg.epoch != self.welcome.epoch and msg.epoch != self._asked_epoch:
                # the manager restarted (it knows us from its work log): register again under the same identity,
                # keeping the responses in flight (the restarted manager takes them back at their logged length)
                log.warning("manager restarted (epoch %d → %d); registering again", self.welcome.epoch, msg.epoch)
                self._asked_epoch = msg.epoch
                self._send(self._register())
        elif isinstance(msg, M.Drain):
            self._run_ending = True
            self.request_stop(f"drain: {msg.reason}", "stopped")  # the run ends (manager shutdown)
        elif isinstance(msg, M.Reject):
            # the reserved engine must stay available (co-located fallback): a manager that declared it lost, or —
            # restored from the work log of a run that ended and is now continued — remembers its identity as an
            # ended attempt, is answered with the next attempt
            if self.kind == "reserved":
                self._reregister(msg.reason)
            else:
                raise _Rejected(msg.reason)
        else:
            log.warning("agent ignored unexpected %s", type(msg).__name__)

    def _reregister(self, reason: str) -> None:
        """The manager no longer knows us (it declared us lost and migrated our work): drop local work and
        register again as a new attempt (never merging with the old identity). Used by the reserved
        engine, which must stay available for co-located fallback; preemptible workers exit instead."""
        log.warning("instance %s#%d unknown to the manager (%s); registering as attempt %d",
                    self.job_id, self.attempt, reason, self.attempt + 1)
        self.responses.drop_all()  # the manager already resumed these elsewhere
        self.attempt += 1
        self.welcome = None
        self._t_reg = time.monotonic()
        self._send(self._register())

    def _register(self) -> M.Register:
        return M.Register(job_id=self.job_id, attempt=self.attempt, kind=self.kind, max_batch=self.max_batch,
                          host=socket.gethostname(), pid=os.getpid(), node=self.node, engine=self.engine_name,
                          relay_endpoint=self.relay_endpoint)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Serve until stopped. Returns an exit code (EXIT_*)."""
        # one routing id per process life: kept across reconnects, distinct for another process claiming the
        # same (job, attempt) (which the manager then refuses as a duplicate registration)
        ident = f"{instance_key(self.job_id, self.attempt)}/{os.getpid()}-{os.urandom(3).hex()}".encode()
        self.link = ManagerLink(self.ctx, self.manager_endpoint, self.keys, ident, self._heartbeat_frame)
        try:
            return self._loop()
        except _Rejected as e:
            log.error("manager rejected %s#%d: %s", self.job_id, self.attempt, e)
            return EXIT_REJECTED
        except EngineError as e:  # the engine as a whole broke (server died, stalled): leave, losing no token
            log.error("engine of %s#%d failed; leaving: %s", self.job_id, self.attempt, e)
            try:
                self.responses.flush()  # what it produced before: the manager resumes those responses elsewhere
            except Exception as fe:  # noqa: BLE001 - the link may be gone too; the manager then has what it has
                log.warning("could not send the last tokens: %s", fe)
            return EXIT_FAILED
        finally:
            self.link.close()
            if self._own_builder:
                self._builder.shutdown(wait=False, cancel_futures=True)
            if self.engine is not None and self.close_engine:
                self.engine.close()

    def _loop(self) -> int:
        self._send(self._register())
        self._t_reg = time.monotonic()
        last_flush = 0.0
        steps_since_flush = 0
        while True:
            if self.stop_reason is not None:
                # Registered or not yet answered: deregister either way. The manager handles frames of one
                # connection in order, so a Deregister right behind a Register it has not answered yet still
                # removes the instance it creates (a warning while starting is a warned preemption too).
                self._drain(self.stop_reason)
                return EXIT_OK
            busy = self.engine is not None and self.engine.num_active > 0
            for frame in self.link.take(0.0 if busy else 0.02):  # what arrived, before judging silence
                try:
                    msg = M.decode(frame)
                except ProtocolError as e:
                    log.warning("bad frame from manager dropped: %s", e)
                    continue
                self._handle(msg)
            now = time.monotonic()
            if self.welcome is None and now - self._t_reg > self.register_timeout_s:
                log.error("no answer from manager %s within %.0fs", self.manager_endpoint, self.register_timeout_s)
                return EXIT_UNREACHABLE
            if self.welcome is not None and now - self.link.last_rx > self.manager_timeout_s:
                log.error("manager %s silent for %.0fs; exiting", self.manager_endpoint, now - self.link.last_rx)
                return EXIT_UNREACHABLE
            if self.welcome is None:
                continue
            if self.engine is not None and self.engine.num_active:
                try:
                    events = self.engine.step()
                except RequestError as e:
                    self.responses.hand_back_failed(e.rid, str(e))
                    continue
                done = self.responses.on_events(events)
                steps_since_flush += 1
                now = time.monotonic()
                if steps_since_flush >= self.welcome.stream_every_tokens or \
                        now - last_flush >= self.welcome.stream_every_s:
                    self.responses.flush()
                    last_flush, steps_since_flush = now, 0
                elif done:
                    self.responses.flush(only_finished=True)
            elif self.responses.has_pending:
                self.responses.flush()
            if "first_token" in self.timings and not self._startup_logged:
                self._startup_logged = True
                log.info("startup phases %s", json.dumps(self.startup_phases()))
                if self.on_ready is not None:
                    self.on_ready(self.startup_phases())
            self.weight_slot.step()


class _Rejected(Exception):
    pass
