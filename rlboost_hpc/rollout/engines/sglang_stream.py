"""The generation streams of the SGLang engine: per-request state, batched submission and the reading of
``/generate`` streams — the requests added between two :meth:`~SGLangEngine.step` calls go out as one streaming
``/generate`` call, read by one thread, whose chunks (told apart by ``meta_info.id``) are folded into their
requests: new ids and logprobs taken from cumulative or incremental chunks (:func:`new_entries`), checked against
each other, cut at the request's stop set and budget; a request the server would run past them is aborted there.

:class:`SGLangStreams` is a collaborator of :class:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine` that owns
the engine's requests (its table and lock, the reader threads); the invariants it keeps are the engine's "ids are
ids", "nothing hidden", "stop semantics" and "batching" (see :mod:`rlboost_hpc.rollout.engines.sglang_engine`).
Nothing here imports ``sglang``: HTTP only (stdlib ``http.client``).
"""
from __future__ import annotations

import http.client
import itertools
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlboost_hpc.rollout.engines.base import EngineError, FinishReason, RequestError, TokenEvent
from rlboost_hpc.rollout.engines.sglang_server import fast_dumps, fast_loads, http_json

if TYPE_CHECKING:
    from rlboost_hpc.rollout.engines.sglang_server import SGLangControl

__all__ = ["SGLangStreams", "StreamBatch", "StreamRequest", "new_entries"]

log = logging.getLogger("rlboost.sglang")


# ====================================================================================== per-request state
@dataclass(eq=False)
class StreamRequest:
    """One request of the engine as its stream sees it: what was sent (``input_ids`` = prompt + prefix, the
    server's ``sampling`` parameters, our ``stop`` set and budget ``max_new``), the ids and logprobs received so far
    (``delivered`` of them already returned by ``step()``), and how it ended."""

    rid: str
    srid: str  # the id the server knows (unique per engine instance and submission)
    input_ids: list[int]
    sampling: dict
    stop: frozenset[int]
    max_new: int
    enforce_stop: bool  # the server cannot express our stop set exactly; we cut the stream ourselves
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    delivered: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    done: bool = False  # no more chunks will be used (final chunk seen, stream ended, or given up)
    error: str | None = None
    aborting: bool = False
    server_aborted: bool = False  # the server ended the request with finish type "abort"
    batch: "StreamBatch | None" = None
    lora: str | None = None  # a LoRA run: the adapter version's name in the server (sglang_lora.py)


@dataclass(eq=False)
class StreamBatch:
    """One streaming ``/generate`` call carrying every request added since the previous submission (SGLang
    multiplexes their chunks on one SSE stream, told apart by ``meta_info.id``)."""

    reqs: dict[str, StreamRequest]  # by srid
    thread: threading.Thread | None = None
    conn: http.client.HTTPConnection | None = None


def new_entries(out_ids: list, lp_entries: list, completion_tokens: int | None, have: int) -> tuple[list, list]:
    """The output ids and logprob entries of one ``/generate`` stream chunk that are new to a consumer holding
    ``have`` tokens of the request: an incremental chunk (``--incremental-streaming-output``) carries exactly
    ``completion_tokens − have`` new entries; a cumulative one (SGLang's default; no count: cumulative) carries the
    full lists from the first token, which may run ahead of ``completion_tokens`` (SGLang streams an intermediate
    cumulative chunk as a reference to its growing lists and serialises it later: seen as ``completion_tokens=1``
    with 3 ids and 3 logprobs) but never behind what was received.

    Raises:
        EngineError: the lengths fit neither form (ids and logprobs of different lengths, fewer entries than
            already received, more than the count in an incremental chunk).
    """
    n = len(out_ids)
    total = n if completion_tokens is None else int(completion_tokens)
    if n == len(lp_entries) and n >= total and n >= have:
        return out_ids[have:], lp_entries[have:]
    if n == len(lp_entries) == total - have:
        return out_ids, lp_entries
    if not out_ids and total <= have:
        return [], []
    raise EngineError(f"inconsistent chunk: completion_tokens={total}, {have} received, {n} output_ids, "
                      f"{len(lp_entries)} logprobs")


