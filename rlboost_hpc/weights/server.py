"""Weight holder: the socket server over a :class:`~rlboost_hpc.weights.store.VersionStore`.

The trainer (one holder per training node) calls :meth:`WeightServer.publish` after the optimizer step (the store
casts, hashes, delta-encodes and keeps the version); rollout instances pull it themselves
(:mod:`rlboost_hpc.weights.puller`) over a ZeroMQ ROUTER socket served by a background thread. A relay holder
serves a version it pulled (:meth:`WeightServer.hold`). The store's invariants (immutable, strictly increasing
versions; bounded memory; deltas verified as full versions) are stated in :mod:`rlboost_hpc.weights.store`.

Invariants of the serving side:
- A request for a version the store no longer holds gets an explicit ``version_gone`` error, never bytes of
  another version. Chunks already queued for sending keep their (evicted) buffer alive until sent or dropped, so
  a puller never receives recycled memory.
- Never blocks on a peer: every send is non-blocking on a ROUTER with ``ROUTER_MANDATORY``; a reply to a
  vanished peer or to one whose queue is full (a peer violating its request window) is dropped and
  counted. A slow or SIGKILLed puller therefore costs nothing but its queued frames.
- Survives garbage: any frame that is not a valid request (see
  :func:`rlboost_hpc.protocol.weight_msgs.decode_request`) is answered with a ``bad_request`` error,
  counted in :attr:`WeightServer.stats` and logged once per peer; the serving thread keeps running.
- Zero copy on the send path: chunk payloads are ``memoryview`` slices of the buffer sent with
  ``copy=False``.
- Sealed chunks (with CURVE keys and ``sealed`` on; :mod:`rlboost_hpc.weights.sealed`): a second, plain ROUTER
  socket on the same host serves ``GetChunk`` requests carrying the version's ticket with the chunk sealed under
  the version's AES-256-GCM key; key, ticket and port travel only in the manifest, which is served only on the
  CURVE socket. The CURVE socket serves chunks too (pullers that do not seal).
"""
from __future__ import annotations

import collections
import hmac
import logging
import os
import threading
from typing import Any, Callable, Mapping

import torch
import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.auth import RunKeys, max_msg_size, secure_server, stop_authenticator
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import Chunk, Error, ErrorCode, GetChunk, GetManifest, Manifest, decode_request, encode
from rlboost_hpc.models import layout
from rlboost_hpc.weights import sealed as sealing
from rlboost_hpc.weights.store import VersionStore

log = logging.getLogger(__name__)

# libzmq drops (and disconnects) any inbound frame above this; frames between MAX_REQUEST_BYTES and this
# are rejected by us as "oversized" and counted.
_MAX_INBOUND_FRAME = 1 << 20
_POLL_MS = 50
_MAX_BATCH = 256
_MAX_LOGGED_PEERS = 4096
# Per-connection send queue of the sealed port, in message parts (a chunk is 2): sealed frames are allocations,
# not views of the held buffer, so a peer that requests without reading holds at most 32 chunks of memory; a
# puller keeps at most `window` (default 4) requests outstanding per stream.
_SEALED_SNDHWM = 64


