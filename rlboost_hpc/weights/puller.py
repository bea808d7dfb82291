"""Weight puller: a rollout instance fetches one complete, verified weight version from a holder.

Phases of :meth:`WeightPuller.pull` (each has a deadline; any failure raises :class:`WeightTransferError`
naming the phase, the endpoint, the version and the cause):

1. ``manifest`` — readiness handshake: ``GetManifest`` → the holder confirms it holds the version
   and states its layout and checksums *before* any weight bytes move. Deadline: ``timeout_s``.
2. ``transfer`` — first the plan (:func:`~rlboost_hpc.weights.pull_phases.plan`: where the bytes go — the
   base's buffer when a delta against it applies, else ``into``, else the base's buffer when large enough, else a
   fresh one), then the streams (:mod:`rlboost_hpc.weights.pull_streams`): ``streams`` DEALER sockets, one
   thread each, share a queue of chunk indices; each keeps up to ``window`` ``GetChunk`` requests outstanding
   (credit-based pipelining: the holder never queues more than ``streams * window`` chunks for us). Payloads are
   received straight into their place in one preallocated uint8 buffer (``recv_into``: one copy, done by libzmq
   without the GIL) and verified with xxh3_64 as they land, overlapped with the other streams' receives. A bad
   chunk is re-requested once, then the pull fails. Deadlines: no reply on a stream for ``timeout_s`` (stall),
   and the optional overall ``deadline_s``.
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
  count (:func:`~rlboost_hpc.weights.pull_streams.puller_context`), kept across pulls: its I/O threads — and
  the malloc arena the frames they receive come from, kept faulted in by
  :func:`~rlboost_hpc.models.layout.retain_frame_buffers` — persist.
- Bounded input: reply headers above :data:`~rlboost_hpc.protocol.weight_msgs.MAX_HEADER_BYTES`, manifests
  above ``MAX_MANIFEST_BYTES`` and frames above ``chunk_bytes`` are rejected (libzmq ``MAXMSGSIZE``).
"""
from __future__ import annotations

import time
from typing import Callable

import msgspec
import torch
import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys

from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import (
    MAX_MANIFEST_BYTES,
    Error,
    GetManifest,
    Manifest,
    Sealed,
    decode_reply,
    encode,
    validate_manifest,
)
from rlboost_hpc.models import layout
from rlboost_hpc.weights import sealed as sealing
from rlboost_hpc.weights.pull_phases import PulledWeights, assemble, plan, transfer_phases, verify
from rlboost_hpc.weights.pull_streams import SLICE_S, auto_streams, open_dealer, puller_context, run_streams
from rlboost_hpc.weights.source import identity
from rlboost_hpc.weights.transfer import Failed as _Failed
from rlboost_hpc.weights.transfer import Transfer as _Transfer


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




def lineage_mismatch(version: int, held: int, wanted: int) -> str:
    """Why a holder's ``version`` is refused: its whole-version checksum ``held`` is not the ``wanted`` one the
    manager announced — the same number made by other weights (a trainer resumed from an older checkpoint started
    another lineage of versions)."""
    return (f"the holder's version {version} has checksum {held:x}, the manager announced {wanted:x} (the same number "
            "from another trainer lineage: a resume)")


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
            neither ``into`` nor a large enough base (default :func:`rlboost_hpc.models.layout.host_buffer`;
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
             base: PulledWeights | None = None, peers: "tuple[str, ...] | list[str]" = (),
             checksum: int = 0, adapter: AdapterSpec | None = None) -> PulledWeights:
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
            checksum: the version's identity as the manager announced it (0: any): its whole-version checksum, or
                with ``adapter`` (a LoRA run's adapter version) that combined with the base's
                (:func:`~rlboost_hpc.weights.source.identity`); a holder's manifest of another is refused before any
                byte moves.

        Returns:
            :class:`PulledWeights` whose tensors view the receive buffer.

        Raises:
            ValueError: ``into`` is unsuitable (checked once the size is known; nothing was transferred).
            WeightTransferError: no holder answered within ``timeout_s`` (phase ``manifest``); the holder
                refused (``code`` = ``no_version`` / ``version_gone`` / ``unknown_version`` / …, with its
                message); an invalid manifest or reply; a stream stalled for ``timeout_s``; the overall
                deadline passed; a chunk failed its checksum twice (``checksum mismatch at chunk i``) or, sealed,
                did not open twice; the whole-version checksum did not match; the manifest's whole-version checksum
                is not ``checksum`` (phase ``manifest``: another lineage's version of that number).
        """
        t0 = time.perf_counter()
        deadline = None if self.deadline_s is None else t0 + self.deadline_s
        phases: dict[str, float] = {}
        ctx = puller_context(self.io_threads)
        phase, want = "manifest", version
        try:
            manifest = self._get_manifest(ctx, version, deadline, base)
            want, t = manifest.version, self._lap(phases, "manifest_s", t0)
            held = identity(int(manifest.checksum), adapter)
            if checksum and held != checksum:
                raise _Failed(lineage_mismatch(manifest.version, held, checksum))

            phase = "transfer"  # plan where the bytes go, then the streams
            buffer, delta = plan(manifest, into, base, self.buffer_factory)
            layout.retain_frame_buffers(manifest.chunk_bytes, self.streams * self.window)
            tr = _Transfer(manifest, memoryview(buffer.numpy()), self.timeout_s, deadline, delta,
                           None if delta is None else base.manifest.chunk_checksums)
            self._transfer(ctx, tr, list(peers))
            t = self._lap(phases, "transfer_s", t)
            phases.update(transfer_phases(tr, bool(peers), delta is not None))

            phase = "verify"
            verify(tr, manifest)
            t = self._lap(phases, "verify_s", t)
            self._check_deadline(deadline)

            phase = "assemble"
            state = assemble(manifest, buffer, base)
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

    # ------------------------------------------------------------------ phases
    @staticmethod
    def _check_deadline(deadline: float | None) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            raise _Failed("overall deadline passed")

    def _get_manifest(self, ctx: zmq.Context, version: int | None, deadline: float | None,
                      base: PulledWeights | None = None) -> Manifest:
        """The holder's manifest of ``version``, validated. With ``base``, asks for a delta against it and — when
        the base's manifest states its layout — for the manifest without its tensor table if the layout is
        unchanged; the base's (already validated) table then stands in for it."""
        end = time.perf_counter() + self.timeout_s
        if deadline is not None:
            end = min(end, deadline)
        held = base.manifest if base is not None else None
        sock = open_dealer(ctx, self.endpoint, self.keys, MAX_MANIFEST_BYTES)
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
                if sock.poll(min(left, SLICE_S) * 1000, zmq.POLLIN):
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
            run_streams(ctx, tr, endpoint, is_peer, streams=self.streams, window=self.window, keys=self.keys)
            if tr.error is None:
                return
            if not is_peer:
                raise tr.error
            tr.failovers += 1  # the verified chunks stay; the rest come from the next source

    def _peer_sealed_port(self, ctx: zmq.Context, endpoint: str, m: Manifest, access: Sealed) -> int | None | bool:
        """The sealed port of relay peer ``endpoint`` for version ``m.version`` when it seals under ``access``'s
        key and ticket (asked over CURVE, within ``peer_timeout_s``); None: use the peer over CURVE (it does not
        seal this version); False: no answer in time."""
        sock = open_dealer(ctx, endpoint, self.keys, MAX_MANIFEST_BYTES,
                           rcvtimeo_ms=int(self.peer_timeout_s * 1000))
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
