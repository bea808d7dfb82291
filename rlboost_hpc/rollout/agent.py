"""The rollout agent: registers with the manager, pulls weights, serves requests, streams tokens, drains.

Runs in a preemptible worker process (``rlboost_hpc.rollout.worker``) or, for the reserved side's seeding,
in a thread of the trainer process. Invariants:
- Serves only after it loaded a complete, verified version equal to the manager's latest; a
  failed pull is reported with its cause and retried; the manager keeps the instance fenced meanwhile.
- Nothing produced is lost on a warning: on preemption/drain/release every token the engine produced is
  flushed before ``Released`` (ZeroMQ keeps per-connection order), so the manager resumes those responses
  from exactly where they stopped (``tokens_regenerated = 0`` for warned preemptions).
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
  An agent that hears a new epoch in ``Alive`` registers again under the same identity and keeps the responses it
  runs: a manager restarted from its work log knows it and takes them back at the length it logged.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys, secure_client
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.rollout.engines.base import Engine, EngineError, GenRequest, RequestError, SamplingParams
from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.rollout.engines.factory import EngineFactory, torch_engine_factory
from rlboost_hpc.rollout.remote_weights import PulledVersion, RemoteWeights, WeightSource

log = logging.getLogger("rlboost.agent")

EXIT_OK, EXIT_REJECTED, EXIT_UNREACHABLE, EXIT_FAILED = 0, 2, 3, 4

class ManagerLink:
    """The agent's ZeroMQ connection to the manager, owned by an I/O thread that does nothing else.

    The agent's thread queues frames with :meth:`send` (an inproc pipe wakes the I/O thread at once) and takes
    what arrived with :meth:`take`; the I/O thread forwards, receives into the inbox, records :attr:`last_rx`
    (monotonic seconds of the last frame from the manager) and, once :attr:`heartbeat_s` is set, sends
    ``heartbeat()`` every that many seconds — whatever the agent's thread is doing.

    Args:
        identity: the routing id, kept across reconnects.
        heartbeat: builds the heartbeat frame (called on the I/O thread: it must only read plain attributes).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: RunKeys | None, identity: bytes,
                 heartbeat: Callable[[], bytes]) -> None:
        self._ctx, self._endpoint, self._keys, self._identity = ctx, endpoint, keys, identity
        self._heartbeat = heartbeat
        self.heartbeat_s: float | None = None
        self.last_rx = time.monotonic()
        self._inbox: deque[bytes] = deque()
        self._woken = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pipe_addr = f"inproc://agent-link-{id(self):x}"
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.setsockopt(zmq.LINGER, 2000)
        self._rx = ctx.socket(zmq.PAIR)
        self._rx.bind(self._pipe_addr)
        self._tx.connect(self._pipe_addr)
        self._thread = threading.Thread(target=self._run, name=f"agent-link-{identity.decode(errors='replace')}",
                                        daemon=True)
        self._thread.start()

    def send(self, frame: bytes) -> None:
        """Queue ``frame`` for the manager (agent thread only)."""
        self._tx.send(frame)

    def take(self, wait_s: float = 0.0) -> list[bytes]:
        """Every frame received so far (waiting up to ``wait_s`` for one when there is none, unless
        :meth:`wake` was called since the last take)."""
        with self._cond:
            if not self._inbox and wait_s > 0 and not self._woken:
                self._cond.wait(wait_s)
            self._woken = False
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def wake(self) -> None:
        """End the agent's current (or next) :meth:`take` wait now: something other than a frame is ready
        (a finished weight pull), so the agent acts on it at once instead of after its idle wait."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        secure_client(sock, self._keys)
        sock.connect(self._endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._rx, zmq.POLLIN)
        outbox: deque[bytes] = deque()  # the agent's frames not yet accepted by the socket (never dropped)
        last_hb = 0.0
        try:
            while True:
                stopping = self._stop.is_set()
                hb = self.heartbeat_s
                wait = 0.05 if hb is None else max(0.0, min(0.05, last_hb + hb - time.monotonic()))
                events = dict(poller.poll(0 if stopping else int(wait * 1000)))
                if self._rx in events or stopping:
                    while True:
                        try:
                            outbox.append(self._rx.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                while outbox:  # in order; a full queue (the manager unreachable) never blocks this thread
                    try:
                        sock.send(outbox[0], zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    outbox.popleft()
                if stopping:
                    return
                if sock in events:
                    got = []
                    while True:
                        try:
                            got.append(sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                    if got:
                        self.last_rx = time.monotonic()
                        with self._cond:
                            self._inbox.extend(got)
                            self._cond.notify_all()
                hb = self.heartbeat_s
                if hb is not None and time.monotonic() - last_hb >= hb:
                    last_hb = time.monotonic()
                    if not outbox:  # (behind a backlog a heartbeat would only add to it)
                        try:
                            sock.send(self._heartbeat(), zmq.NOBLOCK)
                        except zmq.Again:
                            pass
        finally:
            sock.close(linger=2000)  # flushes what was sent last (the drain's Released / Deregister)

    def close(self) -> None:
        """Forward what is queued, stop the I/O thread and close the sockets (agent thread only)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._tx.close(linger=0)
        self._rx.close(linger=0)