class WeightServer:
    """Holds the last ``keep_versions`` weight versions and serves them over a ZeroMQ ROUTER socket.

    Args:
        bind: ZeroMQ endpoint to bind; port 0 picks a free port (see :attr:`endpoint`).
        chunk_bytes: chunk size in bytes (> 0); each chunk is one request/reply.
        keep_versions: number of versions held (≥ 1); older ones are evicted on publish.
        io_threads: libzmq I/O threads of the server's private context. Default: 1 for plain TCP; with CURVE
            ``min(4, cpus)`` — libsodium encrypts each connection on the I/O thread that owns it, so one thread
            caps every encrypted pull near one core's ~1 GB/s whatever the number of streams.
        sndhwm: per-peer send queue limit in messages; replies beyond it are dropped (a well-behaved
            puller has at most ``window`` requests outstanding per socket).
        pin_memory: pin the host buffers versions are published into (``cudaHostRegister``, once per pooled
            buffer; needs CUDA): device-to-host export at the link's rate instead of through the driver's
            staging copy; ``keep_versions + 1`` versions' bytes stay locked in host memory. A buffer the driver
            refuses to pin stays pageable (``stats["publish_pin_failures"]``).
        copy_threads: torch intra-op threads for the cast-copy of CPU tensors in :meth:`publish`
            (temporarily set process-wide, then restored); None leaves torch's setting alone. On small or
            shared hosts 1 is much faster (measured 20× on a busy 2-core VM: the OpenMP team waits for
            descheduled threads, and the copy is memory-bound anyway).
        delta: also encode each version against the one published before it and offer that delta to
            pullers holding it.
        delta_max_ratio: a delta is kept only when its bytes are below this fraction of the full version.
        sealed: with ``keys``, also serve every version's chunks sealed with AES-256-GCM on a plain TCP port of
            the same host (:mod:`rlboost_hpc.weights.sealed`: ~7× CURVE's encryption rate per core); versions
            published before :meth:`start` are served over CURVE only.
        delta_threads: threads encoding a delta's chunks (numpy and zstd release the GIL; default
            ``min(8, cpus)``; measured 1.6 GiB/s on 2 threads for sparse RL updates, 0.9 GiB/s for dense ones).
        share_dir: keep the versions in shared-memory files of this directory, which engine processes of this node
            map instead of pulling (:mod:`rlboost_hpc.weights.shared`; None: private host buffers).

    The versions live in :attr:`store` (a :class:`~rlboost_hpc.weights.store.VersionStore` built from
    ``chunk_bytes``, ``keep_versions``, ``pin_memory``, ``copy_threads`` and the delta settings; ValueError when one
    is out of range); this class adds the sockets. Use as a context manager, or call :meth:`start` / :meth:`close`.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        chunk_bytes: int = D.WEIGHT_CHUNK_BYTES,
        keep_versions: int = 2,
        *,
        io_threads: int | None = None,
        sndhwm: int = 1024,
        pin_memory: bool = False,
        copy_threads: int | None = None,
        keys: "RunKeys | None" = None,
        delta: bool = True,
        delta_max_ratio: float = 0.5,
        delta_threads: int | None = None,
        sealed: bool = True,
        share_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.store = VersionStore(chunk_bytes, keep_versions, pin_memory=pin_memory, copy_threads=copy_threads,
                                  delta=delta, delta_max_ratio=delta_max_ratio, delta_threads=delta_threads,
                                  share_dir=share_dir)
        self.chunk_bytes = self.store.chunk_bytes
        self._bind = bind
        self._keys = keys  # CURVE: only clients with the run's key may connect (protocol/auth.py)
        self._sealed = bool(sealed) and keys is not None and bind.startswith("tcp://")
        self._bulk_sock: zmq.Socket | None = None  # the sealed port's ROUTER (plain TCP)
        self._io_threads = io_threads if io_threads is not None else (min(4, os.cpu_count() or 1) if keys else 1)
        self._sndhwm = sndhwm
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._endpoint: str | None = None
        self._logged_peers: set[bytes] = set()
        self._crash: BaseException | None = None
        #: Test hook: ``f(version, index, payload) -> payload`` applied to every chunk before sending.
        self._payload_hook: Callable[[int, int, memoryview], Any] | None = None
        self._stats: dict[str, Any] = {
            **dict.fromkeys(("manifests_served", "chunks_served", "bytes_served", "rejected", "dropped_unreachable",
                             "dropped_full", "internal_errors", "delta_chunks_served", "delta_bytes_served",
                             "sealed_chunks_served", "sealed_bytes_served"), 0),
            "errors_sent": collections.Counter(), "rejected_by_reason": collections.Counter(),
        }
        self._stats_lock = threading.Lock()  # guards the Counters (they grow keys while being copied)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "WeightServer":
        """Bind the socket and start the serving thread. Idempotent. Returns self.

        Raises:
            zmq.ZMQError: the endpoint cannot be bound.
        """
        if self._thread is not None:
            return self
        ctx = zmq.Context(io_threads=self._io_threads)
        sock = bulk = None
        try:
            sock = self._router(ctx, self._keys, self._sndhwm)
            secure_server(sock, self._keys)
            sock.bind(self._bind)
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._sealed:  # same interface, any free port; plain TCP: the chunks are sealed instead
                bulk = self._router(ctx, None, _SEALED_SNDHWM)
                bulk.bind(self._bind.rsplit(":", 1)[0] + ":0")
                self.store.sealed_port = int(bulk.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
                layout.retain_frame_buffers(self.chunk_bytes + sealing.TAG_BYTES, 16)  # sealed frames: no faults
        except BaseException:
            for s in (sock, bulk):
                if s is not None:
                    s.close(0)
            stop_authenticator(ctx)
            ctx.term()
            raise
        self._ctx, self._sock, self._bulk_sock = ctx, sock, bulk
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name=f"weight-server {self._endpoint}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the serving thread, close the socket (linger 0) and drop all held versions. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for s in (self._sock, self._bulk_sock):
            if s is not None:
                s.close(0)
        self._sock = self._bulk_sock = None
        self.store.sealed_port = None
        if self._ctx is not None:
            stop_authenticator(self._ctx)
            self._ctx.term()
            self._ctx = None
        self.store.clear()

    @staticmethod
    def _router(ctx: zmq.Context, keys: "RunKeys | None", sndhwm: int) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.RCVHWM, 4096)
            sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size(_MAX_INBOUND_FRAME, keys))
        except BaseException:
            sock.close(0)
            raise
        return sock

    def __enter__(self) -> "WeightServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """The bound endpoint, e.g. ``"tcp://127.0.0.1:41234"``. Raises RuntimeError before :meth:`start`."""
        if self._endpoint is None:
            raise RuntimeError("WeightServer not started")
        return self._endpoint

    def is_alive(self) -> bool:
        """True while the serving thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> dict[str, Any]:
        """Snapshot of counters: manifests/chunks/bytes served, errors sent by code, rejected frames
        (total and by :attr:`ProtocolError.reason` or ``framing``), replies dropped because the peer
        vanished or its queue was full, publishes and total publish seconds (delta encoding included) — of
        them, seconds spent casting/copying into the buffer and hashing chunks (each summed over the threads
        doing it: they overlap for a :class:`~rlboost_hpc.models.layout.FlatState` on a device), and
        publishes into a buffer reused from an evicted version (``publish_buffers_reused``), buffers pinned and
        left pageable by a refused pin (``publish_buffers_pinned``, ``publish_pin_failures``) — internal
        errors; versions published with a delta (and deltas dropped for lack of memory: ``delta_failures``), seconds
        waited for deltas, delta payloads and their bytes served (``chunks_served`` / ``bytes_served`` count full
        chunks only)."""
        with self._stats_lock:
            s = dict(self._stats)
            s["errors_sent"] = dict(s["errors_sent"])
            s["rejected_by_reason"] = dict(s["rejected_by_reason"])
        return {**s, **self.store.stats}

    # ------------------------------------------------------------------ the store (publishing, holding)
    @property
    def versions(self) -> list[int]:
        """Versions currently held, oldest first."""
        return self.store.versions

    @property
    def latest(self) -> int | None:
        """Newest held version, or None before the first publish."""
        return self.store.latest

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor],
                dtype: torch.dtype | None = torch.bfloat16) -> Manifest:
        """:meth:`VersionStore.publish <rlboost_hpc.weights.store.VersionStore.publish>`: ``state_dict`` as
        ``version``, served from now on (may be called before :meth:`start`)."""
        return self.store.publish(version, state_dict, dtype)

    def hold(self, manifest: Manifest, buffer: torch.Tensor, delta_payloads: Mapping[int, bytes] | None = None) -> None:
        """:meth:`VersionStore.hold <rlboost_hpc.weights.store.VersionStore.hold>`: serve a version this process
        pulled and verified (a relay holder), from ``buffer`` without a copy."""
        self.store.hold(manifest, buffer, delta_payloads)

    def withdraw(self) -> None:
        """Stop serving every held version (requests get ``no_version``); chunks already queued still go out."""
        self.store.withdraw()

    def manifest(self, version: int | None = None) -> Manifest:
        """Manifest of a held ``version`` (None: latest). Raises KeyError if not held."""
        return self.store.manifest(version)

    def delta_nbytes(self, version: int | None = None) -> int | None:
        """Bytes a puller holding the previous version receives for ``version`` through its delta (None: no
        delta). Raises KeyError if the version is not held."""
        return self.store.delta_nbytes(version)

    def local_state_dict(self, version: int | None = None) -> Mapping[str, torch.Tensor]:
        """Read-only tensors viewing the buffer of ``version`` (None: latest), for an in-process engine (no copy).
        Raises KeyError if not held."""
        return self.store.local_state_dict(version)

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        socks = [s for s in (self._sock, self._bulk_sock) if s is not None]
        assert socks
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                for sock in socks:
                    if sock in ready:
                        self._drain(sock)
        except BaseException as e:  # pragma: no cover - socket-level failure; make it visible
            self._crash = e
            log.exception("weight server %s: serving thread crashed", self._endpoint)
            raise

    def _drain(self, sock: zmq.Socket) -> None:
        """Handle up to ``_MAX_BATCH`` requests waiting on ``sock``; none once the server is stopping."""
        for _ in range(_MAX_BATCH):
            if self._stop.is_set():
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(frames, sock)
            except zmq.ZMQError:
                raise
            except Exception as e:  # a bug or a failing test hook: say so, keep serving
                self._stats["internal_errors"] += 1
                log.exception("weight server %s: error while handling a request", self._endpoint)
                self._send_error(frames[0].bytes, None, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", sock)

    def _handle(self, frames: list[zmq.Frame], sock: zmq.Socket) -> None:
        peer = frames[0].bytes
        if len(frames) != 2:
            self._reject(peer, "framing", f"expected 1 frame after the identity, got {len(frames) - 1}", sock)
            return
        try:
            req = decode_request(frames[1].buffer)
        except ProtocolError as e:
            self._reject(peer, e.reason, str(e), sock)
            return
        sealed_port = sock is self._bulk_sock
        if sealed_port and isinstance(req, GetManifest):
            self._reject(peer, "sealed_port", "manifests are served on the authenticated endpoint only", sock)
            return
        held, versions = self.store.lookup(req.version)
        if held is None:
            self._send_error(peer, req, *self._why_missing(req.version, versions), sock)
            return
        sealer = None
        if sealed_port:
            access = held.manifest.sealed
            if access is None or held.sealer is None or req.ticket is None \
                    or not hmac.compare_digest(req.ticket, access.ticket):
                self._send_error(peer, req, ErrorCode.UNAUTHORIZED, f"no valid ticket for version {req.version} "
                                 "(it is in the version's manifest, served on the authenticated endpoint)", sock)
                return
            sealer = held.sealer
        delta = held.delta if req.base is not None and held.delta is not None \
            and held.delta.base_version == req.base else None
        if isinstance(req, GetManifest):
            if self._send(peer, [held.manifest_frame(req)]):
                self._stats["manifests_served"] += 1
            return
        assert isinstance(req, GetChunk)
        if req.index >= held.n_chunks:
            self._send_error(
                peer, req, ErrorCode.BAD_INDEX,
                f"chunk {req.index} out of range: version {req.version} has {held.n_chunks} chunks", sock,
            )
            return
        if req.base is not None:
            payload: Any = None if delta is None else delta.payloads[req.index]
            if payload is None:
                self._send_error(peer, req, ErrorCode.NO_DELTA,
                                 f"no delta payload of chunk {req.index} of version {req.version} against version "
                                 f"{req.base}: fetch it in full", sock)
                return
            payload = memoryview(payload)
        else:
            cb = held.manifest.chunk_bytes
            payload = held.view[req.index * cb : (req.index + 1) * cb]
        self._serve_chunk(peer, req, payload, sealer, sock)

    def _serve_chunk(self, peer: bytes, req: GetChunk, payload: memoryview, sealer: "sealing.Sealer | None",
                     sock: zmq.Socket) -> None:
        """Send ``payload`` (chunk ``req.index`` of ``req.version``, or its delta payload against ``req.base``) —
        sealed when ``sealer`` is given. The test hook sees the frame as it goes on the wire."""
        nbytes, nonce, frame = payload.nbytes, None, payload
        if sealer is not None:
            nonce, frame = sealer.seal(payload, req.version, req.index, req.base)
        if self._payload_hook is not None:
            frame = self._payload_hook(req.version, req.index, memoryview(frame))
        header = encode(Chunk(version=req.version, index=req.index, nbytes=len(frame), base=req.base, nonce=nonce))
        if not self._send(peer, [header, frame], sock):
            return
        kind = "delta_chunks_served" if req.base is not None else "chunks_served"
        self._stats[kind] += 1
        self._stats["delta_bytes_served" if req.base is not None else "bytes_served"] += nbytes
        if sealer is not None:
            self._stats["sealed_chunks_served"] += 1
            self._stats["sealed_bytes_served"] += nbytes

    @staticmethod
    def _why_missing(version: int | None, held: list[int]) -> tuple[str, str]:
        if not held:
            return ErrorCode.NO_VERSION, "no weight version has been published yet"
        if version is not None and version < held[-1]:
            return ErrorCode.VERSION_GONE, f"version {version} is no longer held (held: {held})"
        return ErrorCode.UNKNOWN_VERSION, f"version {version} has not been published (latest: {held[-1]})"

    def _send_error(self, peer: bytes, req: GetManifest | GetChunk | None, code: str, message: str,
                    sock: zmq.Socket | None = None) -> None:
        err = Error(
            code=code,
            message=message,
            version=getattr(req, "version", None),
            index=getattr(req, "index", None),
        )
        if self._send(peer, [encode(err)], sock):
            with self._stats_lock:
                self._stats["errors_sent"][code] += 1

    def _send(self, peer: bytes, parts: list[Any], sock: zmq.Socket | None = None) -> bool:
        sock = sock if sock is not None else self._sock
        assert sock is not None
        try:
            sock.send_multipart([peer, *parts], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._stats["dropped_full"] += 1
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._stats["dropped_unreachable"] += 1
        return False

    def _reject(self, peer: bytes, reason: str, detail: str, sock: zmq.Socket) -> None:
        with self._stats_lock:
            self._stats["rejected"] += 1
            self._stats["rejected_by_reason"][reason] += 1
        sealed_port = self._bulk_sock is not None and sock is self._bulk_sock
        if peer not in self._logged_peers and not sealed_port:  # anyone can reach the sealed port: its
            # rejections are counted, never logged (no log flooding by strangers)
            if len(self._logged_peers) >= _MAX_LOGGED_PEERS:
                self._logged_peers.clear()
            self._logged_peers.add(peer)
            log.warning(
                "weight server %s: rejected %s frame from peer %s: %s (later rejections from this peer "
                "are counted, not logged)", self._endpoint, reason, peer.hex(), detail[:200],
            )
        self._send_error(peer, None, ErrorCode.BAD_REQUEST, f"{reason}: {detail[:1000]}", sock)
