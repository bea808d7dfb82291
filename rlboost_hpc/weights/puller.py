"""Weight puller: a rollout instance fetches one complete, verified weight version from a holder.

Phases of :meth:`WeightPuller.pull` (each has a deadline; any failure raises :class:`WeightTransferError`
naming the phase, the endpoint, the version and the cause):

1. ``manifest`` — readiness handshake: ``GetManifest`` → the holder confirms it holds the version
   and states its layout and checksums *before* any weight bytes move. Deadline: ``timeout_s``.
2. ``transfer`` — first the plan (``_plan``: where the bytes go — the base's buffer when a delta against it
   applies, else ``into``, else the base's buffer when large enough, else a fresh one), then the streams:
   ``streams`` DEALER sockets, one thread each, share a queue of chunk indices; each keeps up
   to ``window`` ``GetChunk`` requests outstanding (credit-based pipelining: the holder never queues more
   than ``streams * window`` chunks for us). Payloads are received straight into their place in one
   preallocated uint8 buffer (``recv_into``: one copy, done by libzmq without the GIL) and verified with
   xxh3_64 as they land, overlapped with the other streams' receives. A bad chunk is re-requested once,
   then the pull fails. Deadlines: no reply on a stream for ``timeout_s`` (stall), and the optional
   overall ``deadline_s``.
3. ``verify`` — the whole-version checksum is recomputed from the digests of the bytes received.
4. ``assemble`` — tensors are views of the buffer (no copy); a pull into its base's buffer with the base's layout
   reuses the base's views (no per-tensor work).

Relay: the manifest always comes from the trainer (``endpoint``); chunks may come from ``peers`` — relay holders
that serve bytes only — tried in order, each with its own stall deadline (``peer_timeout_s``). A peer that
stalls, vanishes, refuses (it moved to another version, or never held this one) or sends a chunk that fails
its checksum twice is abandoned: the chunks already verified stay, the rest come from the next peer, finally
from the trainer — one version, whatever the route.

Sealed chunks: when the trainer's manifest (received over CURVE) offers ``sealed`` access, the streams fetch
the chunks from the holder's sealed port instead — plain TCP, every request carrying the version's ticket, every
payload AES-256-GCM-sealed under the version's key and opened straight into its place in the buffer
(:mod:`rlboost_hpc.weights.sealed`); a frame that does not open is treated like one that fails its checksum. A
relay peer is asked (over CURVE) for its sealed port; one that seals under the same key is used on it, any
other over CURVE.

Delta pulls: given the version it holds (``base``), the puller announces it in the manifest request; when
the holder has the requested version encoded against exactly that base (same whole-version checksum, same
layout), the transfer turns the base's buffer into the new version in place — unchanged chunks cost
no bytes (the base's bytes are hashed in place), changed ones arrive as delta payloads
(:mod:`rlboost_hpc.weights.delta`), the rest in full. Every chunk is verified against the manifest's checksum of
the *full* chunk; an unchanged chunk whose base bytes went bad, a delta that does not verify (wrong base, corrupt
payload) or that the holder no longer has is fetched again in full, so the result is the same
bytes as a full pull.

Invariants:
- All or nothing: a pull returns only a complete version whose every chunk matched the
  manifest's checksum and whose whole-version checksum matched; otherwise it raises and the partially
  filled buffer is discarded. Never mixed versions: every reply is checked against the requested
  version and an outstanding chunk index.
- Nothing left behind: every socket is closed with linger 0 and every stream thread joined on every exit path
  (success, error, timeout, KeyboardInterrupt), so a failed pull leaves no thread, no socket and no queued
  request that could block the holder. The ZeroMQ context is the process's puller context for that I/O-thread
  count (:func:`_context`), kept across pulls: its I/O threads — and the malloc arena the frames they receive
  come from, kept faulted in by :func:`~rlboost_hpc.weights.layout.retain_frame_buffers` — persist.
- Bounded input: reply headers above :data:`~rlboost_hpc.protocol.weight_msgs.MAX_HEADER_BYTES`, manifests
  above ``MAX_MANIFEST_BYTES`` and frames above ``chunk_bytes`` are rejected (libzmq ``MAXMSGSIZE``).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import msgspec
import torch
import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.auth import RunKeys, max_msg_size, secure_client

from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import (
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    Chunk,
    DeltaInfo,
    Error,
    ErrorCode,
    GetChunk,
    GetManifest,
    Manifest,
    Sealed,
    chunk_checksum,
    combine_checksums,
    decode_reply,
    encode,
    validate_manifest,
)
from rlboost_hpc.weights import delta as delta_codec
from rlboost_hpc.weights import layout
from rlboost_hpc.weights import sealed as sealing
from rlboost_hpc.weights.transfer import Failed as _Failed
from rlboost_hpc.weights.transfer import Transfer as _Transfer

_SLICE_S = 0.05  # longest single poll, so that a failure on one stream stops the others promptly


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a Slurm job's allocation, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def auto_streams(cores: int | None = None) -> int:
    """Streams of a pull when ``weights.streams = 0``: one per two usable cores (``cores``; default
    :func:`usable_cores`), at least 1, at most ``WEIGHT_STREAMS_MAX``. Each stream keeps two threads busy (its
    receiver, which also checksums, and a libzmq I/O thread); on 2 cores one stream reaches the socket's ceiling
    and more only contend (``benchmarks/bench_weights.py``)."""
    return max(1, min(D.WEIGHT_STREAMS_MAX, (cores if cores is not None else usable_cores()) // 2))


_contexts: dict[tuple[int, int], zmq.Context] = {}  # (pid, I/O threads) → the process's puller context
_contexts_lock = threading.Lock()


def _context(io_threads: int) -> zmq.Context:
    """This process's puller context with ``io_threads`` libzmq I/O threads, made on first use and kept. One
    context per pull started (and ended) I/O threads every time, and each new thread could be handed another
    malloc arena, whose heap then faulted the received frames in afresh (~2,000 minor faults per 16 MiB pull in
    a process with many threads). A forked child makes its own."""
    key = (os.getpid(), int(io_threads))
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None or ctx.closed:
            ctx = _contexts[key] = zmq.Context(io_threads=io_threads)
        return ctx


class WeightTransferError(RuntimeError):
    """A pull failed. Attributes: ``phase`` (manifest | transfer | verify | assemble), ``endpoint`` (the
    holder), ``version`` (requested, or resolved once the manifest arrived; None = latest), ``cause``
    (human-readable), ``code`` (the holder's :class:`~rlboost_hpc.protocol.weight_msgs.ErrorCode` when the
    holder refused, else None), ``puller`` (the puller's label, e.g. the rollout instance id)."""

    def __init__(self, phase: str, endpoint: str, version: int | None, cause: str, code: str | None = None,
                 puller: str = ""):
        self.phase = phase
        self.endpoint = endpoint
        self.version = version
        self.cause = cause
        self.code = code
        self.puller = puller
        v = "latest" if version is None else str(version)
        who = f" by {puller}" if puller else ""
        super().__init__(
            f"weight pull{who} of version {v} from holder {endpoint} failed in phase {phase!r}: {cause}"
        )


@dataclass
class PulledWeights:
    """One complete, verified weight version.

    version: the version pulled. state_dict: name → tensor (dtypes/shapes as published), all views of one uint8
    buffer of ``nbytes`` bytes — a :class:`~rlboost_hpc.weights.layout.FlatState` when every tensor has one dtype
    (views made on first use; an engine whose weights share the layout loads it with one copy). seconds: wall time
    of the whole pull. phases: wall seconds per phase (``manifest_s``, ``transfer_s`` — includes per-chunk
    verification overlapped with receiving, ``verify_s``, ``assemble_s``) plus ``chunk_hash_s`` (summed CPU seconds
    of per-chunk xxh3 over all streams), ``chunk_retries``, ``bytes_received`` (payload bytes over the wire), and
    for a delta pull ``delta_chunks`` / ``unchanged_chunks`` / ``full_chunks``, ``delta_fallbacks`` (delta chunks
    fetched again in full) and ``base_mismatches`` (unchanged chunks whose base bytes no longer matched: fetched in
    full). checksum: the whole-version checksum (equal to the manifest's). buffer: the uint8 buffer
    every tensor views (``nbytes`` long). manifest: the holder's manifest of this version (the layout and chunk
    checksums a later delta pull compares against). delta_payloads: the delta payloads this pull applied and
    verified, by chunk index (what a relay holder serves to pullers holding the same base). With peers, ``phases``
    also has ``peer_bytes`` (payload bytes from peers) and ``peer_failovers``.
    """

    version: int
    state_dict: Mapping[str, torch.Tensor]
    nbytes: int
    seconds: float
    phases: dict[str, float]
    checksum: int
    buffer: torch.Tensor = field(repr=False, default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    manifest: Manifest | None = field(repr=False, default=None)
    delta_payloads: dict[int, bytes] = field(repr=False, default_factory=dict)


class WeightPuller:
    """Pulls weight versions from one holder endpoint.

    Args:
        endpoint: holder address, e.g. ``"tcp://10.0.0.5:5601"``.
        streams: parallel DEALER connections, one receiving thread each; 0: :func:`auto_streams`.
        window: outstanding chunk requests per stream (≥ 1).
        timeout_s: readiness deadline of the manifest phase and stall deadline of the transfer phase
            (seconds without any reply on a stream that is waiting for one).
        deadline_s: optional overall deadline of the whole pull (seconds), checked in every phase.
        io_threads: libzmq I/O threads of the puller context a pull uses (default: ``min(streams, 4)``).
        label: who is pulling (e.g. the rollout instance id); named in every error message.
        peer_timeout_s: stall deadline of a relay peer (default ``min(timeout_s, 5)``): a peer silent that long
            is abandoned for the next source.
        buffer_factory: allocates a fresh receive buffer of n bytes (uint8, 1-D, contiguous, CPU) when a pull has
            neither ``into`` nor a large enough base (default :func:`rlboost_hpc.weights.layout.host_buffer`;
            e.g. a shared-memory buffer that another process loads from without a copy).
        sealed: fetch the chunks sealed (AES-256-GCM on the holder's sealed port) when the manifest offers it;
            False: always over CURVE.

    A puller holds no sockets between pulls; it is safe to call :meth:`pull` repeatedly (not concurrently).
    """

    def __init__(
        self,
        endpoint: str,
        streams: int = D.WEIGHT_STREAMS,
        window: int = D.WEIGHT_WINDOW,
        timeout_s: float = D.PULL_TIMEOUT_S,
        *,
        deadline_s: float | None = None,
        io_threads: int | None = None,
        label: str = "",
        keys: "RunKeys | None" = None,
        peer_timeout_s: float | None = None,
        buffer_factory: "Callable[[int], torch.Tensor] | None" = None,
        sealed: bool = True,
    ) -> None:
        if streams < 0 or window < 1:
            raise ValueError(f"streams must be >= 0 (0: automatic) and window >= 1, got {streams}, {window}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.endpoint = endpoint
        self.streams = int(streams) or auto_streams()
        self.window = int(window)
        self.timeout_s = float(timeout_s)
        self.deadline_s = deadline_s
        self.io_threads = io_threads if io_threads is not None else min(self.streams, 4)
        self.label = label
        self.keys = keys  # CURVE client keys of the run (protocol/auth.py); None: plain TCP
        self.peer_timeout_s = float(peer_timeout_s) if peer_timeout_s is not None else min(self.timeout_s, 5.0)
        self.buffer_factory = buffer_factory or layout.host_buffer
        self.sealed = bool(sealed)

    # ------------------------------------------------------------------ public
    def pull(self, version: int | None = None, *, into: torch.Tensor | None = None,
             base: PulledWeights | None = None, peers: "tuple[str, ...] | list[str]" = ()) -> PulledWeights:
        """Fetch ``version`` (None: the holder's latest) completely and verify it.

        Args:
            version: version to pull; None asks the holder for its latest.
            into: optional reusable receive buffer (CPU, uint8, 1-D, contiguous, ≥ ``total_bytes``), e.g. a
                staging buffer that is copied to the GPU after each pull (not used when a delta against ``base``
                applies: the result is then in the base's buffer). The caller guarantees nothing
                reads it during the pull; on failure its contents are undefined. Default: a fresh buffer
                (``buffer_factory``), so earlier pulls stay valid.
            base: a version this process pulled before and no longer reads. It is *consumed*: when the
                holder offers a delta against it, its buffer is turned into the new version in place;
                otherwise its buffer is reused as the receive buffer when large enough (and ``into`` is not
                given). After the call — success or failure — only the result may be used.
            peers: relay holders to fetch chunks from before the trainer (see the module docstring).

        Returns:
            :class:`PulledWeights` whose tensors view the receive buffer.

        Raises:
            ValueError: ``into`` is unsuitable (checked once the size is known; nothing was transferred).
            WeightTransferError: no holder answered within ``timeout_s`` (phase ``manifest``); the holder
                refused (``code`` = ``no_version`` / ``version_gone`` / ``unknown_version`` / …, with its
                message); an invalid manifest or reply; a stream stalled for ``timeout_s``; the overall
                deadline passed; a chunk failed its checksum twice (``checksum mismatch at chunk i``) or, sealed,
                did not open twice; the whole-version checksum did not match.
        """
        t0 = time.perf_counter()
        deadline = None if self.deadline_s is None else t0 + self.deadline_s
        phases: dict[str, float] = {}
        ctx = _context(self.io_threads)
        phase, want = "manifest", version
        try:
            manifest = self._get_manifest(ctx, version, deadline, base)
            want, t = manifest.version, self._lap(phases, "manifest_s", t0)

            phase = "transfer"  # plan where the bytes go, then the streams
            buffer, delta = self._plan(manifest, into, base)
            layout.retain_frame_buffers(manifest.chunk_bytes, self.streams * self.window)
            tr = _Transfer(manifest, memoryview(buffer.numpy()), self.timeout_s, deadline, delta,
                           None if delta is None else base.manifest.chunk_checksums)
            self._transfer(ctx, tr, list(peers))
            t = self._lap(phases, "transfer_s", t)
            phases.update(_transfer_phases(tr, bool(peers), delta is not None))

            phase = "verify"
            _verify(tr, manifest)
            t = self._lap(phases, "verify_s", t)
            self._check_deadline(deadline)

            phase = "assemble"
            state = _assemble(manifest, buffer, base)
            t = self._lap(phases, "assemble_s", t)
            self._check_deadline(deadline)
        except _Failed as e:
            raise WeightTransferError(phase, self.endpoint, want, e.cause, e.code, self.label) from None
        except zmq.ZMQError as e:
            raise WeightTransferError(phase, self.endpoint, want, f"ZeroMQ error: {e}", puller=self.label) from e
        return PulledWeights(version=manifest.version, state_dict=state, nbytes=manifest.total_bytes, seconds=t - t0,
                             phases=phases, checksum=manifest.checksum, buffer=buffer, manifest=manifest,
                             delta_payloads=tr.payloads)

    @staticmethod
    def _lap(phases: dict[str, float], name: str, since: float) -> float:
        """Record ``name`` = seconds since ``since``; returns now."""
        now = time.perf_counter()
        phases[name] = now - since
        return now

    def _plan(self, manifest: Manifest, into: torch.Tensor | None,
              base: PulledWeights | None) -> tuple[torch.Tensor, DeltaInfo | None]:
        """Where the version's bytes go, and the delta that applies: the base's buffer when a delta against it
        applies (turned into the new version in place), else ``into``, else the base's buffer when large enough,
        else a fresh one. Raises ValueError when ``into`` is unsuitable (nothing transferred yet)."""
        delta = manifest.delta if base is not None and _applies(manifest, base) else None
        if delta is not None:
            return base.buffer[: manifest.total_bytes], delta
        if into is None and base is not None and base.buffer.numel() >= manifest.total_bytes:
            return base.buffer[: manifest.total_bytes], None
        if into is None:
            return self.buffer_factory(manifest.total_bytes), None
        if (into.dtype != torch.uint8 or into.dim() != 1 or not into.is_contiguous()
                or into.device.type != "cpu" or into.numel() < manifest.total_bytes):
            raise ValueError(f"into must be a contiguous 1-D CPU uint8 tensor of >= {manifest.total_bytes} bytes, "
                             f"got {into.dtype} {tuple(into.shape)} on {into.device}")
        return into[: manifest.total_bytes], None

    # ------------------------------------------------------------------ phases
    @staticmethod
    def _check_deadline(deadline: float | None) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            raise _Failed("overall deadline passed")

    def _socket(self, ctx: zmq.Context, max_frame: int, rcvtimeo_ms: int = -1, endpoint: str | None = None,
                plain: bool = False) -> zmq.Socket:
        """A DEALER connected to ``endpoint`` (default the holder's): CURVE with the run's keys unless ``plain``
        (a sealed port: its payloads are sealed instead)."""
        keys = None if plain else self.keys
        s = ctx.socket(zmq.DEALER)
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, max_msg_size(max_frame, keys))
            s.setsockopt(zmq.RCVTIMEO, rcvtimeo_ms)
            secure_client(s, keys)
            s.connect(endpoint or self.endpoint)
        except BaseException:
            s.close(0)  # nothing stays open after a pull
            raise
        return s

    def _get_manifest(self, ctx: zmq.Context, version: int | None, deadline: float | None,
                      base: PulledWeights | None = None) -> Manifest:
        """The holder's manifest of ``version``, validated. With ``base``, asks for a delta against it and — when
        the base's manifest states its layout — for the manifest without its tensor table if the layout is
        unchanged; the base's (already validated) table then stands in for it."""
        end = time.perf_counter() + self.timeout_s
        if deadline is not None:
            end = min(end, deadline)
        held = base.manifest if base is not None else None
        sock = self._socket(ctx, MAX_MANIFEST_BYTES)
        try:
            msg = encode(GetManifest(version=version, base=None if base is None else base.version,
                                     layout=None if held is None else held.layout))
            while True:
                try:
                    sock.send(msg, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if time.perf_counter() >= end:
                        raise _Failed(f"timeout after {self.timeout_s:g}s: could not send the manifest request")
                    time.sleep(0.005)
            while True:
                left = end - time.perf_counter()
                if left <= 0:
                    raise _Failed(
                        f"timeout after {self.timeout_s:g}s waiting for the manifest "
                        "(no holder listening, or it did not answer)"
                    )
                if sock.poll(min(left, _SLICE_S) * 1000, zmq.POLLIN):
                    break
            frames = sock.recv_multipart(zmq.NOBLOCK)
        finally:
            sock.close(0)
        if len(frames) != 1:
            raise _Failed(f"manifest reply has {len(frames)} frames, expected 1")
        try:
            reply = decode_reply(frames[0], MAX_MANIFEST_BYTES)
        except ProtocolError as e:
            raise _Failed(f"bad manifest reply: {e}") from None
        if isinstance(reply, Error):
            raise _Failed(f"holder refused ({reply.code}): {reply.message}", reply.code)
        if not isinstance(reply, Manifest):
            raise _Failed(f"expected a Manifest, got {type(reply).__name__}")
        if version is not None and reply.version != version:
            raise _Failed(f"holder sent the manifest of version {reply.version}, asked for {version}")
        if reply.tensors is None:
            if held is None or held.layout is None or reply.layout != held.layout:
                raise _Failed(f"holder left out the tensor table of version {reply.version}, whose layout "
                              f"{reply.layout} this puller does not hold")
            reply = msgspec.structs.replace(reply, tensors=held.tensors)
        try:
            validate_manifest(reply)
        except ProtocolError as e:
            raise _Failed(f"invalid manifest: {e}") from None
        return reply

    def _transfer(self, ctx: zmq.Context, tr: _Transfer, peers: list[str]) -> None:
        sources = [(p, self.peer_timeout_s, True) for p in peers] + [(self.endpoint, self.timeout_s, False)]
        access = tr.m.sealed if self.sealed else None
        for endpoint, stall_s, is_peer in sources:
            tr.begin(stall_s)
            if not tr.todo:
                return
            tr.sealed = tr.sealer = None
            if access is not None:
                port = self._peer_sealed_port(ctx, endpoint, tr.m, access) if is_peer else access.port
                if port is False:  # the peer did not answer within its deadline: next source
                    tr.failovers += 1
                    continue
                if port is not None:
                    endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
                    tr.sealed, tr.sealer = access, sealing.Sealer(access.key)
            self._streams(ctx, tr, endpoint, is_peer)
            if tr.error is None:
                return
            if not is_peer:
                raise tr.error
            tr.failovers += 1  # the verified chunks stay; the rest come from the next source

    def _peer_sealed_port(self, ctx: zmq.Context, endpoint: str, m: Manifest, access: Sealed) -> int | None | bool:
        """The sealed port of relay peer ``endpoint`` for version ``m.version`` when it seals under ``access``'s
        key and ticket (asked over CURVE, within ``peer_timeout_s``); None: use the peer over CURVE (it does not
        seal this version); False: no answer in time."""
        sock = self._socket(ctx, MAX_MANIFEST_BYTES, rcvtimeo_ms=int(self.peer_timeout_s * 1000), endpoint=endpoint)
        try:
            sock.send(encode(GetManifest(version=m.version, layout=m.layout)), zmq.NOBLOCK)
            reply = decode_reply(sock.recv(), MAX_MANIFEST_BYTES)
        except zmq.ZMQError:
            return False
        except ProtocolError:
            return None
        finally:
            sock.close(0)
        theirs = reply.sealed if isinstance(reply, Manifest) and reply.version == m.version else None
        if theirs is None or theirs.key != access.key or theirs.ticket != access.ticket:
            return None
        return theirs.port

    def _streams(self, ctx: zmq.Context, tr: _Transfer, endpoint: str, is_peer: bool) -> None:
        n_streams = min(self.streams, len(tr.todo))
        threads: list[threading.Thread] = []
        try:
            for i in range(n_streams):
                t = threading.Thread(target=self._stream, args=(ctx, tr, endpoint, is_peer), name=f"weight-pull-{i}",
                                     daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:  # interrupted, or a thread could not start: stop and reap the others
            tr.fail(_Failed("interrupted"))
            for t in threads:
                t.join()
            raise

    def _stream(self, ctx: zmq.Context, tr: _Transfer, endpoint: str, is_peer: bool) -> None:
        try:
            sock = self._socket(ctx, max(tr.m.chunk_bytes + sealing.TAG_BYTES, MAX_HEADER_BYTES),
                                rcvtimeo_ms=int(_SLICE_S * 1000), endpoint=endpoint, plain=tr.sealed is not None)
        except zmq.ZMQError as e:
            tr.fail(_Failed(f"cannot open a stream socket to {endpoint}: {e}"))
            return
        try:
            self._stream_loop(sock, tr, is_peer)
        except _Failed as e:
            tr.fail(e)
        except BaseException as e:  # a bug or zmq failure: never leave the other streams waiting
            tr.fail(_Failed(f"{type(e).__name__}: {e}"))
        finally:
            sock.close(0)

    def _stream_loop(self, sock: zmq.Socket, tr: _Transfer, is_peer: bool = False) -> None:
        version = tr.m.version
        outstanding: set[int] = set()
        attempts: dict[int, int] = {}
        exhausted = False
        last_reply = time.perf_counter()

        ticket = None if tr.sealed is None else tr.sealed.ticket
        sealer = tr.sealer

        def request(i: int) -> None:
            base = tr.base if tr.use_delta[i] else None
            try:
                sock.send(encode(GetChunk(version=version, index=i, base=base, ticket=ticket)), zmq.NOBLOCK)
            except zmq.Again:
                raise _Failed(f"stream send queue full while requesting chunk {i}") from None
            outstanding.add(i)

        def again(i: int, what: str) -> None:
            """Request chunk ``i`` once more after ``what`` happened to it; raises _Failed the second time."""
            attempts[i] = attempts.get(i, 0) + 1
            if attempts[i] > 1:
                lo, hi = tr.span(i)
                raise _Failed(f"{what} at chunk {i} (bytes {lo}..{hi}) after one retry")
            with tr.lock:
                tr.retries += 1
            outstanding.discard(i)
            request(i)

        while not tr.stop.is_set():
            while not exhausted and len(outstanding) < self.window:
                i = tr.take()
                if i is None:
                    exhausted = True
                    break
                if not (tr.local[i] and self._verify_local(tr, i)):
                    request(i)
            if not outstanding:
                return
            now = time.perf_counter()
            if now - last_reply > tr.timeout_s:
                raise _Failed(
                    f"timeout: no chunk for {tr.timeout_s:g}s (stall; {tr.received}/{tr.n} chunks received, "
                    f"waiting for {sorted(outstanding)[:8]})"
                )
            if tr.deadline is not None and now > tr.deadline:
                raise _Failed(f"overall deadline passed ({tr.received}/{tr.n} chunks received)")
            try:
                header = sock.recv()  # waits at most RCVTIMEO = _SLICE_S, without the GIL
            except zmq.Again:
                continue
            last_reply = time.perf_counter()
            try:
                reply = decode_reply(header, MAX_HEADER_BYTES)
            except ProtocolError as e:
                raise _Failed(f"bad chunk reply: {e}") from None
            if isinstance(reply, Error):
                if reply.code == ErrorCode.NO_DELTA and reply.index in outstanding and tr.use_delta[reply.index]:
                    tr.fall_back(reply.index)
                    outstanding.discard(reply.index)
                    request(reply.index)
                    continue
                if reply.code == ErrorCode.VERSION_GONE:
                    raise _Failed(f"version no longer held by the holder ({reply.message})", reply.code)
                raise _Failed(f"holder refused chunk {reply.index} ({reply.code}): {reply.message}", reply.code)
            if not isinstance(reply, Chunk):
                raise _Failed(f"expected a Chunk reply, got {type(reply).__name__}")
            i = reply.index
            if reply.version != version or i not in outstanding:
                raise _Failed(
                    f"unexpected chunk (version {reply.version}, index {i}) while pulling version {version}"
                )
            if (reply.nonce is None) != (sealer is None):
                raise _Failed(f"chunk {i}: {'unsealed' if sealer is not None else 'sealed'} reply from a "
                              f"{'sealed' if sealer is not None else 'CURVE'} source")
            lo, hi = tr.span(i)
            payload = None
            if tr.use_delta[i]:
                payload = self._apply_delta(sock, tr, reply, lo, hi, is_peer)
                if payload is None:
                    tr.fall_back(i)  # the base chunk in dest is spoilt now: the full chunk replaces it
                    request(i)
                    continue
            elif reply.base is not None:
                raise _Failed(f"chunk {i}: the holder sent a delta payload for a chunk asked for in full")
            else:
                tag = 0 if sealer is None else sealing.TAG_BYTES
                if reply.nbytes != hi - lo + tag or not sock.getsockopt(zmq.RCVMORE):
                    raise _Failed(f"chunk {i}: header says {reply.nbytes} bytes, expected {hi - lo + tag} in one "
                                  f"frame")
                opened = True
                if sealer is None:
                    got = sock.recv_into(tr.dest[lo:hi])
                else:  # opened straight into its place: the one copy a plain pull makes too
                    frame = sock.recv(copy=False)
                    got = len(frame)
                    try:
                        sealer.open_into(reply.nonce, frame.buffer, version, i, None, tr.dest[lo:hi])
                    except sealing.SealError:
                        opened = False  # like a checksum mismatch: fetched once more, then the pull fails
                    del frame
                if got != hi - lo + tag or sock.getsockopt(zmq.RCVMORE):
                    raise _Failed(f"chunk {i}: payload of {got} bytes, expected {hi - lo + tag}")
                with tr.lock:
                    tr.bytes_received += got
                    if sealer is not None:
                        tr.sealed_bytes += got
                    if is_peer:
                        tr.peer_bytes += got
                if not opened:
                    again(i, "sealed frame that did not open under the version's key")
                    continue
            h0 = time.perf_counter()
            digest = chunk_checksum(tr.dest[lo:hi])
            h1 = time.perf_counter()
            if digest != tr.m.chunk_checksums[i] and tr.use_delta[i]:  # a delta that does not verify
                tr.fall_back(i)
                request(i)
                continue
            if digest != tr.m.chunk_checksums[i]:
                again(i, "checksum mismatch")
                continue
            outstanding.discard(i)
            with tr.lock:
                tr.digests[i] = digest
                tr.received += 1
                if payload is not None:
                    tr.payloads[i] = payload
                tr.hash_s += h1 - h0

    @staticmethod
    def _verify_local(tr: _Transfer, i: int) -> bool:
        """Chunk ``i`` is unchanged since the base: True when the base's bytes in place match its checksum (it is
        then received); else the chunk is marked for a full fetch."""
        lo, hi = tr.span(i)
        h0 = time.perf_counter()
        digest = chunk_checksum(tr.dest[lo:hi])
        h1 = time.perf_counter()
        if digest != tr.m.chunk_checksums[i]:
            tr.spoilt_base(i)
            return False
        with tr.lock:
            tr.digests[i] = digest
            tr.received += 1
            tr.hash_s += h1 - h0
        return True

    @staticmethod
    def _apply_delta(sock: zmq.Socket, tr: _Transfer, reply: Chunk, lo: int, hi: int, is_peer: bool) -> bytes | None:
        """Receive chunk ``reply.index``'s delta payload and apply it to ``dest[lo:hi]`` in place; returns the payload.

        Returns None (the caller fetches the chunk in full) for a reply that is not the delta asked for or a
        payload that does not decode to the chunk's length. Raises _Failed for a malformed message."""
        i = reply.index
        if not sock.getsockopt(zmq.RCVMORE):
            raise _Failed(f"chunk {i}: delta header without a payload frame")
        frame = sock.recv(copy=False)
        if sock.getsockopt(zmq.RCVMORE):
            raise _Failed(f"chunk {i}: more than one payload frame")
        payload = frame.buffer
        with tr.lock:
            tr.bytes_received += payload.nbytes
            if tr.sealer is not None:
                tr.sealed_bytes += payload.nbytes
            if is_peer:
                tr.peer_bytes += payload.nbytes
        if reply.base != tr.base or reply.nbytes != payload.nbytes:
            return None
        if tr.sealer is not None:
            try:
                payload = tr.sealer.open(reply.nonce, payload, reply.version, i, reply.base)  # bytes: kept as is
            except sealing.SealError:
                return None
        try:
            delta_codec.apply_chunk(tr.dest[lo:hi], payload)
        except delta_codec.DeltaError:
            return None
        return bytes(payload)


def _applies(manifest: Manifest, base: PulledWeights) -> bool:
    """True when ``manifest``'s delta was encoded against exactly ``base``: same base version and whole-version
    checksum, same layout and chunking, and a buffer large enough."""
    d, bm = manifest.delta, base.manifest
    return (d is not None and bm is not None and d.base_version == base.version
            and d.base_checksum == base.checksum == bm.checksum and bm.tensors == manifest.tensors
            and bm.chunk_bytes == manifest.chunk_bytes and bm.total_bytes == manifest.total_bytes
            and base.buffer.numel() >= manifest.total_bytes)


def _transfer_phases(tr: _Transfer, peers: bool, delta: bool) -> dict[str, float]:
    """The transfer's counters as :attr:`PulledWeights.phases` entries (see its docstring)."""
    out = {"chunk_hash_s": tr.hash_s, "chunk_retries": float(tr.retries), "bytes_received": float(tr.bytes_received),
           "sealed_bytes": float(tr.sealed_bytes)}
    if peers:
        out.update(peer_bytes=float(tr.peer_bytes), peer_failovers=float(tr.failovers))
    if delta:
        unchanged = sum(tr.local)  # verified in place (a spoilt one was fetched in full)
        out.update(unchanged_chunks=float(unchanged), delta_chunks=float(sum(tr.use_delta)),
                   delta_fallbacks=float(tr.delta_fallbacks), base_mismatches=float(tr.base_mismatches),
                   full_chunks=float(tr.n - unchanged - sum(tr.use_delta)))
    return out


def _verify(tr: _Transfer, manifest: Manifest) -> None:
    """Every chunk arrived verified and the whole-version checksum matches the manifest's. Raises _Failed."""
    digests = [d for d in tr.digests if d is not None]
    if len(digests) != tr.n:
        raise _Failed(f"{tr.n - len(digests)} chunks missing after transfer")
    if combine_checksums(digests) != manifest.checksum:
        raise _Failed("whole-version checksum mismatch")


def _assemble(manifest: Manifest, buffer: torch.Tensor, base: PulledWeights | None) -> Mapping[str, torch.Tensor]:
    """The version's tensors: views of ``buffer`` — the base's own views when the bytes landed in its buffer with
    its layout (made or not yet, they see the new bytes)."""
    if (base is not None and base.manifest is not None and base.manifest.tensors == manifest.tensors
            and base.buffer.data_ptr() == buffer.data_ptr() and len(base.state_dict) == len(manifest.tensors)):
        return base.state_dict if isinstance(base.state_dict, layout.FlatState) else dict(base.state_dict)
    return layout.state_view(buffer, manifest.tensors)
