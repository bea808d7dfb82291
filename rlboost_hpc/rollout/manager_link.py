"""The rollout agent's connection to the manager: one ZeroMQ DEALER owned by an I/O thread that does nothing else.

Owns how an agent's frames reach the manager and the manager's reach the agent, whatever the agent's own thread
is doing: the I/O thread forwards what the agent queues (in order, never dropped, never blocking on a full
queue), receives into an inbox and notes when the manager last spoke, and sends the heartbeats — so a weight
load or an engine step of any length never silences the instance, and the manager's silence is judged from frames
already received. The socket's routing id is fixed for the link's life, so a transparent reconnect (a TCP reset)
keeps the instance's identity. What the frames say is :mod:`rlboost_hpc.rollout.agent`'s business.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import zmq

from rlboost_hpc.protocol.auth import RunKeys, secure_client


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
