"""The rollout engine interface: what the rollout agent needs from any inference engine.

Invariants every engine honours (tested per engine):
- Ids are ids: output is token ids + the behaviour logprob of each sampled token, parallel lists of equal
  length; text is never re-tokenised.
- Resumable: a request may arrive with ``prefix_ids`` (tokens already generated elsewhere, a migrated
  response). The engine prefills ``prompt_ids + prefix_ids`` and continues; ``max_new_tokens`` is the
  *remaining* budget. Sampling is keyed by (seed, absolute response position) so an interrupted and
  resumed response equals the uninterrupted one (greedy always; sampled too, given equal weights).
- Nothing hidden: every token an engine has produced is returned by the :meth:`Engine.step` call that
  produced it, so :meth:`Engine.abort` never loses output.
- A weight load invalidates every cached key/value; it is refused while requests run (the in-flight policy:
  the agent drains or aborts first, explicitly).
- Adapter engines (LoRA runs, :attr:`Engine.max_adapters` ≥ 1) serve one base and up to ``max_adapters`` adapter
  versions at once, unmerged; each request names its version (``GenRequest.adapter_version``). An adapter is loaded
  into a free slot while other requests run (it touches neither the base nor their adapters) and unloaded only when no
  request in flight names it: neither call ever waits for requests to finish.
"""
from __future__ import annotations

import abc
import operator
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one response.

    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus mass in (0, 1]; 1 disables truncation.
    seed: per-response seed; the random draw for response position k is a pure function of (seed, k).
    stop_token_ids: generation ends after emitting one of these (the stop token is included in the output).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = (1, 2)


@dataclass
class GenRequest:
    """One response to generate (or to continue).

    rid: unique request id.
    prompt_ids: prompt token ids (BOS included when the task wants it).
    prefix_ids: response tokens already generated (migration); their count is the response position
        at which this engine starts.
    max_new_tokens: remaining budget (original budget − len(prefix_ids)); must be ≥ 1.
    """

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_ids: list[int] = field(default_factory=list)
    adapter_version: int | None = None  # adapter engines: the version that serves it (None: the newest loaded)


