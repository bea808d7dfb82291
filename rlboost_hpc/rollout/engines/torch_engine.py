"""A pure-torch, continuously batched, resumable rollout engine over :class:`rlboost_hpc.models.llama.LlamaModel`
(Llama, Qwen2, Qwen3), on the CPU or a CUDA device, in fp32 or bf16.

Implements :class:`rlboost_hpc.rollout.engines.base.Engine` exactly. Invariants (beyond the base contract):
- One KV-cache slot per running request (``max_batch`` slots, lowest free slot first); requests added beyond
  ``max_batch`` wait in FIFO order and start as slots free up. ``num_active`` counts waiting + running.
- A step: (1) every waiting request that gets a slot is prefilled with ``prompt_ids + prefix_ids`` and its first
  token is sampled from the prefill logits; (2) one batched ``decode`` call feeds the last sampled token of every
  running, unfinished request (including those just prefilled) and samples the next. So a request yields 1–2
  tokens in the step that starts it and exactly 1 per step afterwards; every token is returned by the step that
  produced it. Between steps every running request has exactly one sampled-but-not-yet-fed token.
- Finishing: a token in ``stop_token_ids`` ends the request with ``"stop"`` (the token is included); otherwise
  reaching ``max_new_tokens`` tokens ends it with ``"length"``. An engine never produces more than
  ``max_new_tokens`` tokens for a request, so a resumed request never exceeds its original budget.
- Sampling is a pure function of (logits, temperature, top_p, seed, k) with k = ``len(prefix_ids)`` + tokens
  produced here = the absolute response position: greedy (temperature 0) is argmax; otherwise
  ``softmax(logits / temperature)`` in float64, sorted descending (stable), truncated to the smallest prefix whose
  mass reaches ``top_p`` (the token crossing it is kept), renormalised, and inverted at ``u(seed, k)`` where
  ``u`` is splitmix64(splitmix64(seed) + k) mapped to [0, 1) by its top 53 bits (:func:`uniform`). The
  behaviour logprob is ``log_softmax(logits / temperature)[token]`` in fp32 (raw logits when greedy), before
  truncation. Hence migrated (resumed) responses equal uninterrupted ones given equal weights.
- ``load_weights`` is refused while any request is queued or running; it checks every name and shape before
  changing anything (all-or-nothing), casts to the engine's dtype, and empties every cache slot.
- Logits are fp32 whatever the weights' dtype, so sampling is the same rule on every device.
- Adapter mode (``adapter`` given: a LoRA run): the model holds the base, never modified, and
  :class:`~rlboost_hpc.models.lora.AdapterSlots` hold up to ``max_adapters`` adapter versions, served unmerged. A
  request is bound to its version's slot when added; :meth:`TorchEngine.load_adapter` copies a version into a free slot
  (the adapter's bytes only, a few MB) while others run; :meth:`TorchEngine.unload_adapter` frees a slot no request
  names. A decode batch may mix versions (each row its own A·B).
- Not thread-safe. The engine does not change torch's thread settings; tiny models run fastest with
  ``torch.set_num_threads(1)`` on a busy CPU.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.models.arch import ModelArch, ModelFormatError, validate_state_dict
from rlboost_hpc.models.llama import KVCache, LlamaModel
from rlboost_hpc.models.lora import AdapterSlots
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.rollout.engines.base import (
    Engine,
    EngineError,
    FinishReason,
    GenRequest,
    TokenEvent,
    validate_request,
)
from rlboost_hpc.models.layout import FlatState, copy_tensors, dtype_from_name

__all__ = ["TorchEngine", "generate_all", "uniform", "uniform_reference", "sample_tokens"]

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """Python int → the signed int64 with the same low 64 bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 ``x`` (wrapping arithmetic): mix(x + golden gamma)."""
    z = x + _GAMMA
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms ``u(seed, k) ∈ [0, 1)``.

    Args:
        seeds: int64 tensor (seeds already reduced to signed int64, see :func:`_s64`).
        positions: int64 tensor broadcastable with ``seeds`` (absolute response positions k).

    Returns:
        float64 tensor: ``top53(splitmix64(splitmix64(seed) + k)) / 2**53``.
    """
    h = _splitmix64(_splitmix64(seeds) + positions)
    return _srl(h, 11).to(torch.float64) * (1.0 / (1 << 53))