def _weights_loaded(version: int, got: PulledVersion, load_s: float) -> M.WeightsLoaded:
    """The one place a ``WeightsLoaded`` is built: ``version`` loaded from ``got`` in ``load_s`` seconds (engine
    build or load; 0 for a re-registration that moved nothing)."""
    return M.WeightsLoaded(version=version, checksum=got.checksum, nbytes=got.nbytes, pull_s=got.pull_s,
                           load_s=load_s, wire_bytes=got.wire_bytes)


#: Seconds an agent keeps the tokens of a finished response for a restarted manager's resend (longer than a manager
#: restart: its death noticed, a new process started, the instance registered again).
RESEND_KEEP_S = 10.0


@dataclass
class _Pending:
    offset: int
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: int = M.FINISH_NONE


class RolloutAgent:
    """One rollout instance. ``kind`` is ``"preemptible"`` or ``"reserved"``; identity = (job_id, attempt)."""

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
        relay_endpoint: str = "",
        relay_wait_s: float = D.RELAY_WAIT_S,
    ) -> None:
        self.manager_endpoint = manager_endpoint
        self.relay_endpoint = relay_endpoint  # where this instance serves the versions it holds ("" = it does not)
        self.relay_wait_s = relay_wait_s  # longest wait for relay capacity before pulling from the trainer
        self.on_ready: Callable[[dict[str, float]], None] | None = None  # told startup_phases() at the first token
        self.want_peers: list[str] = []
        self.keys = keys
        self.job_id, self.attempt, self.kind = job_id, attempt, kind
        self.max_batch = max_batch
        self.engine_factory = engine_factory or torch_engine_factory(max_batch)
        self.engine_name = engine_name
        self.weights: WeightSource = weights or RemoteWeights(D.WEIGHT_STREAMS, D.WEIGHT_WINDOW, D.PULL_TIMEOUT_S)
        self.register_timeout_s = register_timeout_s
        self.manager_timeout_s = manager_timeout_s
        self.node = node or socket.gethostname()
        self.ctx = ctx or zmq.Context.instance()
        self.engine: Engine | None = engine  # an engine kept from a previous connection (worker reconnect)
        self.engine_epoch = engine_epoch  # manager epoch of the engine's weights (versions are (epoch, version))
        self.close_engine = close_engine
        self.fault_load_delay_s = fault_load_delay_s  # chaos: weight loads slower than the heartbeat deadline
        self.tokens_generated = 0
        self.tokens_handed_off = 0  # response tokens of unfinished requests handed back (released)
        self.stop_reason: str | None = None  # set (signal-safe) to drain and exit
        self.stop_cause: M.LeaveCause = "stopped"
        #: After a stop without a known cause, how long (seconds) the Deregister waits for a refining one — Slurm
        #: preempts with SIGTERM *and* the warning signal, in either order (the worker sets it under Slurm).
        self.cause_settle_s = 0.0
        #: true once nothing can refine a "stopped" cause any more (set by the worker's warning handler); the
        #: Deregister then waits no longer for it
        self.cause_settled: Callable[[], bool] = lambda: False
        self.welcome: M.Welcome | None = None
        self.want_version = -1
        self._pos: dict[str, int] = {}
        self._gen: dict[str, GenRequest] = {}  # each running response as the engine was given it (continue mode)
        self._pending: dict[str, _Pending] = {}
        self._own_builder = builder is None  # a caller's builder outlives this agent (worker reconnects)
        self._builder = builder or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"agent-{job_id}-pull")
        self._pull: Future | None = None
        self._pull_failures = 0
        self._next_pull_at = 0.0
        self._startup_logged = False
        self._asked_epoch = -1  # the restarted manager's epoch this agent registered again with
        # every token sent of each response in flight (and of those finished in the last RESEND_KEEP_S seconds), from
        # the offset it was assigned at: what a manager restarted from its work log asks for again (Welcome.resend)
        self._sent: dict[str, _Pending] = {}
        self._sent_done: deque[tuple[float, str]] = deque()
        self.timings: dict[str, float] = {"agent_start": time.time()}  # wall-clock seconds (comparable across processes)

    # ------------------------------------------------------------------ control
    def held_version(self) -> int:
        """The version the engine holds in the current manager's epoch (-1: none / unknown weights)."""
        if self.engine is None or self.welcome is None or self.engine_epoch != self.welcome.epoch:
            return -1
        return self.engine.version

    def request_stop(self, reason: str, cause: M.LeaveCause = "stopped") -> None:
        """Ask the agent to drain and exit (safe from a signal handler or another thread). ``cause`` is the
        counted kind of end its Deregister carries; the first request wins, except that a cause refines
        ``"stopped"`` until the Deregister is sent (see :attr:`cause_settle_s`)."""
        if self.stop_reason is None:
            self.stop_cause = cause
            self.stop_reason = reason
        elif self.stop_cause == "stopped" and cause != "stopped":
            self.stop_cause = cause

    def _send(self, msg: M._Msg) -> None:
        self.link.send(M.encode(msg))

    def _heartbeat_frame(self) -> bytes:
        """The heartbeat (built on the link's I/O thread: plain attribute reads only — never an engine call,
        which may hold the engine's lock through a long weight load)."""
        return M.encode(M.Heartbeat(version=self.held_version(), active=len(self._pos),
                                    tokens_generated=self.tokens_generated))

    # ------------------------------------------------------------------ weights
    def _start_pull(self, version: int) -> None:
        """Pull ``version`` on the builder thread; build the engine there too when there is none yet."""
        assert self.welcome is not None
        weights, factory, model_config = self.weights, self.engine_factory, self.welcome.model_config
        endpoint, shards, keys = self.welcome.weights_endpoint, self.welcome.weights_shards, self.keys
        peers = list(self.want_peers)
        arch_json = self.welcome.model_arch
        build = self.engine is None

        def work() -> tuple:  # (version, PulledVersion, error, new engine, its build seconds)
            try:
                got = weights.pull(endpoint, version, peers=peers, keys=keys, shards=shards)
            except Exception as e:  # reported to the manager with its cause
                return version, None, f"{type(e).__name__}: {e}", None, 0.0
            if not build:
                return version, got, None, None, 0.0
            t0 = time.monotonic()
            try:
                eng = factory(model_config, got.state_dict, arch=ModelArch.from_json(arch_json) if arch_json else None)
                eng.version = version
                eng.weights_checksum = got.checksum
            except Exception as e:
                return version, None, f"engine start failed: {type(e).__name__}: {e}", None, 0.0
            return version, got, None, eng, time.monotonic() - t0

        self._pull = self._builder.submit(work)
        self._pull.add_done_callback(lambda _f: self.link.wake())  # load it without waiting out the idle poll

    def _weights_step(self) -> None:
        """Start a pull when stale; install a freshly built engine, or load a finished pull once idle."""
        current = self.held_version()
        if self._pull is not None and self._pull.done():
            version, got, err, new_engine, build_s = self._pull.result()
            if err is not None:
                self._pull = None
                self._pull_failures += 1
                self._next_pull_at = time.monotonic() + min(5.0, 0.2 * 2 ** self._pull_failures)
                log.warning("pull of version %d failed: %s", version, err)
                self._send(M.WeightsFailed(version=version, error=err))
                return
            resume: list[GenRequest] = []
            if new_engine is None and self.engine is not None and self.engine.num_active:
                if self.welcome is None or self.welcome.on_new_version != "continue":
                    return  # load only when idle
                resume = self._interrupt_for_load()
            t0 = time.monotonic()
            if new_engine is not None:
                self.engine = new_engine
            else:
                try:
                    if self.fault_load_delay_s:
                        time.sleep(self.fault_load_delay_s)  # on this thread, like a slow real load
                    self.engine.load_weights(got.state_dict, version)
                    self.engine.weights_checksum = got.checksum
                except Exception as e:
                    self._pull = None
                    self._pull_failures += 1
                    for gen in resume:  # (the engine kept its weights) they go on under the version they began with
                        self.engine.add(gen)
                    self._send(M.WeightsFailed(version=version, error=f"load failed: {type(e).__name__}: {e}"))
                    return
            self._pull, self._pull_failures = None, 0
            self.engine_epoch = self.welcome.epoch
            for gen in resume:  # under the new weights, from every token generated so far
                self.engine.add(gen)
            while self._sent_done:  # responses of the version before: no manager asks for them again
                self._sent.pop(self._sent_done.popleft()[1], None)
            self.timings.setdefault("weights_loaded", time.time())
            self._send(_weights_loaded(version, got, build_s if new_engine is not None else time.monotonic() - t0))
            return
        if (self._pull is None and self.want_version > current and self.want_version >= 0
                and time.monotonic() >= self._next_pull_at):
            self._start_pull(self.want_version)

    def _interrupt_for_load(self) -> list[GenRequest]:
        """``on_new_version = "continue"``: stop every running response between two decode iterations, send what it
        generated (stamped with the version that produced it), and return each one as the request that continues it
        from there — its prefix grown by every token generated on this instance, its budget shrunk by them — to be
        added again once the new weights are loaded (a re-prefill under them); a failed load re-adds them under the
        weights the engine kept. (Each is rebuilt from its assignment and every token sent since, so a second
        interruption is exact too.)"""
        live = list(self._pos)
        self._on_events(self.engine.abort_many(live).values())
        self._flush()
        out = []
        for rid in live:
            gen, done = self._gen.get(rid), self._sent.get(rid)
            if gen is None or rid not in self._pos:
                continue
            made = done.ids if done is not None else []
            out.append(GenRequest(rid=rid, prompt_ids=gen.prompt_ids, prefix_ids=list(gen.prefix_ids) + made,
                                  max_new_tokens=gen.max_new_tokens - len(made), sampling=gen.sampling))
        return out

    # ------------------------------------------------------------------ tokens
    def _flush(self, only_finished: bool = False) -> None:
        """Send buffered deltas as one ``Tokens`` frame (all of them, or only those that finished: finished
        responses go out at once, the rest keep accumulating up to k tokens per delta)."""
        if not self._pending:
            return
        rids, offs, cnts, vers, fins, ids, lps = [], [], [], [], [], [], []
        v = self.engine.version if self.engine is not None else -1
        if only_finished:
            items = [(r, p) for r, p in self._pending.items() if p.finish]
            for r, _ in items:
                del self._pending[r]
        else:
            items = list(self._pending.items())
            self._pending.clear()
        if not items:
            return
        now = time.monotonic()
        for rid, p in items:
            rids.append(rid)
            offs.append(p.offset)
            cnts.append(len(p.ids))
            vers.append(v)
            fins.append(p.finish)
            ids.extend(p.ids)
            lps.extend(p.lps)
            h = self._sent.get(rid)
            if h is None:
                h = self._sent[rid] = _Pending(offset=p.offset)
            h.ids += p.ids
            h.lps += p.lps
            if p.finish:
                h.finish = p.finish
                self._sent_done.append((now, rid))
        while self._sent_done and now - self._sent_done[0][0] > RESEND_KEEP_S:
            self._sent.pop(self._sent_done.popleft()[1], None)
        self._send(M.Tokens(rids=rids, offsets=offs, counts=cnts, versions=vers, finish=fins,
                            ids=M.pack_i32(ids), logprobs=M.pack_f32(lps)))

    def _resend(self) -> None:
        """A manager restarted from its work log asks for every response's tokens again (its log may end a commit
        window earlier): everything produced is flushed, then each response held is sent whole from the offset it
        was assigned at, in one frame (the manager keeps what its log lacks, checking the overlap)."""
        self._flush()
        v = self.engine.version if self.engine is not None else -1
        items = list(self._sent.items())
        self._send(M.Tokens(rids=[r for r, _ in items], offsets=[h.offset for _, h in items],
                            counts=[len(h.ids) for _, h in items], versions=[v] * len(items),
                            finish=[h.finish for _, h in items], ids=M.pack_i32([i for _, h in items for i in h.ids]),
                            logprobs=M.pack_f32([x for _, h in items for x in h.lps]), resent=True,
                            generated=self.tokens_generated))
        log.info("resent %d responses (%d tokens) to the restarted manager", len(items),
                 sum(len(h.ids) for _, h in items))

    def _hand_back_failed(self, rid: str, error: str) -> None:
        """The engine dropped ``rid`` (its stream failed; the engine serves the others): send every token it
        produced first, then ``RequestFailed`` — the manager resumes the response from those tokens elsewhere."""
        log.warning("request %s failed on this engine; handing it back: %s", rid, error)
        self._flush()
        self._pos.pop(rid, None)
        self._gen.pop(rid, None)
        self._sent.pop(rid, None)
        self._send(M.RequestFailed(rid=rid, error=error[:2000]))

    def _on_events(self, events) -> bool:
        """Buffer one engine step's tokens; True when a request finished (flush promptly)."""
        finished = False
        for ev in events:
            p = self._pending.get(ev.rid)
            if p is None:
                p = self._pending[ev.rid] = _Pending(offset=self._pos[ev.rid])
            p.ids.extend(ev.token_ids)
            p.lps.extend(ev.logprobs)
            self._pos[ev.rid] += len(ev.token_ids)
            self.tokens_generated += len(ev.token_ids)
            if ev.finished:
                p.finish = M.FINISH_CODES[ev.finish_reason]
                self._pos.pop(ev.rid, None)
                self._gen.pop(ev.rid, None)
                finished = True
        if self.tokens_generated and "first_token" not in self.timings:
            self.timings["first_token"] = time.time()
        return finished

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

    def _release(self, rids: list[str]) -> None:
        """Abort ``rids`` locally, flush everything produced (including tokens the engine still held, which
        ``abort_many`` returns), then hand them back (order matters)."""
        live = [r for r in rids if r in self._pos]
        if self.engine is not None and live:
            self._on_events(self.engine.abort_many(live).values())
        for rid in rids:
            self.tokens_handed_off += self._pos.pop(rid, 0)
            self._gen.pop(rid, None)
        self._flush()
        for rid in rids:
            self._sent.pop(rid, None)
        self._send(M.Released(rids=list(rids), tokens_generated=self.tokens_generated))

    def _drain(self, reason: str) -> None:
        self._send(M.Draining(reason=reason))
        self._release(list(self._pos))
        settle = time.monotonic() + self.cause_settle_s
        while self.stop_cause == "stopped" and time.monotonic() < settle and not self.cause_settled():
            time.sleep(0.01)  # a warning signal, or Slurm's word that the job is being preempted, may refine it
        self.link.heartbeat_s = None  # no heartbeat after the Deregister: the manager would warn of a stranger
        self._send(M.Deregister(reason=reason, tokens_generated=self.tokens_generated, cause=self.stop_cause))

    # ------------------------------------------------------------------ messages
    def _want(self, version: int, peers: list[str], wait: bool) -> None:
        """The manager's latest ``version`` and where to fetch it: relay ``peers`` (then the trainer); with
        ``wait``, not before a ``PullFrom`` — or ``relay_wait_s``, after which the trainer serves it anyway."""
        if version < self.want_version or (version == self.want_version and self._pull is not None):
            return  # (a repeat of what the pull in flight is fetching)
        self.want_version = version  # a pull in flight for an older version: the next pull fetches this one
        self.want_peers = list(peers)
        if wait:
            self._next_pull_at = max(self._next_pull_at, time.monotonic() + self.relay_wait_s)

    def _handle(self, msg: M._Msg) -> None:
        if isinstance(msg, M.Welcome):
            if (self.engine is not None and self.engine_epoch != msg.epoch and msg.latest_checksum
                    and self.engine.version == msg.latest_version
                    and self.engine.weights_checksum == msg.latest_checksum):
                # a restarted manager confirms the version these weights are (its checksum): keep them
                log.info("manager epoch %d confirms version %d held since epoch %s", msg.epoch, msg.latest_version,
                         self.engine_epoch)
                self.engine_epoch = msg.epoch
            self.welcome = msg
            self.link.heartbeat_s = msg.heartbeat_s
            if msg.resend:
                self._resend()
            self._want(msg.latest_version, msg.peers, msg.wait)
            if self.held_version() == msg.latest_version >= 0:  # re-registration with this manager
                self._send(_weights_loaded(self.engine.version, PulledVersion({}, self.engine.weights_checksum), 0.0))
            self.timings.setdefault("welcome", time.time())
        elif isinstance(msg, M.Assign):
            for w in msg.works:
                if w.rid in self._pos and self.engine is not None:
                    # the manager's assignment is authoritative: it resumed this response from its own prefix
                    # (a Release of our earlier copy was lost with a connection); drop ours, unsent tokens too
                    log.warning("assignment of %s replaces the copy this instance still ran", w.rid)
                    self.engine.abort_many([w.rid])
                    self._pos.pop(w.rid, None)
                    self._pending.pop(w.rid, None)
                self._sent.pop(w.rid, None)  # (a response resumed here again: its tokens start over)
                if w.version != self.held_version() or self.engine is None:
                    self._send(M.RequestFailed(rid=w.rid, error=f"assigned version {w.version}, instance holds "
                                               f"{self.held_version()}"))
                    continue
                try:
                    gen = GenRequest(
                        rid=w.rid, prompt_ids=list(w.prompt_ids), prefix_ids=list(w.prefix_ids),
                        max_new_tokens=w.tokens_left,
                        sampling=SamplingParams(temperature=w.temperature, top_p=w.top_p, seed=w.seed,
                                                stop_token_ids=tuple(w.stop_ids)))
                    self.engine.add(gen)
                    self._pos[w.rid], self._gen[w.rid] = len(w.prefix_ids), gen
                except Exception as e:
                    self._send(M.RequestFailed(rid=w.rid, error=f"{type(e).__name__}: {e}"))
        elif isinstance(msg, M.Release):
            self._release(msg.rids)
        elif isinstance(msg, M.NewVersion):
            self._want(msg.version, msg.peers, msg.wait)
        elif isinstance(msg, M.PullFrom):
            if msg.version == self.want_version:
                self.want_peers = list(msg.peers)
                self._next_pull_at = time.monotonic()  # relay capacity: start now (or once the pull in flight ends)
        elif isinstance(msg, M.Alive):
            if self.welcome is not None and msg.epoch != self.welcome.epoch and msg.epoch != self._asked_epoch:
                # the manager restarted (it knows us from its work log): register again under the same identity,
                # keeping the responses in flight (the restarted manager takes them back at their logged length)
                log.warning("manager restarted (epoch %d → %d); registering again", self.welcome.epoch, msg.epoch)
                self._asked_epoch = msg.epoch
                self._send(self._register())
        elif isinstance(msg, M.Drain):
            self.request_stop(f"drain: {msg.reason}", "stopped")  # the run ends (manager shutdown)
        elif isinstance(msg, M.Reject):
            if self.welcome is not None and self.kind == "reserved":
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
        if self.engine is not None and self._pos:
            self.engine.abort_many(list(self._pos))  # the manager already resumed these elsewhere
        self._pos.clear()
        self._gen.clear()
        self._pending.clear()
        self._sent.clear()
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
        ident = f"{self.job_id}#{self.attempt}/{os.getpid()}-{os.urandom(3).hex()}".encode()
        self.link = ManagerLink(self.ctx, self.manager_endpoint, self.keys, ident, self._heartbeat_frame)
        try:
            return self._loop()
        except _Rejected as e:
            log.error("manager rejected %s#%d: %s", self.job_id, self.attempt, e)
            return EXIT_REJECTED
        except EngineError as e:  # the engine as a whole broke (server died, stalled): leave, losing no token
            log.error("engine of %s#%d failed; leaving: %s", self.job_id, self.attempt, e)
            try:
                self._flush()  # what it produced before: the manager resumes those responses elsewhere
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
                    self._hand_back_failed(e.rid, str(e))
                    continue
                done = self._on_events(events)
                steps_since_flush += 1
                now = time.monotonic()
                if steps_since_flush >= self.welcome.stream_every_tokens or \
                        now - last_flush >= self.welcome.stream_every_s:
                    self._flush()
                    last_flush, steps_since_flush = now, 0
                elif done:
                    self._flush(only_finished=True)
            elif self._pending:
                self._flush()
            if "first_token" in self.timings and not self._startup_logged:
                self._startup_logged = True
                log.info("startup phases %s", json.dumps(self.startup_phases()))
                if self.on_ready is not None:
                    self.on_ready(self.startup_phases())
            self._weights_step()


class _Rejected(Exception):
    pass
