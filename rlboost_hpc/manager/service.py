"""The rollout manager process: a ZeroMQ ROUTER around :class:`~rlboost_hpc.manager.core.ManagerCore`.

Invariants: a frame reaches the core only after it decoded against the typed schema; a bad frame is
dropped with one log line per offending peer (rate-limited) and counted, and the service keeps serving.
Sends never block. Dead is not alive: the socket is ``ROUTER_MANDATORY``, so a send to a peer whose connection
closed fails at once; whenever the socket monitor reports a closed connection, every live instance is probed
that way and the core is told which ones are no longer connected (they leave routing within one loop
iteration, tens of milliseconds after the kernel closed the connection of a killed process).
"""
from __future__ import annotations

import logging
import time
from itertools import chain
from typing import TYPE_CHECKING

import zmq

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.manager.state import ENV_PEER
from rlboost_hpc.manager.worklog import Frame as WorkFrame
from rlboost_hpc.protocol.auth import RunKeys, max_msg_size, secure_server
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.tasks.environment import TurnSpec
from rlboost_hpc.tasks.tools import TurnCalls

if TYPE_CHECKING:
    from rlboost_hpc.manager.worklog import WorkLog
    from rlboost_hpc.observe.metrics import ManagerMetrics

log = logging.getLogger("rlboost.manager")