# ====================================================================================== the streams
class SGLangStreams:
    """The requests of one SGLang engine and their ``/generate`` streams (see the module docstring).

    Owns the request table (``_reqs`` by rid, ``_order`` of addition, ``_unsent`` — added, submitted at the next
    :meth:`step` or abort — and the reader threads' ``_batches``), guarded by one lock (``_cond``'s); counts
    ``chunks_received`` (stream chunks that carried tokens, over the engine's life). ``control``: the server's
    address and diagnostics; ``stall_timeout_s``: a stream that delivers nothing for this long (server alive) is
    an error; ``abort_timeout_s``: how long an abort waits for the final chunk; ``tag``: makes the ids the server
    sees unique to this engine.
    """

    def __init__(self, control: SGLangControl, *, stall_timeout_s: float, abort_timeout_s: float, tag: str) -> None:
        self._control = control
        self.stall_timeout_s, self.abort_timeout_s = stall_timeout_s, abort_timeout_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reqs: dict[str, StreamRequest] = {}
        self._order: deque[str] = deque()
        self._unsent: list[StreamRequest] = []
        self._batches: set[StreamBatch] = set()
        self._seq = itertools.count()
        self._tag = tag
        self.chunks_received = 0

    @property
    def num_active(self) -> int:
        """Requests added and not finished, failed or aborted."""
        with self._lock:
            return len(self._reqs)

    def holds(self, rid: str) -> bool:
        """``rid`` is queued or running."""
        with self._lock:
            return rid in self._reqs

    def active(self) -> list[str]:
        """The rids queued or running, in the order they were added."""
        with self._lock:
            return list(self._order)

    def names(self, lora: str) -> bool:
        """A request in flight runs under adapter ``lora`` (its name in the server)."""
        with self._lock:
            return any(r.lora == lora for r in self._reqs.values())

    def add(self, rid: str, *, input_ids: list[int], sampling: dict, stop: frozenset[int], max_new: int,
            enforce_stop: bool, lora: str | None) -> None:
        """Queue request ``rid`` (the next :meth:`step` submits it with every other queued one).

        Raises:
            EngineError: ``rid`` is queued or running already."""
        srid = f"{rid}@{self._tag}.{next(self._seq)}"
        r = StreamRequest(rid=rid, srid=srid, input_ids=input_ids, sampling=sampling, stop=stop, max_new=max_new,
                          enforce_stop=enforce_stop, lora=lora)
        with self._lock:
            if rid in self._reqs:
                raise EngineError(f"request {rid!r}: duplicate rid (already queued or running)")
            self._reqs[rid] = r
            self._order.append(rid)
            self._unsent.append(r)

    def step(self) -> list[TokenEvent]:
        """Submit what was queued, then return every token streamed since the previous call, one event per request
        (the engine's :meth:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine.step`: blocks until a request
        has something to report; ``[]`` only when idle).

        Raises:
            RequestError: one request's stream broke or returned inconsistent data while the server lives (the
                request is dropped, the others go on).
            EngineError: the server died (log tail included), or no request received anything for
                ``stall_timeout_s``.
        """
        self.submit()
        deadline = time.monotonic() + self.stall_timeout_s
        failed: StreamRequest | None = None
        ctl = self._control
        with self._cond:
            while True:
                if not self._reqs:
                    return []
                events, failed = self._collect_locked()
                if events:
                    return events
                if failed is not None:
                    self._reqs.pop(failed.rid, None)
                    self._remove_order(failed.rid)
                    break
                if not ctl.alive():
                    break
                now = time.monotonic()
                if now > deadline:
                    n = len(self._reqs)
                    break
                self._cond.wait(timeout=min(0.5, deadline - now))
        if failed is not None:
            message = self._failure_message(failed)
            if not ctl.alive():
                raise EngineError(message)
            raise RequestError(failed.rid, message)  # the server serves the other requests
        if not ctl.alive():
            raise EngineError(ctl.crash_message("step()"))
        raise EngineError(f"sglang engine: no token from {ctl.base_url} for {self.stall_timeout_s:.0f}s with "
                          f"{n} request(s) active; " + ctl.log_hint())

    def abort_many(self, rids) -> dict[str, TokenEvent]:
        """Abort ``rids`` on the server and return ``{rid: event}`` with each one's tokens not returned yet (the
        engine's :meth:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine.abort`): waits up to
        ``abort_timeout_s`` for the final chunks, re-sending the abort while the server has not registered a
        request yet."""
        with self._lock:
            reqs = [self._reqs[r] for r in rids if r in self._reqs]
            for r in reqs:
                r.aborting = True
                if r in self._unsent:  # never reached the server: nothing was produced
                    self._unsent.remove(r)
                    r.done = True
        deadline = time.monotonic() + self.abort_timeout_s
        next_send = 0.0
        ctl = self._control
        while True:
            with self._lock:
                pending = [r for r in reqs if not r.done]
            if not pending:
                break
            now = time.monotonic()
            dead = not ctl.alive()
            if now > deadline or dead:
                if not dead:
                    log.warning("abort: no final chunk for %s within %.0fs; returning what was received",
                                [r.rid for r in pending], self.abort_timeout_s)
                with self._lock:
                    for r in pending:
                        r.done = True  # later chunks of these are ignored
                break
            if now >= next_send:
                for r in pending:  # re-sent while the server has not registered the request yet
                    try:
                        http_json(ctl.host, ctl.port, "POST", "/abort_request", {"rid": r.srid}, timeout=10.0)
                    except (OSError, http.client.HTTPException) as e:
                        log.warning("abort(%s): /abort_request failed: %s", r.rid, e)
                next_send = now + 0.25
            with self._cond:
                if any(not r.done for r in pending):
                    self._cond.wait(timeout=0.02)
        out: dict[str, TokenEvent] = {}
        with self._lock:
            for r in reqs:
                self._reqs.pop(r.rid, None)
                self._remove_order(r.rid)
                ids, lps = r.ids[r.delivered:], r.lps[r.delivered:]
                r.delivered = len(r.ids)
                if ids or r.finished:
                    out[r.rid] = TokenEvent(rid=r.rid, token_ids=list(ids), logprobs=list(lps), finished=r.finished,
                                            finish_reason=r.finish_reason if r.finished else None)
        return out

    def close(self) -> None:
        """Forget every request and cut the open streams (the server is left as it is)."""
        with self._lock:
            for r in self._reqs.values():
                r.aborting = True
            self._unsent.clear()
            self._reqs.clear()
            self._order.clear()
            batches = list(self._batches)
        for b in batches:
            self._close_batch(b)

    def _remove_order(self, rid: str) -> None:
        try:
            self._order.remove(rid)
        except ValueError:
            pass

    def _collect_locked(self) -> tuple[list[TokenEvent], StreamRequest | None]:
        events: list[TokenEvent] = []
        failed: StreamRequest | None = None
        for rid in list(self._order):
            r = self._reqs[rid]
            new = len(r.ids) - r.delivered
            if new > 0 or r.finished:  # a finished request's tokens are final (later chunks are ignored)
                ev = TokenEvent(rid=rid, token_ids=r.ids[r.delivered:], logprobs=r.lps[r.delivered:])
                r.delivered = len(r.ids)
                if r.finished:
                    ev.finished, ev.finish_reason = True, r.finish_reason
                    del self._reqs[rid]
                    self._order.remove(rid)
                events.append(ev)
            elif r.done and not r.finished and failed is None:
                failed = r
        return events, failed

    def _failure_message(self, r: StreamRequest) -> str:
        # a broken stream is usually the server dying: its sockets close before the exit status is visible
        if self._control.dies_within(2.0):
            return self._control.crash_message(f"request {r.rid!r} after {len(r.ids)} token(s)")
        why = r.error or ("aborted by the server" if r.server_aborted else "stream ended without a finish")
        return f"sglang request {r.rid!r} failed after {len(r.ids)} token(s): {why}; " + self._control.log_hint()

    def _close_batch(self, b: StreamBatch) -> None:
        c = b.conn
        if c is not None:
            try:
                if c.sock is not None:
                    c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def submit(self) -> None:
        """Send every queued request as one streaming ``/generate`` call, read by one thread."""
        with self._lock:
            reqs, self._unsent = self._unsent, []
        if not reqs:
            return
        if len(reqs) == 1:
            r = reqs[0]
            body = {"input_ids": r.input_ids, "sampling_params": r.sampling, "rid": r.srid}
        else:
            body = {"input_ids": [r.input_ids for r in reqs], "sampling_params": [r.sampling for r in reqs],
                    "rid": [r.srid for r in reqs]}
        if any(r.lora for r in reqs):  # a LoRA run: each request names its adapter version
            body["lora_path"] = reqs[0].lora if len(reqs) == 1 else [r.lora for r in reqs]
        body.update(return_logprob=True, logprob_start_len=-1, stream=True)
        b = StreamBatch(reqs={r.srid: r for r in reqs})
        for r in reqs:
            r.batch = b
        b.thread = threading.Thread(target=self._stream, args=(b, body), name=f"sglang-{reqs[0].rid}+{len(reqs) - 1}",
                                    daemon=True)
        with self._lock:
            self._batches.add(b)
        b.thread.start()

    def _stream(self, b: StreamBatch, body: dict) -> None:
        """Reader thread: POST /generate (stream) and fold every chunk into its request."""
        err: str | None = None
        try:
            conn = http.client.HTTPConnection(self._control.host, self._control.port, timeout=self.stall_timeout_s)
            b.conn = conn
            conn.request("POST", "/generate", body=fast_dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                err = f"HTTP {resp.status}: {resp.read()[:2000].decode('utf-8', 'replace')}"
            else:
                for line in resp:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    self._dispatch(b, fast_loads(data))
        except (OSError, http.client.HTTPException, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
        finally:
            try:
                if b.conn is not None:
                    b.conn.close()
            except Exception:
                pass
            with self._cond:
                for r in b.reqs.values():
                    if not r.done:
                        if not r.finished and not r.aborting and r.error is None:
                            r.error = err or "stream ended without a finish"
                        r.done = True
                self._batches.discard(b)
                self._cond.notify_all()

    def _dispatch(self, b: StreamBatch, chunk: dict) -> None:
        meta = chunk.get("meta_info") or {}
        r = b.reqs.get(meta.get("id"))
        if r is None:
            if "error" in chunk or "object" in chunk:
                raise ValueError(f"server error on the stream: {str(chunk)[:2000]}")
            raise ValueError(f"chunk for unknown request id {meta.get('id')!r}")
        if r.done:
            return
        try:
            cut = self._fold(r, chunk, meta)
        except EngineError as e:
            with self._cond:
                r.error, r.done = str(e), True
                self._cond.notify_all()
            cut = not r.aborting
        if cut:  # we ended it before the server did (our stop set) or it broke: stop it server-side
            threading.Thread(target=self._abort_quietly, args=(r.srid,), daemon=True).start()

    def _fold(self, r: StreamRequest, chunk: dict, meta: dict) -> bool:
        """Merge one chunk into ``r``; True when the server-side request must be aborted."""
        out_ids = chunk.get("output_ids") or []
        lp_entries = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        with self._cond:
            new_ids, new_lp = new_entries(out_ids, lp_entries, total, len(r.ids))
            ids = [int(t) for t in new_ids]
            if ids:
                self.chunks_received += 1  # streamed pieces (whatever a consumer's step() merges)
            lps = []
            for t, e in zip(ids, new_lp):
                if int(e[1]) != t:
                    raise EngineError(f"logprob entry for token {e[1]} where output_ids has {t}")
                lps.append(float(e[0]))
            fr = meta.get("finish_reason")
            ftype = fr.get("type") if isinstance(fr, dict) else fr
            # our stop set / budget, enforced on every token (exact semantics whatever the server does)
            for i, t in enumerate(ids):
                if r.finished:
                    break
                r.ids.append(t)
                r.lps.append(lps[i])
                if t in r.stop:
                    r.finished, r.finish_reason = True, "stop"
                elif len(r.ids) >= r.max_new:
                    r.finished, r.finish_reason = True, "length"
            cut = False
            if r.finished:
                cut = ftype is None  # the server would go on: abort it there
                r.done = True
            elif ftype in ("stop", "length"):
                # the server ended on its own rule; must agree with ours (stop token or budget)
                last = r.ids[-1] if r.ids else None
                if ftype == "stop" and last in r.stop:
                    r.finished, r.finish_reason = True, "stop"
                elif ftype == "length" and len(r.ids) >= r.max_new:
                    r.finished, r.finish_reason = True, "length"
                else:
                    raise EngineError(f"server finished with {fr!r} after {len(r.ids)} token(s) (last {last}), "
                                      f"which our stop set {sorted(r.stop)} / budget {r.max_new} does not explain")
                r.done = True
            elif ftype is not None:  # "abort" (ours or someone else's) or anything new
                r.server_aborted = not r.aborting
                if r.server_aborted:
                    r.error = f"ended by the server: {fr!r}"
                r.done = True
            self._cond.notify_all()
        return cut

    def _abort_quietly(self, srid: str) -> None:
        try:
            http_json(self._control.host, self._control.port, "POST", "/abort_request", {"rid": srid}, timeout=10.0)
        except (OSError, http.client.HTTPException):
            pass