@dataclass
class TokenEvent:
    """Tokens produced for one request by one :meth:`Engine.step` call.

    token_ids / logprobs: equal length (float logprob of each sampled token under the behaviour policy:
    log-softmax of logits/temperature before top-p truncation; for greedy, of the raw logits).
    finished: True when this event ends the request; finish_reason then says why.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: FinishReason | None = None


class EngineError(RuntimeError):
    """The engine failed; the message says which request or call and why."""


class RequestError(EngineError):
    """One request (``rid``) failed while the engine serves the others: the engine dropped it, and the tokens it
    returned for it before the failure stand (a caller hands the rest of the response to another engine)."""

    def __init__(self, rid: str, message: str) -> None:
        super().__init__(message)
        self.rid = rid


def validate_request(req: GenRequest, *, vocab_size: int | None, max_len: int | None) -> GenRequest:
    """Check a request against the engine's limits and return a copy with plain-int id lists.

    Raises:
        EngineError: empty prompt; ``max_new_tokens`` not an int ≥ 1; a non-integer id or one outside
            ``[0, vocab_size)``; temperature < 0 or top_p outside (0, 1];
            ``len(prompt) + len(prefix) + max_new_tokens > max_len``.
    """
    rid = req.rid
    if not req.prompt_ids:
        raise EngineError(f"request {rid!r}: empty prompt_ids")
    if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise EngineError(f"request {rid!r}: max_new_tokens must be an int ≥ 1, got {req.max_new_tokens!r}")
    clean: dict[str, list[int]] = {}
    for name, ids in (("prompt_ids", req.prompt_ids), ("prefix_ids", req.prefix_ids)):
        try:
            clean[name] = [operator.index(t) for t in ids]
        except TypeError:
            raise EngineError(f"request {rid!r}: {name} holds non-integer ids") from None
        if vocab_size is not None:
            bad = [t for t in clean[name] if not 0 <= t < vocab_size]
            if bad:
                raise EngineError(f"request {rid!r}: {name} holds ids outside [0, {vocab_size}): {bad[:5]}")
    sp = req.sampling
    if not sp.temperature >= 0:
        raise EngineError(f"request {rid!r}: temperature must be ≥ 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise EngineError(f"request {rid!r}: top_p must be in (0, 1], got {sp.top_p}")
    total = len(clean["prompt_ids"]) + len(clean["prefix_ids"]) + req.max_new_tokens
    if max_len is not None and total > max_len:
        raise EngineError(
            f"request {rid!r}: prompt ({len(clean['prompt_ids'])}) + prefix ({len(clean['prefix_ids'])}) + "
            f"max_new_tokens ({req.max_new_tokens}) = {total} exceeds max_len {max_len}")
    return GenRequest(rid=rid, prompt_ids=clean["prompt_ids"], max_new_tokens=req.max_new_tokens, sampling=sp,
                      prefix_ids=clean["prefix_ids"], adapter_version=req.adapter_version)


class Engine(abc.ABC):
    """A batched, resumable generator. Not thread-safe: one agent thread drives it."""

    max_batch: int
    version: int = -1
    #: whole-version checksum of the weight bytes loaded as :attr:`version` (set by whoever loads them; 0: unknown)
    weights_checksum: int = 0
    #: adapter versions served at once (0: not an adapter engine — :meth:`load_weights` replaces every weight)
    max_adapters: int = 0
    #: bytes the last weight or adapter load copied into the engine (an adapter's, never the base's)
    last_load_bytes: int = 0

    @abc.abstractmethod
    def add(self, req: GenRequest) -> None:
        """Queue ``req``; it starts at the next :meth:`step`. Raises EngineError on duplicate rid or bad input."""

    @abc.abstractmethod
    def step(self) -> list[TokenEvent]:
        """Run one iteration (prefill of new requests, one decode token for each running request).

        Returns the events of this iteration; an empty list when idle.
        """

    @abc.abstractmethod
    def abort(self, rid: str) -> TokenEvent | None:
        """Drop ``rid`` and return its tokens that :meth:`step` has not returned yet (``finished=False`` unless
        it had finished on its own), or ``None`` when there are none (always, for engines that return every
        token from :meth:`step`, like the torch engine). Unknown rid: ``None``. A caller handing a partial
        response over to another instance must forward the returned tokens first (nothing produced is lost)."""

    def abort_many(self, rids: Sequence[str]) -> dict[str, TokenEvent]:
        """:meth:`abort` for several requests: ``{rid: event}`` for those with undelivered tokens."""
        out = {}
        for rid in rids:
            ev = self.abort(rid)
            if ev is not None:
                out[rid] = ev
        return out

    def close(self) -> None:
        """Release what the engine holds (processes, sockets); no-op by default. Idempotent."""

    @abc.abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights (HF names) and set :attr:`version`; flushes every KV/prefix cache.

        Raises EngineError if requests are running or a tensor name/shape does not match the model.
        """

    @property
    @abc.abstractmethod
    def num_active(self) -> int:
        """Requests queued or running."""

    # ------------------------------------------------------------------ adapter engines (max_adapters ≥ 1)
    def adapter_versions(self) -> list[int]:
        """The adapter versions loaded, oldest first (empty for an engine of full weights)."""
        return []

    def adapter_in_use(self, version: int) -> bool:
        """Whether a request queued or running names adapter ``version``."""
        return False

    def load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load adapter ``version`` into a free slot while requests run; it becomes :attr:`version` (the default of
        requests that name none). Returns the bytes moved into the engine (the adapter's).

        Raises:
            EngineError: not an adapter engine; no free slot (unload a version no request names first); tensors that
                are not this engine's adapter (nothing changes).
        """
        raise EngineError(f"{type(self).__name__} serves full weights, not adapters")

    def unload_adapter(self, version: int) -> None:
        """Free adapter ``version``'s slot (unknown version: no-op).

        Raises:
            EngineError: a request queued or running names it (the caller unloads another, or later).
        """
        raise EngineError(f"{type(self).__name__} serves full weights, not adapters")

    def _drop_adapter(self, held: dict, version: int) -> None:
        """The in-process engines' unload: ``version`` leaves ``held`` (version → its slot or tensors) unless a request
        in flight names it; the newest remaining version becomes :attr:`version` (-1: none).

        Raises:
            EngineError: a queued or running request is served by it."""
        if version not in held:
            return
        if self.adapter_in_use(version):
            raise EngineError(f"unload_adapter(version={version}) refused: a request in flight is served by it")
        del held[version]
        if self.version == version:
            self.version = max(held, default=-1)