class ManagerService:
    """Bind ``bind`` (``tcp://127.0.0.1:0`` picks a free port; see :attr:`endpoint`) and serve until a
    ``Shutdown`` from the trainer or :meth:`stop`."""

    def __init__(self, core: ManagerCore, bind: str = "tcp://127.0.0.1:0", *, ctx: zmq.Context | None = None,
                 keys: RunKeys | None = None, metrics: "ManagerMetrics | None" = None,
                 environment: TurnCalls | None = None, worklog: "WorkLog | None" = None):
        self.core = core
        self.worklog = worklog  # the step in flight, journaled (group commit before the replies that need it)
        self._held: list[tuple[bytes, M._Msg]] = []  # the trainer's messages waiting for the work log's commit
        # tool calls (or a stateful environment's steps) of multi-turn trajectories (EnvCall → a call in the pool →
        # EnvResult), in worker processes
        self.env = environment
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size(M.MAX_FRAME_BYTES, keys))
        # peers keep a fixed routing id per (job, attempt) (the trainer: per client); after a transparent
        # reconnect (a TCP reset) the new connection takes the identity over instead of being refused
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable peer is an error, not a silent drop
        secure_server(self.sock, keys)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.metrics = metrics
        self._stop = False
        self._bad_peers: dict[bytes, float] = {}

    def stop(self) -> None:
        self._stop = True

    def _reject(self, peer: bytes, err: Exception) -> None:
        self.core.counters.protocol_rejects += 1
        now = time.monotonic()
        if now - self._bad_peers.get(peer, -1e9) > 10.0:
            log.warning("rejected frame from peer %s: %s", peer.hex(), err)
            self._bad_peers[peer] = now

    def _send(self, peer: bytes, frame: bytes) -> bool:
        """Send without blocking; False (and the core told) when the peer is no longer connected."""
        try:
            self.sock.send_multipart([peer, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("send to %s dropped (peer not reading)", peer.hex())
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.core.disconnected(peer)
            return False

    def _journal(self, now: float, idle: bool = True) -> None:
        """Hand the core's new work-log records to the log, and keep the trainer from seeing anything the log does
        not hold yet: a reply to the trainer's call commits at once (a few per step); finished groups commit at once
        when no frame came in (``idle``) or when they end the step's rollout (the trainer waits for them: measured,
        the last groups of a demo step waited 21 ms for the window while the other engine's frames kept coming),
        else they wait for the window's commit (at most ``commit_every_s``) — under load a step's many deliveries
        share a few fsyncs."""
        if self.worklog is None:
            return
        if self.core.worklog:
            self.worklog.write(self.core.worklog, now)
            self.core.worklog.clear()
        trainer, out = self.core.trainer_peer, self.core.outbox
        last = self.core.step_account.rollout_done_at is not None  # the step's rollout is done: the trainer waits

        def logged(p: bytes, m: M._Msg) -> bool:  # sent only once the log holds what it answers
            return p == trainer or isinstance(m, M.Farewell)

        if self.worklog.pending and (self.worklog.due(now) or any(
                logged(p, m) and (idle or last or not isinstance(m, M.GroupDone)) for p, m in chain(out, self._held))):
            self.worklog.commit(self.core.counters)
        if self.worklog.pending:  # hold the trainer's groups (and a drained instance's Farewell) until the commit
            self._held += [(p, m) for p, m in out if logged(p, m)]
            self.core.outbox = [(p, m) for p, m in out if not logged(p, m)]
        elif self._held:
            self.core.outbox, self._held = self._held + out, []

    def _flush(self) -> None:
        out, self.core.outbox = self.core.outbox, []
        for peer, msg in out:
            if peer == ENV_PEER and isinstance(msg, M.EnvRelease):
                self.env.release(msg.rids)
            elif peer == ENV_PEER:
                self.env.call(msg)
            else:
                self._send(peer, M.encode(msg))

    def _environment(self) -> None:
        """Hand every finished tool call (environment step) to the core as an :class:`~M.EnvResult`."""
        for o in self.env.poll(0.0):
            rid, turn = o.key
            self.core.on_message(ENV_PEER, M.EnvResult(rid=rid, turn=turn, obs_ids=M.pack_i32(o.obs_ids),
                                                       status=o.status, tool_s=o.seconds, reward=o.reward,
                                                       done=o.done, error=o.error, replayed=o.replayed))

    def _probe(self) -> None:
        """A connection closed somewhere: find which live instances are no longer reachable."""
        alive = M.encode(M.Alive(epoch=self.core.epoch))
        for inst in self.core.fleet.live():
            self._send(inst.peer, alive)

    def _receive(self, deadline: float | None) -> None:
        """Apply every frame already queued on the socket (until ``deadline``, monotonic seconds, if given)."""
        while deadline is None or time.monotonic() < deadline:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject(frames[0], ProtocolError(f"expected 2 frames, got {len(frames)}"))
                continue
            peer, frame = frames
            try:
                msg = M.decode(frame)
            except ProtocolError as e:
                self._reject(peer, e)
                continue
            rec = None
            if self.worklog is not None and isinstance(msg, M.Tokens):  # journaled whole, in order with the core's
                self.core.log_work(rec := WorkFrame(peer, frame))
            if isinstance(msg, M.Shutdown) and peer == self.core.trainer_peer:
                self._stop = True
                self.core.send(peer, M.Ok(what="shutdown", cid=msg.cid))
                for i in self.core.fleet.live():
                    self.core.send(i.peer, M.Drain(reason=msg.reason))
                return
            self.core.on_message(peer, msg)
            if rec is not None and self.core.dropped:  # replayed as applied: not the deltas the core refused
                rec.dropped = self.core.dropped

    def serve_forever(self, tick_s: float = 0.02) -> None:
        """Run the loop: receive and apply every pending frame, tick (liveness + dispatch), send."""
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        last_tick = last_metrics = last_dispatch = 0.0
        watched: list = []  # the tool workers' pipes: a finished tool call wakes the loop (no tick of latency)
        while not self._stop:
            if self.env is not None and watched != self.env.connections():
                for c in watched:
                    poller.unregister(c)
                watched = self.env.connections()
                for c in watched:
                    poller.register(c, zmq.POLLIN)
            events = dict(poller.poll(int(tick_s * 1000)))
            if self._monitor in events:
                closed = 0
                while True:
                    try:
                        recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
                        closed += 1
                    except zmq.Again:
                        break
                if closed:
                    # what a peer sent before its connection closed (a SIGTERM-ed worker's last tokens and its
                    # Deregister) is already queued on the socket: apply it first, then probe — else a clean
                    # goodbye would race the monitor and look like a crash (its unsent tokens regenerated)
                    self._receive(deadline=None)
                    self._probe()
            if self.sock in events and not self._stop:
                # bound a receive burst so replies are not held back
                self._receive(deadline=time.monotonic() + tick_s)
            if self.env is not None and self.env.pending:
                self._environment()
            now = time.monotonic()
            if self.metrics is not None and now - last_metrics >= 0.5:
                self.metrics.refresh(self.core)
                last_metrics = now
            if now - last_tick >= tick_s:
                self.core.tick()
                last_tick = last_dispatch = now
            elif self.core.book.queue and now - last_dispatch >= 0.002:
                # queued work waits for capacity: dispatch often, but liveness (O(N) over the instances) only
                # once per tick
                self.core.dispatch()
                last_dispatch = now
            self._journal(now, idle=self.sock not in events)
            if self.core.outbox:
                self._flush()
        self._journal(float("inf"))
        self._flush()

    def close(self) -> None:
        if self.worklog is not None:
            self.worklog.close(self.core.counters)
        if self.env is not None:
            self.env.close()
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


def run_manager_process(bind: str, settings: ManagerSettings, conn, keys_dir: str | None = None,
                        metrics_host: str | None = None, journal_path: str | None = None,
                        run_id: str | None = None, log_sink=None, environment: TurnSpec | None = None,
                        work_log: str | None = None, restore: bool = False, metrics_port: int = 0) -> None:
    """Entry point of the manager process: serve, report the bound endpoint through ``conn`` (a Pipe end).
    With ``keys_dir`` (a run directory holding ``keys/keys.json``) every connection must prove the run's key.
    With ``journal_path`` the manager starts a new epoch in that journal and records every version there; with
    ``work_log`` too, it journals the step in flight there (``manager/worklog.py``) and, when ``restore``, first
    continues what the log holds (``manager/restore.py``; a log of another run exits 2 naming the file).
    ``metrics_port``: the Prometheus port to take again (a restart; 0: a free one).
    ``run_id`` tags its log lines. ``environment``: what answers multi-turn trajectories' turns
    (:class:`~rlboost_hpc.tasks.environment.TurnSpec`: tool calls, or a stateful environment's steps); None:
    single-turn only."""
    from rlboost_hpc.observe.logs import LogSink, setup_logging_from

    setup_logging_from(log_sink or LogSink(), "manager", run_id=run_id)
    import os
    import threading

    core = ManagerCore(clock=time.monotonic, settings=settings, environment=environment is not None)
    journal = None
    if journal_path is not None:
        from rlboost_hpc.manager.journal import Journal

        journal = Journal(journal_path)
        core.epoch = journal.epoch
        core.on_version = lambda v: journal.append({"event": "version", "version": v})
        log.info("manager epoch %d (journal %s)", journal.epoch, journal_path)
    wlog = None
    if work_log is not None:
        from rlboost_hpc.manager.restore import restore as restore_core
        from rlboost_hpc.manager.worklog import WorkLog, WorkLogError

        try:
            wlog = WorkLog(work_log, run_id or "", core.epoch, keep=restore, commit_every_s=settings.commit_every_s)
        except WorkLogError as e:
            conn.send(("error", str(e)))
            raise SystemExit(2) from None
        core.worklog = []
        if wlog.restored:
            restore_core(core, wlog.restored, time.monotonic())
    metrics = None
    metrics_url = ""
    if metrics_host is not None:  # Prometheus endpoint on a free port (its URL goes to endpoints.json)
        from rlboost_hpc.observe.metrics import ManagerMetrics, serve_metrics

        metrics = ManagerMetrics(run_id or "")
        try:
            h, port = serve_metrics(metrics, host=metrics_host, port=metrics_port)
        except OSError:  # the old port is taken meanwhile: a new one (endpoints.json keeps naming the old)
            h, port = serve_metrics(metrics, host=metrics_host)
        metrics_url = f"http://{h}:{port}/metrics"
    svc = ManagerService(core, bind, keys=RunKeys.load(keys_dir) if keys_dir else None, metrics=metrics,
                         environment=environment.calls() if environment is not None else None, worklog=wlog)
    import signal

    # SIGTERM (the run stopping a manager no trainer ever said hello to): leave the loop, close the tool workers.
    # Installed before the endpoint is reported, so a stop that follows at once is never a kill.
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    # Ctrl-C on a terminal reaches the whole foreground process group: the trainer that started us handles it
    # (it stops us), so the manager never dies of it half-way or prints a KeyboardInterrupt of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _report_endpoint(conn, svc, metrics_url):
        return
    parent = os.getppid()

    def watch_parent() -> None:  # never outlive the trainer that started us (no orphaned manager)
        while not svc._stop:
            if os.getppid() != parent:
                log.error("parent process %d is gone; manager exits", parent)
                svc.stop()
            time.sleep(1.0)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        svc.serve_forever()
    finally:
        svc.close()
        if journal is not None:
            journal.close()


def _report_endpoint(conn, svc: ManagerService, metrics_url: str) -> bool:
    """Tell the trainer that started this manager where it serves; False (the service closed, one log line, no
    traceback) when that trainer died while the manager started."""
    try:
        conn.send(("ok", (svc.endpoint, metrics_url)))
    except (BrokenPipeError, EOFError):
        log.error("the trainer that started this manager is gone; manager exits")
        svc.close()
        return False
    conn.close()
    return True


def spawn_manager(settings: ManagerSettings | None = None, bind: str = "tcp://127.0.0.1:0", timeout_s: float = 60.0,
                  keys_dir: str | None = None, metrics_host: str | None = None, journal_path: str | None = None,
                  run_id: str | None = None, environment: TurnSpec | None = None, work_log: str | None = None,
                  restore: bool = False, metrics_port: int = 0):
    """Start the manager in its own (spawned) process with ``settings`` (:class:`ManagerSettings`; its defaults
    when None); ``environment``, ``work_log``, ``restore`` and ``metrics_port`` as in :func:`run_manager_process`.

    Returns ``(process, endpoint, metrics_url)`` (``metrics_url`` is "" unless ``metrics_host`` is given).
    The manager logs where this process logs (:func:`~rlboost_hpc.observe.logs.current_sink`).
    Raises RuntimeError if the process does not report its endpoint in time, WorkLogError (exit 2) for a work log
    of another run.
    """
    import multiprocessing as mp

    from rlboost_hpc.observe.logs import current_sink

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_manager_process,
                       args=(bind, settings or ManagerSettings(), child, keys_dir, metrics_host, journal_path, run_id, current_sink(),
                             environment, work_log, restore, metrics_port),
                       # a daemonic process may not start the environment's worker processes; without the flag the
                       # manager still never outlives its parent (watch_parent) and the run joins or kills it
                       name="rlboost-manager", daemon=environment is None)
    proc.start()
    child.close()
    if not parent.poll(timeout_s):
        proc.kill()
        raise RuntimeError(f"the rollout manager process did not report its endpoint within {timeout_s:.0f} s")
    status, got = parent.recv()
    if status != "ok":
        from rlboost_hpc.manager.worklog import WorkLogError

        proc.join(timeout=5)
        raise WorkLogError(got)
    endpoint, metrics_url = got
    return proc, endpoint, metrics_url
