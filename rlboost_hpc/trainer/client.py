"""The trainer's connection to the rollout manager (a ZeroMQ DEALER).

Invariants:
- Every call has a deadline and raises :class:`ManagerError` naming the call on timeout or on an ``Error``
  reply; ``GroupDone``/``StepFailed`` messages that arrive while waiting for a reply are kept, in order, for
  :meth:`ManagerClient.next_event`.
- Identity survives reconnects: the socket has a fixed ZeroMQ routing id for its life, so after a transparent
  reconnect (a TCP reset) the manager still knows it as the trainer.
- Nothing is lost with a connection: a call whose reply does not come within ``resend_s`` is sent again with
  the same call id (the manager answers resent calls idempotently; only the reply with the current id is taken),
  and a wait for events that sees nothing for ``resend_s`` asks the manager to deliver again every finished
  group not yet acknowledged (the loop skips groups it already took).
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque
from typing import Callable

import msgspec
import zmq

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys, secure_client
from rlboost_hpc.errors import RunFailed


class ManagerError(RunFailed, RuntimeError):
    """The manager did not answer in time or refused a call; the message says which call and why."""


class ManagerClient:
    """The trainer's side of the manager protocol: :meth:`call` (request → typed reply, resent with the same call
    id until answered or ``timeout_s`` seconds pass), :meth:`send` (one-way: acknowledgements, policy state),
    :meth:`next_event` (the next ``GroupDone``/``StepFailed``, asking for redelivery after ``resend_s`` of silence)
    and :meth:`stats`. One instance per trainer process, not thread-safe (one ZeroMQ socket). Raises
    :class:`ManagerError` on a timeout, an ``Error`` reply or a manager process that died (``alive``)."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None, timeout_s: float = 10.0,
                 keys: RunKeys | None = None, alive: Callable[[], bool] | None = None,
                 resend_s: float = 2.0, identity: bytes | None = None,
                 restarts: Callable[[], int] | None = None) -> None:
        """``alive``: tells whether the manager process still runs (every wait checks it at least every 0.5 s
        and raises :class:`ManagerError` at once when it died, instead of waiting out a step deadline).
        ``resend_s``: seconds without a reply (or, waiting for events, without news) before resending / asking
        for redelivery. ``identity``: the routing id (default: ``trainer-<pid>-<random>``). ``restarts``: how many
        times the manager was restarted (its supervisor's count): a call or a wait resends at once after a restart
        instead of after ``resend_s`` (the dead manager never answered)."""
        self.endpoint = endpoint
        self.alive = alive
        self.restarts = restarts or (lambda: 0)
        self.timeout_s = timeout_s
        self.resend_s = resend_s
        self.identity = identity or f"trainer-{os.getpid()}-{os.urandom(4).hex()}".encode()
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        secure_client(self.sock, keys)
        self.sock.connect(endpoint)
        self.events: deque[M._Msg] = deque()
        self._cids = itertools.count(1)
        self.resends = 0

    def _recv(self, timeout_s: float) -> M._Msg | None:
        """The next message within ``timeout_s``; None on timeout, or at once when the manager was restarted."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        gen = self.restarts()
        while not self.sock.poll(int(min(0.5, max(0.0, deadline - time.monotonic())) * 1000), zmq.POLLIN):
            if self.alive is not None and not self.alive():
                raise ManagerError(f"the manager process ({self.endpoint}) exited; the run cannot continue "
                                   "without it (a restart resumes from the last checkpoint)")
            if time.monotonic() >= deadline or self.restarts() != gen:
                return None
        return M.decode(self.sock.recv())

    def send(self, msg: M._Msg) -> None:
        """Send a one-way message (no reply expected), e.g. ``AckGroup``."""
        self.sock.send(M.encode(msg))

    def call(self, msg: M._Msg, timeout_s: float | None = None) -> M._Msg:
        """Send ``msg`` (given a fresh call id when it has one) and wait for its ``Ok``/``Stats`` reply, resending
        it every ``resend_s``; a manager restarted meanwhile gets it again at once, with the whole ``timeout_s`` (its
        restart does not count against the call). Raises ManagerError on Error or timeout."""
        if hasattr(msg, "cid"):
            msg = msgspec.structs.replace(msg, cid=next(self._cids))
        frame = M.encode(msg)
        self.sock.send(frame)
        total = timeout_s or self.timeout_s
        deadline = time.monotonic() + total
        resend_at = time.monotonic() + self.resend_s
        gen = self.restarts()
        while True:
            now = time.monotonic()
            if self.restarts() != gen:  # a restarted manager never got it, and gets the call's whole time
                deadline = now + total  # (its restart, which ``alive`` waited for, may have taken longer)
            if now >= deadline:
                raise ManagerError(f"manager {self.endpoint} did not answer {type(msg).__name__} within {total:.0f}s")
            if now >= resend_at or self.restarts() != gen:  # (a restarted manager never got it)
                self.sock.send(frame)
                self.resends += 1
                resend_at, gen = now + self.resend_s, self.restarts()
            reply = self._recv(min(deadline, resend_at) - now)
            if reply is None:
                continue
            if isinstance(reply, (M.GroupDone, M.StepFailed)):
                self.events.append(reply)
            elif getattr(reply, "cid", 0) != getattr(msg, "cid", 0):
                continue  # the late answer to an earlier call (resent after a lost reply)
            elif isinstance(reply, M.Error):
                raise ManagerError(f"manager refused {type(msg).__name__}: {reply.error}")
            else:
                return reply

    def next_event(self, timeout_s: float) -> M.GroupDone | M.StepFailed | None:
        """The next GroupDone/StepFailed, waiting up to ``timeout_s``; None on timeout. Every ``resend_s`` without
        one, the manager is asked to deliver again what the trainer has not acknowledged."""
        if self.events:
            return self.events.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            msg = self._recv(min(left, self.resend_s))  # (returns early after a restart: ask again at once)
            if msg is None:
                if time.monotonic() < deadline:
                    self.send(M.Redeliver())
                continue
            if isinstance(msg, (M.GroupDone, M.StepFailed)):
                return msg

    def arrived_events(self) -> list[M.GroupDone | M.StepFailed]:
        """Every GroupDone/StepFailed already received or waiting in the socket, without waiting (other messages
        that arrive meanwhile — late answers to earlier calls — are dropped, as :meth:`next_event` drops them)."""
        out = list(self.events)
        self.events.clear()
        while self.sock.poll(0, zmq.POLLIN):
            msg = M.decode(self.sock.recv())
            if isinstance(msg, (M.GroupDone, M.StepFailed)):
                out.append(msg)
        return out

    def stats(self) -> dict:
        return self.call(M.GetStats()).stats

    def close(self) -> None:
        self.sock.close(linger=0)