def uniform_reference(seed: int, k: int) -> float:
    """Pure-Python reference of :func:`uniform` for one (seed, k) (used by tests)."""

    def sm(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    return (sm((sm(seed & _MASK64) + k) & _MASK64) >> 11) / float(1 << 53)


def sample_tokens(logits: torch.Tensor, temperatures: list[float], top_ps: list[float], seeds: list[int],
                  positions: list[int]) -> tuple[list[int], list[float]]:
    """Sample one token per row (see the module docstring for the exact rule).

    Args:
        logits: ``[S, V]`` float32.
        temperatures / top_ps / seeds / positions: length ``S`` each.

    Returns:
        ``(tokens, logprobs)``: ``S`` ints and ``S`` floats (behaviour logprobs).
    """
    S = logits.shape[0]
    dev = logits.device
    tokens = [0] * S
    logprobs = [0.0] * S
    greedy = [i for i in range(S) if temperatures[i] == 0]
    sampled = [i for i in range(S) if temperatures[i] != 0]
    if greedy:
        g = logits if len(greedy) == S else logits[torch.tensor(greedy, device=dev)]
        tok = g.argmax(-1)
        lp = torch.log_softmax(g, -1).gather(-1, tok[:, None])[:, 0]
        for i, t, l in zip(greedy, tok.tolist(), lp.tolist()):
            tokens[i], logprobs[i] = t, l
    if sampled:
        idx = None if len(sampled) == S else torch.tensor(sampled, device=dev)
        x = logits if idx is None else logits[idx]
        temp = torch.tensor([temperatures[i] for i in sampled], dtype=torch.float32, device=dev)[:, None]
        scaled = x / temp
        logp = torch.log_softmax(scaled, -1)
        probs = torch.softmax(scaled.double(), -1)
        top_p = [min(float(top_ps[i]), 1.0) for i in sampled]
        u = uniform(torch.tensor([_s64(seeds[i]) for i in sampled], dtype=torch.int64, device=dev),
                    torch.tensor([positions[i] for i in sampled], dtype=torch.int64, device=dev))
        tok = _inverse_cdf_top_p(probs, torch.tensor(top_p, dtype=torch.float64, device=dev), u)
        lp = logp.gather(-1, tok[:, None])[:, 0]
        for i, t, l in zip(sampled, tok.tolist(), lp.tolist()):
            tokens[i], logprobs[i] = t, l
    return tokens, logprobs


_FAST_K = 64


def _inverse_cdf_top_p(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids ``[R]``: inverse CDF at ``u`` of each row of ``probs`` ``[R, V]`` (float64) sorted descending,
    truncated to top-p and renormalised.

    Kept set: sorted tokens whose exclusive cumulative mass is < top_p (all tokens when top_p ≥ 1). Mass of the
    kept set: their sorted cumulative sum (``probs.sum()`` in vocabulary order when top_p ≥ 1). Target
    ``u * mass``; the token is the first kept one whose inclusive cumulative sum exceeds the target (the last kept
    one if rounding leaves none). Each row's result depends only on that row (a fast ``topk`` path is taken when
    the answer provably lies in the top ``_FAST_K``, decided from the row's own values; otherwise a full stable
    sort), so it does not depend on which other rows share the batch.
    """
    R, V = probs.shape
    K = min(_FAST_K, V)
    full_keep = top_p >= 1.0
    mass_all = probs.sum(-1)
    out = torch.empty(R, dtype=torch.long, device=probs.device)
    if K < V:
        tv, ti = torch.topk(probs, K, dim=-1)
        c = tv.cumsum(-1)
        n_keep = ((c - tv) < top_p[:, None]).sum(-1)  # kept within the top K (prefix)
        inside = (~full_keep) & (n_keep < K)  # truncation point inside the top K: exact mass known
        mass = torch.where(inside, c.gather(-1, (n_keep - 1).clamp_min(0)[:, None])[:, 0], mass_all)
        target = u * mass
        fast = inside | (full_keep & (target < c[:, -1]))
        j = torch.searchsorted(c, target[:, None].contiguous(), right=True)[:, 0]
        j = torch.minimum(j, torch.where(inside, n_keep, torch.full_like(n_keep, K)) - 1)
        out = torch.where(fast, ti.gather(-1, j[:, None])[:, 0], out)
        slow = (~fast).nonzero()[:, 0]
    else:
        slow = torch.arange(R, device=probs.device)
    if slow.numel():
        ps = probs[slow]
        sp, si = torch.sort(ps, dim=-1, descending=True, stable=True)
        cum = sp.cumsum(-1)
        tp = top_p[slow][:, None]
        keep = ((cum - sp) < tp) | (tp >= 1.0)
        n_keep = keep.sum(-1)
        mass = torch.where(full_keep[slow], mass_all[slow], cum.gather(-1, (n_keep - 1)[:, None])[:, 0])
        j = torch.searchsorted(cum, (u[slow] * mass)[:, None].contiguous(), right=True)[:, 0]
        j = torch.minimum(j, n_keep - 1)
        out[slow] = si.gather(-1, j[:, None])[:, 0]
    return out


@dataclass
class _Running:
    req: GenRequest
    stop: frozenset[int]
    slot: int = -1
    produced: int = 0
    last_token: int = -1  # sampled, not yet fed to the model
    finished: bool = False
    adapter: int | None = None  # the adapter slot that serves it (adapter mode)

    @property
    def position(self) -> int:
        """Absolute response position of the next token to sample."""
        return len(self.req.prefix_ids) + self.produced


class TorchEngine(Engine):
    """Continuous-batching engine on a pure-torch Llama with a per-slot KV cache.

    Args:
        config: the model architecture.
        state_dict: HF-named weights (any float dtype; cast to fp32). ``lm_head.weight`` may be omitted when tied.
        max_batch: KV-cache slots = most requests running at once (≥ 1).
        max_len: most positions per request (prompt + prefix + new tokens); default
            ``config.max_position_embeddings``.
        device: torch device for weights, cache and sampling.
        dtype: dtype of the weights and the KV cache (fp32 on CPU; bf16 is the GPU default of the run).
        version: initial weight version (``self.version``; -1 in adapter mode until an adapter is loaded).
        adapter: a LoRA run's adapter spec: ``state_dict`` is the base, and the engine serves up to
            ``adapter.max_adapters`` adapter versions on it (module docstring).

    Raises:
        EngineError: bad ``max_batch``/``max_len`` or a state dict that does not match ``config``.
    """

    def __init__(self, config: ModelArch, state_dict: Mapping[str, torch.Tensor], max_batch: int = D.MAX_BATCH,
                 max_len: int | None = None, device: str | torch.device = "cpu", version: int = 0,
                 dtype: torch.dtype = torch.float32, adapter: AdapterSpec | None = None) -> None:
        if max_batch < 1:
            raise EngineError(f"max_batch must be ≥ 1, got {max_batch}")
        max_len = config.max_position_embeddings if max_len is None else max_len
        if max_len < 2:
            raise EngineError(f"max_len must be ≥ 2, got {max_len}")
        self.config = config
        self.max_batch = max_batch
        self.max_len = max_len
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = LlamaModel(config).to(device=self.device, dtype=dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._tensors = self.model.state_dict(keep_vars=True)  # HF name → the model's own tensor
        self._flat: FlatState | None = None  # the parameters in one flat tensor, once a FlatState was loaded
        self.cache: KVCache = self.model.new_cache(max_batch, max_len)
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        self._free: list[int] = list(range(max_batch))
        heapq.heapify(self._free)
        self._load(state_dict)
        self.version = version
        self._slot_of: dict[int, int] = {}  # adapter version → slot, oldest first
        if adapter is not None:
            self.max_adapters = int(adapter.max_adapters)
            self.model.adapters = AdapterSlots(config, adapter.targets, adapter.rank, adapter.scaling,
                                               self.max_adapters, device=self.device, dtype=dtype,
                                               wire_dtype=dtype_from_name(adapter.base_dtype))
            self.version = -1

    # ------------------------------------------------------------------ Engine API
    @property
    def num_active(self) -> int:
        """Requests queued or running."""
        return len(self._waiting) + len(self._running)

    def add(self, req: GenRequest) -> None:
        """Queue ``req`` (copied); it starts at the next :meth:`step`.

        Raises:
            EngineError: duplicate rid; empty prompt; ``max_new_tokens < 1``; a token id outside the vocabulary;
                temperature < 0 or top_p outside (0, 1]; ``len(prompt)+len(prefix)+max_new_tokens > max_len``.
        """
        rid = req.rid
        if rid in self._running or any(w.req.rid == rid for w in self._waiting):
            raise EngineError(f"request {rid!r}: duplicate rid (already queued or running)")
        copy = validate_request(req, vocab_size=self.config.vocab_size, max_len=self.max_len)
        sp = copy.sampling
        slot = None
        if self.max_adapters:
            v = self.version if copy.adapter_version is None else copy.adapter_version
            slot = self._slot_of.get(v)
            if slot is None:
                raise EngineError(f"request {rid!r}: adapter version {v} is not loaded (loaded: {list(self._slot_of)})")
        self._waiting.append(_Running(req=copy, stop=frozenset(int(t) for t in sp.stop_token_ids), adapter=slot))

    def step(self) -> list[TokenEvent]:
        """Prefill newly admitted requests, then decode one token for every running request (one batch).

        Returns:
            One :class:`TokenEvent` per request that produced tokens in this step (1–2 tokens for a request
            started in this step, 1 otherwise); an empty list when idle.
        """
        events: dict[str, TokenEvent] = {}
        # (1) admit and prefill
        new: list[_Running] = []
        while self._waiting and self._free:
            r = self._waiting.popleft()
            r.slot = heapq.heappop(self._free)
            self._running[r.req.rid] = r
            new.append(r)
        if new:
            self._sample_into(new, self._prefill(new), events)
        # (2) one batched decode over every unfinished running request
        live = sorted((r for r in self._running.values() if not r.finished), key=lambda r: r.slot)
        if live:
            slots = torch.tensor([r.slot for r in live], dtype=torch.long, device=self.device)
            ids = torch.tensor([r.last_token for r in live], dtype=torch.long, device=self.device)
            logits = self.model.decode(self.cache, slots, ids,
                                       adapters=[r.adapter for r in live] if self.max_adapters else None)
            self._sample_into(live, logits, events)
        # free finished requests
        for rid in [rid for rid, r in self._running.items() if r.finished]:
            self._release(self._running.pop(rid))
        return list(events.values())

    def abort(self, rid: str) -> None:  # every token was returned by step()
        """Drop ``rid`` whether queued or running and free its slot. Unknown rid: no-op."""
        r = self._running.pop(rid, None)
        if r is not None:
            self._release(r)
            return
        for w in self._waiting:
            if w.req.rid == rid:
                self._waiting.remove(w)
                return

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace all weights (HF names, any float dtype → the engine's), empty every cache slot, set ``version``.

        Raises:
            EngineError: requests are queued or running (nothing changes); or a tensor is missing, unexpected,
                of the wrong shape or not floating point (named; nothing changes).
        """
        if self.num_active:
            raise EngineError(
                f"load_weights(version={version}) refused: {self.num_active} request(s) active "
                f"({len(self._running)} running, {len(self._waiting)} queued); drain or abort them first"
            )
        if self.max_adapters:  # one adapter version replaces every one held
            for v in list(self._slot_of):
                self.unload_adapter(v)
            self.load_adapter(state_dict, version)
            return
        self._load(state_dict)
        self.version = version
        self.last_load_bytes = sum(t.numel() * t.element_size() for t in self._tensors.values())

    # ------------------------------------------------------------------ adapter mode
    def adapter_versions(self) -> list[int]:
        """Adapter versions loaded, oldest first."""
        return list(self._slot_of)

    def adapter_in_use(self, version: int) -> bool:
        """Whether a queued or running request is served by adapter ``version``."""
        slot = self._slot_of.get(version)
        return slot is not None and any(r.adapter == slot for r in (*self._waiting, *self._running.values()))

    def load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Copy adapter ``version`` into a free slot (requests may run; theirs are untouched) and make it the newest
        (:attr:`version`). Reloading a loaded version no request names overwrites its slot. Returns the bytes copied.

        Raises:
            EngineError: not in adapter mode; every slot holds a version a request names; tensors that are not the
                adapter's (nothing changes)."""
        if not self.max_adapters:
            raise EngineError("load_adapter: this engine serves full weights (built without an adapter spec)")
        if version in self._slot_of:
            self.unload_adapter(version)
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_adapters) if s not in used]
        if not free:
            raise EngineError(f"load_adapter(version={version}): all {self.max_adapters} adapter slots hold versions "
                              f"{list(self._slot_of)}; unload one no request names first")
        try:
            n = self.model.adapters.load(free[0], state_dict)
        except ValueError as e:
            raise EngineError(f"load_adapter(version={version}): {e}") from None
        self._slot_of[version] = free[0]
        self.version, self.last_load_bytes = version, n
        return n

    def unload_adapter(self, version: int) -> None:
        """Free the slot of adapter ``version`` (no-op when not loaded).

        Raises:
            EngineError: a queued or running request is served by it."""
        self._drop_adapter(self._slot_of, version)

    # ------------------------------------------------------------------ internals
    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if isinstance(state_dict, FlatState) and self._load_flat(state_dict):
            self.cache.reset()
            return
        try:
            validate_state_dict(self.config, state_dict, source="load_weights")
        except ModelFormatError as e:
            raise EngineError(str(e)) from None
        if self.config.tie_word_embeddings and "lm_head.weight" in state_dict \
                and not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]):
            raise EngineError("load_weights: tied model but lm_head.weight differs from model.embed_tokens.weight")
        # names and shapes were checked above: one fused cast-copy into the model's own tensors (a tied head
        # is the embedding tensor, so copying both names writes the same values twice)
        names = list(state_dict)
        copy_tensors([self._tensors[k] for k in names], [state_dict[k] for k in names])
        self.cache.reset()

    def _load_flat(self, state: FlatState) -> bool:
        """Load ``state`` with one (cast-)copy when its layout is the engine's own; False (nothing loaded) when it
        is not — then the tensor-by-tensor path checks and loads it. On the first call for a wire dtype the
        parameters move into one flat tensor laid out for it (a tied head once, as the embedding). Equal layouts
        mean equal names and shapes, so the checks of the other path hold without running them."""
        if self._flat is None or self._flat.wire_dtype != state.wire_dtype:
            self._flat = FlatState.of_parameters(self.model, state.wire_dtype)
        return self._flat.copy_from(state)

    def _prefill(self, new: list[_Running]) -> torch.Tensor:
        """Prefill the slots of the requests admitted in this step; returns their last-position logits ``[len(new),
        V]`` (fp32, in ``new``'s order). Requests with the same input (``prompt_ids + prefix_ids``) and adapter — the
        responses of one GRPO group — share one prefill: it runs once, into the first one's slot, and the others'
        slots get a copy of its keys and values. The distinct inputs of one adapter run as one batched pass."""
        first: dict[tuple, _Running] = {}
        shared: dict[int, list[int]] = {}  # slot prefilled → the slots that copy it
        for r in new:
            key = (r.adapter, *r.req.prompt_ids, -1, *r.req.prefix_ids)
            head = first.setdefault(key, r)
            if head is not r:
                shared.setdefault(head.slot, []).append(r.slot)
        by_adapter: dict[int | None, list[tuple[tuple, _Running]]] = {}
        for key, head in first.items():
            by_adapter.setdefault(head.adapter, []).append((key, head))
        row_of: dict[tuple, torch.Tensor] = {}
        for adapter, heads in by_adapter.items():
            logits = self.model.prefill_many(self.cache, [h.slot for _, h in heads],
                                             [h.req.prompt_ids + h.req.prefix_ids for _, h in heads], adapter=adapter)
            row_of.update((key, logits[i]) for i, (key, _) in enumerate(heads))
        for src, dsts in shared.items():
            self.cache.copy_slot(src, dsts)
        return torch.stack([row_of[(r.adapter, *r.req.prompt_ids, -1, *r.req.prefix_ids)] for r in new])

    def _release(self, r: _Running) -> None:
        if r.slot >= 0:
            self.cache.reset(r.slot)
            heapq.heappush(self._free, r.slot)
            r.slot = -1

    def _sample_into(self, reqs: list[_Running], logits: torch.Tensor, events: dict[str, TokenEvent]) -> None:
        sps = [r.req.sampling for r in reqs]
        toks, lps = sample_tokens(logits, [s.temperature for s in sps], [s.top_p for s in sps],
                                  [s.seed for s in sps], [r.position for r in reqs])
        for r, t, lp in zip(reqs, toks, lps):
            r.produced += 1
            r.last_token = t
            ev = events.get(r.req.rid)
            if ev is None:
                ev = events[r.req.rid] = TokenEvent(rid=r.req.rid, token_ids=[], logprobs=[])
            ev.token_ids.append(t)
            ev.logprobs.append(lp)
            reason: FinishReason | None = None
            if t in r.stop:
                reason = "stop"
            elif r.produced >= r.req.max_new_tokens:
                reason = "length"
            if reason is not None:
                r.finished = True
                ev.finished = True
                ev.finish_reason = reason


def generate_all(engine: Engine, requests: Iterable[GenRequest]) -> dict[str, tuple[list[int], list[float], str]]:
    """Add ``requests`` and step ``engine`` until it is idle.

    Returns:
        ``{rid: (token_ids, logprobs, finish_reason)}`` for every request.

    Raises:
        EngineError: from :meth:`Engine.add`, or the engine stopped producing events while requests were active.
    """
    out: dict[str, tuple[list[int], list[float], str]] = {}
    acc: dict[str, tuple[list[int], list[float]]] = {}
    for r in requests:
        engine.add(r)
        acc[r.rid] = ([], [])
    while engine.num_active:
        evs = engine.step()
        if not evs:
            raise EngineError(f"engine idle with {engine.num_active} active request(s)")
        for ev in evs:
            ids, lps = acc.setdefault(ev.rid, ([], []))
            ids.extend(ev.token_ids)
            lps.extend(ev.logprobs)
            if ev.finished:
                out[ev.rid] = (ids, lps, ev.finish_reason or "length")
    return out
