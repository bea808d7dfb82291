"""The trainer's connection to the rollout manager (a ZeroMQ DEALER).

Invariant: every call has a deadline and raises :class:`ManagerError` naming the call on timeout or on an
``Error`` reply; ``GroupDone``/``StepFailed`` messages that arrive while waiting for a reply are kept, in
order, for :meth:`ManagerClient.next_event`.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import zmq

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys, secure_client


class ManagerError(RuntimeError):
    """The manager did not answer in time or refused a call; the message says which call and why."""


class ManagerClient:
    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None, timeout_s: float = 10.0,
                 keys: RunKeys | None = None, alive: Callable[[], bool] | None = None) -> None:
        """``alive``: tells whether the manager process still runs (every wait checks it at least every 0.5 s
        and raises :class:`ManagerError` at once when it died, instead of waiting out a step deadline)."""
        self.endpoint = endpoint
        self.alive = alive
        self.timeout_s = timeout_s
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, keys)
        self.sock.connect(endpoint)
        self.events: deque[M._Msg] = deque()

    def _recv(self, timeout_s: float) -> M._Msg | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self.sock.poll(int(min(0.5, max(0.0, deadline - time.monotonic())) * 1000), zmq.POLLIN):
            if self.alive is not None and not self.alive():
                raise ManagerError(f"the manager process ({self.endpoint}) exited; the run cannot continue "
                                   "without it (a restart resumes from the last checkpoint)")
            if time.monotonic() >= deadline:
                return None
        return M.decode(self.sock.recv())

    def send(self, msg: M._Msg) -> None:
        """Send a one-way message (no reply expected), e.g. ``AckGroup``."""
        self.sock.send(M.encode(msg))

    def call(self, msg: M._Msg, timeout_s: float | None = None) -> M._Msg:
        """Send ``msg`` and wait for its ``Ok``/``Stats`` reply. Raises ManagerError on Error or timeout."""
        self.sock.send(M.encode(msg))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            reply = self._recv(left) if left > 0 else None
            if reply is None:
                raise ManagerError(f"manager {self.endpoint} did not answer {type(msg).__name__} within "
                                   f"{timeout_s or self.timeout_s:.0f}s")
            if isinstance(reply, (M.GroupDone, M.StepFailed)):
                self.events.append(reply)
            elif isinstance(reply, M.Error):
                raise ManagerError(f"manager refused {type(msg).__name__}: {reply.error}")
            else:
                return reply

    def next_event(self, timeout_s: float) -> M.GroupDone | M.StepFailed | None:
        """The next GroupDone/StepFailed, waiting up to ``timeout_s``; None on timeout."""
        if self.events:
            return self.events.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            msg = self._recv(left) if left > 0 else None
            if msg is None:
                return None
            if isinstance(msg, (M.GroupDone, M.StepFailed)):
                return msg

    def stats(self) -> dict:
        return self.call(M.GetStats()).stats

    def close(self) -> None:
        self.sock.close(linger=0)
