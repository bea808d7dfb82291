"""The pure version store of a weight holder: publish (cast-copy, chunk checksums, delta), hold, eviction.

:class:`VersionStore` owns the held versions and the host buffers they live in; it never touches a socket.
:class:`~rlboost_hpc.weights.server.WeightServer` serves what it holds over ZeroMQ — the same split as the
rollout manager's pure core and its I/O service.

Invariants:
- Immutable versions: a published buffer is never modified; its manifest (layout + per-chunk xxh3_64
  checksums) is computed once, before the version becomes visible. Version numbers strictly increase.
- Bounded memory: at most ``keep_versions`` versions are held, in a pool of ``keep_versions + 1`` host buffers
  (the one being written rotates through it); a lookup of an evicted version finds nothing, never bytes of another
  version. Views handed out (chunk frames queued for sending, an in-process engine's tensors) keep their buffer
  alive: the pool reuses a buffer only once nothing views it. With a share directory the buffers are shared-memory
  files that engine processes of this node map (:mod:`rlboost_hpc.weights.shared`): a buffer a reader holds is
  never rewritten, and a version is offered to them only once complete (its manifest written beside it).
- Delta versions (:mod:`rlboost_hpc.weights.delta`): with ``delta`` on, version v is also encoded against the
  version published just before it (same layout) and offered to pullers that hold exactly that version — when its
  bytes are below ``delta_max_ratio`` of the full version. The manifest's checksums stay those of the full
  version, so a puller verifies what it assembled, whatever the route.
- Thread-safe: publishes run in the caller's thread; lookups (the serving thread) take one short lock.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import msgspec
import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.weight_msgs import (DeltaInfo, Manifest, Sealed, chunk_checksum, combine_checksums,
                                              layout_checksum, num_chunks)
from rlboost_hpc.weights import delta as delta_codec
from rlboost_hpc.models import layout
from rlboost_hpc.weights import sealed as sealing
from rlboost_hpc.weights.held import Held, reply_frames
from rlboost_hpc.weights.shared import SharedBufferPool

log = logging.getLogger(__name__)

_COPY_THREADS_LOCK = threading.Lock()


class VersionStore:
    """The last ``keep_versions`` weight versions a holder serves (see the module docstring).

    Args:
        chunk_bytes: chunk size in bytes (> 0): the unit of checksums, requests and deltas.
        keep_versions: number of versions held (≥ 1); older ones are evicted on publish.
        pin_memory, copy_threads, delta, delta_max_ratio, delta_threads, share_dir: as
            :class:`~rlboost_hpc.weights.server.WeightServer`.

    Raises:
        ValueError: a size, count or ratio out of range.
    """

    def __init__(self, chunk_bytes: int = D.WEIGHT_CHUNK_BYTES, keep_versions: int = 2, *, pin_memory: bool = False,
                 copy_threads: int | None = None, delta: bool = True, delta_max_ratio: float = 0.5,
                 delta_threads: int | None = None, share_dir: str | os.PathLike[str] | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        if delta_threads is None:
            delta_threads = min(8, os.cpu_count() or 1)
        if not 0 < delta_max_ratio <= 1 or delta_threads < 1:
            raise ValueError(f"delta_max_ratio must be in (0, 1] and delta_threads >= 1, got {delta_max_ratio}, "
                             f"{delta_threads}")
        self.chunk_bytes = int(chunk_bytes)
        self.keep_versions = int(keep_versions)
        self._delta = bool(delta)
        self._delta_overlap = True  # each chunk's delta encoded once it is hashed (False: after the last; ablation)
        self.delta_max_ratio = float(delta_max_ratio)
        self._delta_threads = int(delta_threads)
        # the held versions plus the one being written rotate; between publishes the spare stays mapped (host
        # memory: one version's bytes more than the held versions, for no page faults on the next publish)
        self._buffers: layout.HostBufferPool | SharedBufferPool = (
            SharedBufferPool(share_dir, keep_versions + 1, pin_memory=pin_memory) if share_dir is not None
            else layout.HostBufferPool(keep_versions + 1, pin_memory=pin_memory))
        self._copy_threads = copy_threads
        self._lock = threading.Lock()
        self._held: "collections.OrderedDict[int, Held]" = collections.OrderedDict()
        self._last_version: int | None = None
        #: The holder's sealed port (set by the server once bound; None: versions are not sealed).
        self.sealed_port: int | None = None
        self._stats: dict[str, Any] = {
            **dict.fromkeys(("publishes", "delta_publishes", "delta_failures"), 0),
            **dict.fromkeys(("publish_seconds", "publish_copy_seconds", "publish_hash_seconds", "delta_seconds"), 0.0),
        }

    @property
    def stats(self) -> dict[str, Any]:
        """Publishes and their seconds (``WeightServer.stats`` documents each), and the buffer pool's counters."""
        s = dict(self._stats)
        s["publish_buffers_reused"] = self._buffers.reused
        s["publish_buffers_pinned"], s["publish_pin_failures"] = self._buffers.pinned, self._buffers.pin_failures
        return s

    def lookup(self, version: int | None) -> tuple[Held | None, list[int]]:
        """The held ``version`` (None: the latest), or None; and every held version, oldest first — one snapshot."""
        with self._lock:
            return self._lookup(version), list(self._held)

    def clear(self) -> None:
        """Drop every held version (views handed out keep their buffers alive)."""
        with self._lock:
            self._held.clear()

    @property
    def versions(self) -> list[int]:
        """Versions currently held, oldest first."""
        with self._lock:
            return list(self._held)

    @property
    def latest(self) -> int | None:
        """Newest held version, or None before the first publish."""
        with self._lock:
            return next(reversed(self._held), None)

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = torch.bfloat16,
    ) -> Manifest:
        """Copy ``state_dict`` into one new host buffer as ``version`` and make it available to pullers.

        Floating-point tensors are cast to ``dtype`` (``None`` keeps their dtype); integer/bool tensors
        keep theirs. Tensors are placed in sorted-name order (:mod:`rlboost_hpc.models.layout`).
        Checksums are computed before the version becomes visible; the oldest versions beyond
        ``keep_versions`` are then evicted. Runs in the caller's thread (≈ one cast-copy pass plus one
        xxh3 pass over the bytes; see ``stats["publish_seconds"]``); with deltas on, each chunk's delta against
        the previous version is encoded on ``delta_threads`` as soon as the chunk is hashed, overlapped with the
        next chunks, and the publish waits for the last (``stats["delta_seconds"]``). A
        :class:`~rlboost_hpc.models.layout.FlatState` packed for ``dtype`` costs the same whatever its tensor
        count: one cast-copy, chunk by chunk, each chunk hashed right after it (overlapped with the next chunks'
        copies when the weights are on a device). The buffer is one an evicted version used once nothing views it
        any more (:class:`~rlboost_hpc.models.layout.HostBufferPool`: no page faults), else a new one. May be
        called before the holder serves.

        Returns:
            The version's :class:`Manifest`.

        Raises:
            ValueError: ``version`` is negative or not greater than every version published before, or a
                dtype cannot be transferred. TypeError: a value is not a tensor.
        """
        t0 = time.perf_counter()
        version = int(version)
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._lock:
            self._check_newer(version)
        table, total = layout.plan(state_dict, dtype)
        buffer = self._buffers.take(total)
        view = memoryview(buffer.numpy()).toreadonly()
        cb = self.chunk_bytes
        n = num_chunks(total, cb)
        base = self._delta_base(table, total)
        with contextlib.ExitStack() as stack:
            enc = None if base is None else stack.enter_context(delta_codec.Encoder(
                view, base.view, cb, base.manifest.version, base.manifest.checksum, threads=self._delta_threads))
            ready = enc.chunk_ready if enc is not None and self._delta_overlap else None
            with self._torch_threads():
                if isinstance(state_dict, layout.FlatState) and state_dict.table is table:
                    digests = self._cast_and_hash(state_dict, buffer, view, n, ready)
                else:
                    t_copy = time.perf_counter()
                    layout.flatten_into(buffer, state_dict, table)
                    t_hash = time.perf_counter()
                    digests = [self._hash_chunk(view, i, ready) for i in range(n)]
                    self._stats["publish_copy_seconds"] += t_hash - t_copy
                    self._stats["publish_hash_seconds"] += time.perf_counter() - t_hash
            access, sealer = self.new_access()
            manifest = Manifest(version=version, total_bytes=total, chunk_bytes=cb, tensors=table,
                                chunk_checksums=digests, checksum=combine_checksums(digests),
                                layout=layout_checksum(table), sealed=access)
            held = Held(manifest, reply_frames(manifest), buffer, view, n, sealer=sealer)
            if enc is not None:
                held = self._with_delta(held, enc)
            if isinstance(self._buffers, SharedBufferPool):  # complete: engine processes of this node may map it
                self._buffers.finished(buffer, manifest)
        with self._lock:
            self._check_newer(version)  # again: another publish may have run meanwhile
            self._held[version] = held
            self._stats["delta_publishes"] += held.delta is not None
            self._last_version = version
            while len(self._held) > self.keep_versions:
                self._held.popitem(last=False)
        self._stats["publishes"] += 1
        self._stats["publish_seconds"] += time.perf_counter() - t0
        return manifest

    def _check_newer(self, version: int) -> None:
        """Raise ValueError unless ``version`` is above every version published before (hold the lock)."""
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"weight versions must strictly increase: got {version} after {self._last_version}")

    def new_access(self, key: bytes | None = None, ticket: bytes | None = None
                    ) -> "tuple[Sealed | None, sealing.Sealer | None]":
        """The sealed access of a version served here: fresh key and ticket (or the given ones: a relay holder
        adopts the trainer's) with the holder's sealed port; (None, None) when the holder does not seal."""
        port = self.sealed_port
        if port is None:
            return None, None
        if key is None or ticket is None:
            key, ticket = sealing.new_access()
        return Sealed(port=port, key=key, ticket=ticket), sealing.Sealer(key)

    @contextlib.contextmanager
    def _torch_threads(self) -> Iterator[None]:
        """torch's intra-op threads set to ``copy_threads`` for the block (process-wide; restored after)."""
        if self._copy_threads is None:
            yield
            return
        with _COPY_THREADS_LOCK:
            before = torch.get_num_threads()
            torch.set_num_threads(self._copy_threads)
            try:
                yield
            finally:
                torch.set_num_threads(before)

    def _hash_chunk(self, view: memoryview, i: int, ready: Callable[[int], None] | None) -> int:
        """Chunk ``i``'s checksum; then ``ready(i)`` (its delta is encoded while the next chunks are written)."""
        cb = self.chunk_bytes
        digest = chunk_checksum(view[i * cb : (i + 1) * cb])
        if ready is not None:
            ready(i)
        return digest

    def _cast_and_hash(self, state: layout.FlatState, buffer: torch.Tensor, view: memoryview, n: int,
                       ready: Callable[[int], None] | None = None) -> list[int]:
        """Chunk checksums of ``state`` cast into ``buffer``, chunk by chunk: each chunk is hashed right after its
        cast, while it is still in cache, then handed to ``ready`` (the delta encoder) — from host memory in this
        thread (a concurrent cast and hash only compete for the same memory bandwidth: measured 40 ms interleaved
        vs 56 ms in two threads for 275 MB on 2 cores), from a device in overlap: a helper thread drives the
        device-to-host copies of the next chunks while this one hashes. Chunk sizes that are not a multiple of
        the wire item size: one cast first."""
        cb = self.chunk_bytes
        spent = {"copy": 0.0, "hash": 0.0}

        def timed(what: str, fn: Callable[..., Any], *args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[what] += time.perf_counter() - t

        def digest(i: int) -> int:
            return timed("hash", self._hash_chunk, view, i, ready)

        if cb % state.wire_dtype.itemsize:
            timed("copy", state.cast_into, buffer)
            digests = [digest(i) for i in range(n)]
        elif state.flat.device.type == "cpu" or n <= 1:
            digests = [(timed("copy", state.cast_into, buffer, i * cb, (i + 1) * cb), digest(i))[1] for i in range(n)]
        else:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="publish-copy") as ex:
                cast = [ex.submit(timed, "copy", state.cast_into, buffer, i * cb, (i + 1) * cb) for i in range(n)]
                digests = [(cast[i].result(), digest(i))[1] for i in range(n)]
        self._stats["publish_copy_seconds"] += spent["copy"]
        self._stats["publish_hash_seconds"] += spent["hash"]
        return digests

    def _delta_base(self, table: Any, total: int) -> Held | None:
        """The version a new one of layout ``table`` is encoded against: the newest held version when deltas are
        on and it has the same layout and chunk size; else None."""
        if not self._delta or total == 0:
            return None
        with self._lock:
            base = self._lookup(None)
        if base is None or base.manifest.tensors != table or base.manifest.chunk_bytes != self.chunk_bytes:
            return None
        return base

    def _with_delta(self, held: Held, enc: delta_codec.Encoder) -> Held:
        """``held`` plus its delta (``enc``'s, waited for), when it is below ``delta_max_ratio`` of the full
        bytes. ``stats["delta_seconds"]`` counts the wait: the delta's cost to the publish beyond what overlapped
        with the copy and the checksums. A delta that runs out of memory is dropped (the version is served full;
        ``stats["delta_failures"]``): it only saves bytes."""
        t0 = time.perf_counter()
        try:
            d = enc.result()
        except MemoryError:
            log.warning("version %d: out of memory encoding its delta; served in full", held.manifest.version)
            self._stats["delta_failures"] += 1
            return held
        finally:
            self._stats["delta_seconds"] += time.perf_counter() - t0
        m = held.manifest
        if d.nbytes >= self.delta_max_ratio * m.total_bytes:
            return held
        info = DeltaInfo(base_version=d.base_version, base_checksum=d.base_checksum, sizes=d.sizes, nbytes=d.nbytes)
        frames = reply_frames(msgspec.structs.replace(m, delta=info))
        return dataclasses.replace(held, delta=d, delta_manifest_frames=frames)

    def delta_nbytes(self, version: int | None = None) -> int | None:
        """Bytes a puller holding the previous version receives for ``version`` (None: latest) through its
        delta; None when the version has no delta. Raises KeyError if the version is not held."""
        with self._lock:
            held = self._lookup(version)
        if held is None:
            raise KeyError(f"version {version} is not held (held: {self.versions})")
        return None if held.delta is None else held.delta.nbytes

    def hold(self, manifest: Manifest, buffer: torch.Tensor, delta_payloads: Mapping[int, bytes] | None = None) -> None:
        """Serve a version this process pulled and verified (a relay holder): no copy, no hashing — chunk
        requests are answered from ``buffer`` (uint8, ≥ ``manifest.total_bytes``), and delta requests from
        ``delta_payloads`` (chunk index → the payload it applied, against ``manifest.delta.base_version``).
        A version the trainer serves sealed is sealed here too, under the trainer's key and ticket, on the
        holder's sealed port (when it has one).
        Replaces whatever was held. The caller must :meth:`withdraw` before it modifies ``buffer``; pullers
        verify every chunk against the trainer's manifest, so bytes sent after a modification are rejected,
        never accepted.
        """
        n = num_chunks(manifest.total_bytes, manifest.chunk_bytes)
        d = None
        if manifest.delta is not None and delta_payloads:
            payloads = [delta_payloads.get(i) for i in range(n)]
            d = delta_codec.Delta(manifest.delta.base_version, manifest.delta.base_checksum, list(manifest.delta.sizes),
                                  payloads, manifest.delta.nbytes, manifest.total_bytes)
        access, sealer = (None, None) if manifest.sealed is None else \
            self.new_access(manifest.sealed.key, manifest.sealed.ticket)
        plain = msgspec.structs.replace(manifest, delta=None, sealed=access)
        buf = buffer[: manifest.total_bytes]
        held = Held(plain, reply_frames(plain), buf, memoryview(buf.numpy()).toreadonly(), n, d, None, sealer)
        with self._lock:
            self._held.clear()
            self._held[manifest.version] = held
            self._last_version = manifest.version

    def withdraw(self) -> None:
        """Stop serving every held version (requests get ``no_version``); chunks already queued still go out."""
        with self._lock:
            self._held.clear()

    def manifest(self, version: int | None = None) -> Manifest:
        """Manifest of a held ``version`` (None: latest). Raises KeyError if not held."""
        with self._lock:
            held = self._lookup(version)
        if held is None:
            raise KeyError(f"version {version} is not held (held: {self.versions})")
        return held.manifest

    def local_state_dict(self, version: int | None = None) -> Mapping[str, torch.Tensor]:
        """Tensors viewing the published buffer of ``version`` (None: latest), for an in-process engine.

        Dtypes/shapes as published; no copy (a :class:`~rlboost_hpc.models.layout.FlatState` when the
        version has one dtype). The tensors keep the buffer alive after eviction; they must
        be treated as read-only.

        Raises:
            KeyError: the version is not held.
        """
        with self._lock:
            held = self._lookup(version)
        if held is None:
            raise KeyError(f"version {version} is not held (held: {self.versions})")
        return layout.state_view(held.buffer, held.manifest.tensors)

    def _lookup(self, version: int | None) -> Held | None:
        if version is None:
            return self._held[next(reversed(self._held))] if self._held else None
        return self._held.get(version)
