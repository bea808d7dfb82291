"""The transfer phase's chunk streams, and the sockets and ZeroMQ context a pull talks through.

Owns how a pull's bytes cross the wire: ``streams`` DEALER sockets, one thread each, share the pull's
:class:`~rlboost_hpc.weights.transfer.Transfer` (its queue of chunk indices); each keeps up to ``window``
``GetChunk`` requests outstanding, receives every payload straight into its place in the destination buffer (plain,
sealed — opened in place — or a delta applied in place), verifies it with xxh3_64 as it lands, re-requests a bad
chunk once and stops every stream on the first failure (a stall, the overall deadline, a refusal, a malformed
reply). Also here: how many streams a pull uses by default (:func:`auto_streams`), the process's puller context
(:func:`puller_context`) and the DEALER every request of a pull goes through (:func:`open_dealer`). What a pull
does with the bytes before and after (plan, verify, assemble) is :mod:`rlboost_hpc.weights.pull_phases`; the
order of the phases and the choice of sources is :class:`~rlboost_hpc.weights.puller.WeightPuller`.
"""
from __future__ import annotations

import os
import threading
import time

import zmq

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.auth import RunKeys, max_msg_size, secure_client
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import (
    MAX_HEADER_BYTES,
    Chunk,
    Error,
    ErrorCode,
    GetChunk,
    chunk_checksum,
    decode_reply,
    encode,
)
from rlboost_hpc.weights import delta as delta_codec
from rlboost_hpc.weights import sealed as sealing
from rlboost_hpc.weights.transfer import Failed as _Failed
from rlboost_hpc.weights.transfer import Transfer as _Transfer

SLICE_S = 0.05  # longest single poll, so that a failure on one stream stops the others promptly


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


def puller_context(io_threads: int) -> zmq.Context:
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


def open_dealer(ctx: zmq.Context, endpoint: str, keys: RunKeys | None, max_frame: int,
                rcvtimeo_ms: int = -1) -> zmq.Socket:
    """A DEALER of ``ctx`` connected to ``endpoint``: CURVE with the run's ``keys`` (None: plain TCP — a sealed
    port, whose payloads are sealed instead), frames above ``max_frame`` bytes refused (libzmq ``MAXMSGSIZE``),
    linger 0, receives waiting at most ``rcvtimeo_ms`` (-1: for ever). Raises zmq.ZMQError (the socket closed)."""
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, max_msg_size(max_frame, keys))
        s.setsockopt(zmq.RCVTIMEO, rcvtimeo_ms)
        secure_client(s, keys)
        s.connect(endpoint)
    except BaseException:
        s.close(0)  # nothing stays open after a pull
        raise
    return s


def run_streams(ctx: zmq.Context, tr: _Transfer, endpoint: str, is_peer: bool, *, streams: int, window: int,
                keys: RunKeys | None) -> None:
    """Fetch every chunk ``tr.todo`` holds from ``endpoint`` (a relay peer when ``is_peer``) over
    ``min(streams, len(tr.todo))`` streams of ``window`` outstanding requests each: CURVE with ``keys``, or plain to
    a sealed port when ``tr.sealed`` is set. Returns when every stream ended: the chunks verified are in
    ``tr.digests``, the first failure in ``tr.error``. Re-raises an interrupt after stopping and joining every
    stream."""
    n_streams = min(streams, len(tr.todo))
    threads: list[threading.Thread] = []
    try:
        for i in range(n_streams):
            t = threading.Thread(target=_stream, args=(ctx, tr, endpoint, is_peer, window, keys),
                                 name=f"weight-pull-{i}", daemon=True)
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


def _stream(ctx: zmq.Context, tr: _Transfer, endpoint: str, is_peer: bool, window: int,
            keys: RunKeys | None) -> None:
    try:
        sock = open_dealer(ctx, endpoint, None if tr.sealed is not None else keys,
                           max(tr.m.chunk_bytes + sealing.TAG_BYTES, MAX_HEADER_BYTES),
                           rcvtimeo_ms=int(SLICE_S * 1000))
    except zmq.ZMQError as e:
        tr.fail(_Failed(f"cannot open a stream socket to {endpoint}: {e}"))
        return
    try:
        _stream_loop(sock, tr, window, is_peer)
    except _Failed as e:
        tr.fail(e)
    except BaseException as e:  # a bug or zmq failure: never leave the other streams waiting
        tr.fail(_Failed(f"{type(e).__name__}: {e}"))
    finally:
        sock.close(0)


def _stream_loop(sock: zmq.Socket, tr: _Transfer, window: int, is_peer: bool = False) -> None:
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
        while not exhausted and len(outstanding) < window:
            i = tr.take()
            if i is None:
                exhausted = True
                break
            if not (tr.local[i] and _verify_local(tr, i)):
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
            header = sock.recv()  # waits at most RCVTIMEO = SLICE_S, without the GIL
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
            payload = _apply_delta(sock, tr, reply, lo, hi, is_peer)
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
