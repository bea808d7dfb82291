"""Shared state of one pull's transfer phase (:class:`Transfer`) and its failure (:class:`Failed`).

The puller's stream threads share one :class:`Transfer`: the queue of chunk indices still to fetch, the digests
of the chunks verified so far (they survive a change of source: relay peer → backup → trainer), the delta plan,
the counters reported in ``PulledWeights.phases`` and the first failure, which stops every stream.
"""
from __future__ import annotations

import collections
import threading

from rlboost_hpc.protocol.weight_msgs import DeltaInfo, Manifest, Sealed
from rlboost_hpc.weights import sealed as sealing


class Failed(Exception):
    """A transfer step failed: ``cause`` (human-readable) and the holder's error ``code`` when it refused."""

    def __init__(self, cause: str, code: str | None = None):
        super().__init__(cause)
        self.cause = cause
        self.code = code


class Transfer:
    """Shared state of the transfer phase: index queue, digests, first failure.

    ``delta``/``base_digests``: set for a delta pull (``dest`` then holds the base version's bytes); chunk i
    is then unchanged (``local[i]``: nothing is requested, a stream hashes the base's bytes in place and fetches
    the chunk in full when they no longer match — a base is never taken on trust), fetched as a delta payload,
    or in full.
    """

    def __init__(self, manifest: Manifest, dest: memoryview, timeout_s: float, deadline: float | None,
                 delta: DeltaInfo | None = None, base_digests: list[int] | None = None):
        self.m = manifest
        self.dest = dest
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.n = len(manifest.chunk_checksums)
        self.lock = threading.Lock()
        self.digests: list[int | None] = [None] * self.n
        self.use_delta = [False] * self.n
        self.local = [False] * self.n
        self.delta_fallbacks = self.base_mismatches = 0
        if delta is not None and base_digests is not None:
            for i, size in enumerate(delta.sizes):
                lo, hi = self.span(i)
                self.local[i] = size == 0 and base_digests[i] == manifest.chunk_checksums[i]
                self.use_delta[i] = 0 < size < hi - lo
        self.base = None if delta is None else delta.base_version
        self.todo = collections.deque(range(self.n))
        self.received = 0
        self.retries = 0
        self.bytes_received = 0
        self.peer_bytes = 0
        self.failovers = 0
        self.payloads: dict[int, bytes] = {}  # verified delta payloads by chunk
        self.hash_s = 0.0
        self.stop = threading.Event()
        self.error: Failed | None = None
        # of the current source: the sealed access (ticket) and its sealer, or None over CURVE
        self.sealed: Sealed | None = None
        self.sealer: sealing.Sealer | None = None
        self.sealed_bytes = 0

    def begin(self, timeout_s: float) -> None:
        """Start (or restart, on another source) the transfer of every chunk not verified yet."""
        self.timeout_s = timeout_s
        self.todo = collections.deque(i for i in range(self.n) if self.digests[i] is None)
        self.stop.clear()
        self.error = None

    def fall_back(self, index: int) -> None:
        """Fetch chunk ``index`` in full from now on (its delta failed or is not served)."""
        with self.lock:
            self.use_delta[index] = False
            self.delta_fallbacks += 1

    def spoilt_base(self, index: int) -> None:
        """The base's bytes of unchanged chunk ``index`` fail its checksum: fetch it in full."""
        with self.lock:
            self.local[index] = False
            self.base_mismatches += 1

    def take(self) -> int | None:
        with self.lock:
            return self.todo.popleft() if self.todo else None

    def fail(self, err: Failed) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
        self.stop.set()

    def span(self, index: int) -> tuple[int, int]:
        cb = self.m.chunk_bytes
        return index * cb, min(self.m.total_bytes, (index + 1) * cb)
