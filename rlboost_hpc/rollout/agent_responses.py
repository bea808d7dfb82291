"""The rollout agent's responses: starting the ones assigned to it on the engine and streaming their tokens back.

A part of :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (a mixin: the same state, the same single thread).
Owns a response's life on this instance: an ``Assign`` becomes an engine request (refused when it names another
version than the one held); each engine step's tokens are buffered and flushed as ``Tokens`` frames from the
offset each response was assigned at (finished responses at once); every token sent stays known, for a restarted
manager's resend, until ``RESEND_KEEP_S`` seconds after its response finished (or the next load); a response the
engine drops alone is handed back (its tokens, then ``RequestFailed``), and a release aborts responses, flushes
every token the engine still held, then hands them back — nothing produced is lost; a response interrupted for a
weight load (``on_new_version = "continue"``) is continued from every token it generated. How a response's turn
ends and what follows it (a tool call answered in the agent) belongs here, next to the engine requests it makes.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.rollout.engines.base import Engine, GenRequest, SamplingParams

log = logging.getLogger("rlboost.agent")

#: Seconds an agent keeps the tokens of a finished response for a restarted manager's resend (longer than a manager
#: restart: its death noticed, a new process started, the instance registered again).
RESEND_KEEP_S = 10.0


@dataclass
class ResponseTokens:
    """Tokens of one response from ``offset`` (its length when assigned here): buffered to send, or sent so far.
    ``ids``/``lps``: token ids and their logprobs; ``finish``: its ``M.FINISH_*`` code (``FINISH_NONE``: running)."""

    offset: int
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: int = M.FINISH_NONE
    version: int = -1  # the weight version that produced these tokens (-1: the engine's when sent)


class AgentResponses:
    """The response handling of :class:`~rlboost_hpc.rollout.agent.RolloutAgent` (see the module docstring).

    What it uses of the agent is declared below: the state it reads and writes (annotations only; the agent's
    ``__init__`` sets every one) and the agent's methods it calls (:attr:`CORE_METHODS`). Nothing else of the
    agent is touched here (``tests/test_architecture.py`` checks it).
    """

    #: the agent's methods this part calls
    CORE_METHODS = ("_send", "held_version", "_servable")

    # the agent's state this part reads and writes (set in RolloutAgent.__init__)
    engine: Engine | None
    tokens_generated: int
    tokens_handed_off: int
    timings: dict[str, float]
    _pos: dict[str, int]
    _gen: dict[str, GenRequest]
    _ver: dict[str, int]
    _pending: dict[str, ResponseTokens]
    _sent: dict[str, ResponseTokens]
    _sent_done: deque[tuple[float, str]]

    def _assign(self, works: list[M.Work]) -> None:
        """Start the assigned responses ``works`` on the engine (each from its prefix); one the engine cannot take —
        another version than the one held, no engine yet, a request it refuses — is answered ``RequestFailed``."""
        for w in works:
            if w.rid in self._pos and self.engine is not None:
                # the manager's assignment is authoritative: it resumed this response from its own prefix
                # (a Release of our earlier copy was lost with a connection); drop ours, unsent tokens too
                log.warning("assignment of %s replaces the copy this instance still ran", w.rid)
                self.engine.abort_many([w.rid])
                self._pos.pop(w.rid, None)
                self._pending.pop(w.rid, None)
            self._sent.pop(w.rid, None)  # (a response resumed here again: its tokens start over)
            if self.engine is None or not self._servable(w.version):
                self._send(M.RequestFailed(rid=w.rid, error=f"assigned version {w.version}, instance holds "
                                           f"{self.held_version()}"))
                continue
            try:
                gen = GenRequest(
                    rid=w.rid, prompt_ids=list(w.prompt_ids), prefix_ids=list(w.prefix_ids),
                    max_new_tokens=w.tokens_left,
                    sampling=SamplingParams(temperature=w.temperature, top_p=w.top_p, seed=w.seed,
                                            stop_token_ids=tuple(w.stop_ids)),
                    adapter_version=w.version if self.engine.max_adapters else None)
                self.engine.add(gen)
                self._pos[w.rid], self._gen[w.rid], self._ver[w.rid] = len(w.prefix_ids), gen, w.version
            except Exception as e:
                self._send(M.RequestFailed(rid=w.rid, error=f"{type(e).__name__}: {e}"))

    def _release(self, rids: list[str]) -> dict[str, ResponseTokens]:
        """Abort ``rids`` locally, flush everything produced (including tokens the engine still held, which
        ``abort_many`` returns), then hand them back (order matters). Returns what was sent of each handed-back
        response (from the offset it was assigned at): a drain keeps it for a manager that restarts meanwhile."""
        live = [r for r in rids if r in self._pos]
        if self.engine is not None and live:
            self._on_events(self.engine.abort_many(live).values())
        for rid in rids:
            self.tokens_handed_off += self._pos.pop(rid, 0)
            self._gen.pop(rid, None)
            self._ver.pop(rid, None)
        self._flush()
        handed = {rid: self._sent.pop(rid) for rid in rids if rid in self._sent}
        self._send(M.Released(rids=list(rids), tokens_generated=self.tokens_generated))
        return handed

    def _flush(self, only_finished: bool = False) -> None:
        """Send buffered deltas as one ``Tokens`` frame (all of them, or only those that finished: finished
        responses go out at once, the rest keep accumulating up to k tokens per delta)."""
        if not self._pending:
            return
        rids, offs, cnts, vers, fins, ids, lps = [], [], [], [], [], [], []
        v = self.engine.version if self.engine is not None else -1
        if only_finished:
            items = [(r, p) for r, p in self._pending.items() if p.finish]
            for r, _ in items:
                del self._pending[r]
        else:
            items = list(self._pending.items())
            self._pending.clear()
        if not items:
            return
        now = time.monotonic()
        for rid, p in items:
            rids.append(rid)
            offs.append(p.offset)
            cnts.append(len(p.ids))
            vers.append(p.version if p.version >= 0 else v)
            fins.append(p.finish)
            ids.extend(p.ids)
            lps.extend(p.lps)
            h = self._sent.get(rid)
            if h is None:
                h = self._sent[rid] = ResponseTokens(offset=p.offset)
            h.version = p.version
            h.ids += p.ids
            h.lps += p.lps
            if p.finish:
                h.finish = p.finish
                self._sent_done.append((now, rid))
        while self._sent_done and now - self._sent_done[0][0] > RESEND_KEEP_S:
            self._sent.pop(self._sent_done.popleft()[1], None)
        self._send(M.Tokens(rids=rids, offsets=offs, counts=cnts, versions=vers, finish=fins,
                            ids=M.pack_i32(ids), logprobs=M.pack_f32(lps)))

    def _resend(self) -> None:
        """A manager restarted from its work log asks for every response's tokens again (its log may end a commit
        window earlier): everything produced is flushed, then each response held is sent whole from the offset it
        was assigned at, in one frame (the manager keeps what its log lacks, checking the overlap)."""
        self._flush()
        v = self.engine.version if self.engine is not None else -1
        items = list(self._sent.items())
        self._send(M.Tokens(rids=[r for r, _ in items], offsets=[h.offset for _, h in items],
                            counts=[len(h.ids) for _, h in items],
                            versions=[h.version if h.version >= 0 else v for _, h in items],
                            finish=[h.finish for _, h in items], ids=M.pack_i32([i for _, h in items for i in h.ids]),
                            logprobs=M.pack_f32([x for _, h in items for x in h.lps]), resent=True,
                            generated=self.tokens_generated))
        log.info("resent %d responses (%d tokens) to the restarted manager", len(items),
                 sum(len(h.ids) for _, h in items))

    def _hand_back_failed(self, rid: str, error: str) -> None:
        """The engine dropped ``rid`` (its stream failed; the engine serves the others): send every token it
        produced first, then ``RequestFailed`` — the manager resumes the response from those tokens elsewhere."""
        log.warning("request %s failed on this engine; handing it back: %s", rid, error)
        self._flush()
        self._pos.pop(rid, None)
        self._gen.pop(rid, None)
        self._ver.pop(rid, None)
        self._sent.pop(rid, None)
        self._send(M.RequestFailed(rid=rid, error=error[:2000]))

    def _on_events(self, events) -> bool:
        """Buffer one engine step's tokens; True when a request finished (flush promptly)."""
        finished = False
        for ev in events:
            p = self._pending.get(ev.rid)
            if p is None:
                p = self._pending[ev.rid] = ResponseTokens(offset=self._pos[ev.rid], version=self._ver.get(ev.rid, -1))
            p.ids.extend(ev.token_ids)
            p.lps.extend(ev.logprobs)
            self._pos[ev.rid] += len(ev.token_ids)
            self.tokens_generated += len(ev.token_ids)
            if ev.finished:
                p.finish = M.FINISH_CODES[ev.finish_reason]
                self._pos.pop(ev.rid, None)
                self._gen.pop(ev.rid, None)
                self._ver.pop(ev.rid, None)
                finished = True
        if self.tokens_generated and "first_token" not in self.timings:
            self.timings["first_token"] = time.time()
        return finished

    def _interrupt_for_load(self) -> list[GenRequest]:
        """``on_new_version = "continue"``: stop every running response between two decode iterations, send what it
        generated (stamped with the version that produced it), and return each one as the request that continues it
        from there — its prefix grown by every token generated on this instance, its budget shrunk by them — to be
        added again once the new weights are loaded (a re-prefill under them); a failed load re-adds them under the
        weights the engine kept. (Each is rebuilt from its assignment and every token sent since, so a second
        interruption is exact too.)"""
        live = list(self._pos)
        self._on_events(self.engine.abort_many(live).values())
        self._flush()
        out = []
        for rid in live:
            gen, done = self._gen.get(rid), self._sent.get(rid)
            if gen is None or rid not in self._pos:
                continue
            made = done.ids if done is not None else []
            out.append(GenRequest(rid=rid, prompt_ids=gen.prompt_ids, prefix_ids=list(gen.prefix_ids) + made,
                                  max_new_tokens=gen.max_new_tokens - len(made), sampling=gen.sampling))
        return out

    def _forget_finished(self) -> None:
        """Forget the tokens sent of every finished response (kept for a restarted manager's resend until now)."""
        while self._sent_done:
            self._sent.pop(self._sent_done.popleft()[1], None)
