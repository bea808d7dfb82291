"""Faults the local cluster injects on purpose (chaos runs): stalls, TCP resets, slow weight loads.

Next to the trace's warned preemptions and kills, a chaos run needs the faults that make a healthy instance look
dead or lose frames: a process stopped past the heartbeat deadline (SIGSTOP … SIGCONT), a connection reset by the
network (:class:`TcpForwarder` between the workers and the manager, reset all at once), a weight load slower than
the deadline (the worker's ``--fault-load-delay-s``). :class:`FaultPlan` schedules them from a seeded RNG, by wall
time; :class:`StepFaults` schedules them by progress — one of each kind every k steps, each kept due until it could
be injected — so a chaos test's fault mix is certain however slow or loaded the host is.

Invariants: every stopped process is continued (also when the cluster stops); a reset closes connections, never
processes; the forwarder keeps accepting after a reset, so peers reconnect through it transparently.
"""
from __future__ import annotations

import random
import socket
import struct
import threading
from dataclasses import dataclass, field

__all__ = ["FAULT_KINDS", "TcpForwarder", "FaultPlan", "StepFaults"]

#: The kinds of fault :class:`StepFaults` schedules (``cluster.faults.kinds``).
FAULT_KINDS = ("preempt", "kill", "stall", "link_reset", "slow_load")


class TcpForwarder:
    """A TCP proxy: connections to :attr:`endpoint` are piped to ``target`` (``tcp://host:port``); :meth:`reset`
    drops every live connection with an RST (a flaky link or a middlebox), new connections keep working."""

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        t_host, t_port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (t_host, int(t_port))
        self.listener = socket.create_server((host, 0))
        self.endpoint = f"tcp://{host}:{self.listener.getsockname()[1]}"
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.resets = 0
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, name="tcp-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=5)
                b.settimeout(None)
            except OSError:
                a.close()
                continue
            with self._lock:
                self.pairs.append((a, b))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def reset(self) -> int:
        """Drop every live connection (RST both ways). Returns how many were dropped."""
        with self._lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass
        self.resets += 1
        return len(pairs)

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        self.reset()


@dataclass
class FaultPlan:
    """When the next stall and reset happen (exponential gaps with the given means; 0 disables a kind), and
    which worker attempts load weights slowly (a share ``slow_load_fraction`` of attempts, seeded)."""

    stall_every_s: float = 0.0
    reset_every_s: float = 0.0
    slow_load_fraction: float = 0.0
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def next_gap(self, mean_s: float) -> float:
        """Seconds to the next fault of a kind with mean gap ``mean_s`` (inf when the kind is off)."""
        return self.rng.expovariate(1.0 / mean_s) if mean_s > 0 else float("inf")

    def slow_load(self) -> bool:
        """Whether the next worker attempt loads weights slowly."""
        return self.slow_load_fraction > 0 and self.rng.random() < self.slow_load_fraction


@dataclass
class StepFaults:
    """Faults scheduled by progress (pure: the local cluster injects them and reports back): at every
    ``every_steps``-th step boundary one fault of each of ``kinds`` becomes due; a due fault stays due until
    :meth:`done` says it was injected (it needs a live worker to hit, or a connection to reset), and due faults of
    one kind add up. So a run of n steps sees at least ``(n - 1) // every_steps`` faults of each kind, whatever the
    wall time and the luck of the draw.

    Raises:
        ValueError: ``every_steps`` < 0 or a kind outside :data:`FAULT_KINDS`.
    """

    every_steps: int = 0
    kinds: tuple[str, ...] = ()
    due: dict[str, int] = field(init=False, default_factory=dict)
    injected: dict[str, int] = field(init=False, default_factory=dict)
    _seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps = {self.every_steps} must be >= 0")
        bad = [k for k in self.kinds if k not in FAULT_KINDS]
        if bad:
            raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(FAULT_KINDS)}")
        self.injected = {k: 0 for k in self.kinds}

    def at_step(self, step: int) -> None:
        """The run reached step boundary ``step`` (the next step to run): every multiple of ``every_steps`` in
        (the last boundary seen, ``step``] makes one fault of each kind due (a skipped boundary is not lost)."""
        if not self.every_steps:
            return
        for s in range(self._seen + 1, step + 1):
            if s % self.every_steps == 0:
                for k in self.kinds:
                    self.due[k] = self.due.get(k, 0) + 1
        self._seen = max(self._seen, step)

    def pending(self) -> list[str]:
        """The kinds with a fault due, in ``kinds`` order."""
        return [k for k in self.kinds if self.due.get(k, 0) > 0]

    def done(self, kind: str) -> None:
        """One due fault of ``kind`` was injected."""
        self.due[kind] -= 1
        self.injected[kind] += 1
