"""A pure-torch Llama-family decoder (Llama, Qwen2, Qwen3) with HF parameter names.

GQA, RMSNorm, SwiGLU, RoPE (theta, optional ``llama3`` scaling), optionally tied embeddings, Qwen2's q/k/v
biases, Qwen3's per-head q/k RMSNorm and explicit ``head_dim``: whatever :class:`~rlboost_hpc.models.arch.ModelArch`
describes.

Invariants:
- ``LlamaModel(arch).state_dict()`` keys are exactly ``arch.expected_shapes()`` — the HF ``*ForCausalLM``
  names (``lm_head.weight`` included, sharing storage with ``model.embed_tokens.weight`` when tied) — so an HF
  state dict loads with ``load_state_dict(strict=True)`` and vice versa. No persistent buffers.
- Numerics follow HF's (RMSNorm ``w * (x·rsqrt(mean(x²) + eps))`` computed in fp32 and cast back, rotate-half
  RoPE with ``cos/sin(pos · inv_freq)`` duplicated over both halves and cast to the activations' dtype, scale
  ``hd^-0.5``, softmax in fp32, query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``, Qwen3's q/k
  norm before RoPE): logits agree with ``transformers`` to ~1e-6 in fp32. Parameters may be any float dtype
  (bf16 on GPU); logits are returned as fp32.
- Two paths share the weights: :meth:`LlamaModel.forward` (differentiable, batched, padded) for training and
  scoring; :meth:`LlamaModel.prefill` / :meth:`LlamaModel.decode` (no grad) over a :class:`KVCache` for
  generation. For the same tokens and positions both paths give the same logits up to float rounding.
- A :class:`KVCache` slot holds keys/values for positions ``[0, length)`` of one sequence; ``decode`` attends
  each slot only to its own ``length`` entries (plus the new one), so slots of different lengths batch together.
- LoRA for serving: with :attr:`LlamaModel.adapters` set (:class:`~rlboost_hpc.models.lora.AdapterSlots`), ``prefill``
  and ``decode`` add each request's adapter (its slot) to every adapted linear layer, unmerged: the base weights are
  never modified. The training path leaves adapters to the caller's modules (PEFT wraps them); ``adapters`` stays
  None there.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.models.lora import AdapterSlots

__all__ = ["LlamaModel", "KVCache", "RMSNorm", "rope_inv_freq"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: ``weight * (x·rsqrt(mean(x², -1) + eps))`` with the normalisation in fp32, cast back to
    ``x.dtype`` before the weight multiplies (``[..., D]`` in, same shape and dtype out)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm / Qwen3RMSNorm (see :func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim/2]`` fp32: ``theta^(-2i/hd)``, transformed by ``llama3`` scaling
    when the model has it (Llama 3.1's rule, as ``transformers``' ``_compute_llama3_parameters``)."""
    import math

    hd = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = arch.rope_scaling
    if rs is None:
        return inv
    old = rs.original_max_position_embeddings
    low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.q_proj = nn.Linear(D, cfg.q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_dim, D, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


#: Longest sequence (positions) whose causal attention runs the explicit ``softmax(q·kᵀ + mask)·v`` on the CPU.
_EXPLICIT_MAX_T = 64


def _right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a ``[B, T]`` bool mask is its real tokens followed by padding (True…True False…False)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all()) if mask.shape[1] > 1 else True


class KVCache:
    """Per-slot key/value storage for :meth:`LlamaModel.prefill` / :meth:`LlamaModel.decode`.

    Storage: ``k``, ``v`` of shape ``[n_layers, num_slots, n_kv_heads, max_len, head_dim]`` (dtype of the
    model, fp32 by default). ``lengths[s]`` (host ints) is the number of valid positions of slot ``s``.

    Raises:
        ValueError: ``num_slots`` or ``max_len`` < 1.
    """

    def __init__(self, config: ModelArch, num_slots: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache needs num_slots ≥ 1 and max_len ≥ 1, got {num_slots}, {max_len}")
        self.config = config
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (config.num_hidden_layers, num_slots, config.num_key_value_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths: list[int] = [0] * num_slots

    @property
    def device(self) -> torch.device:
        return self.k.device

    def length(self, slot: int) -> int:
        """Valid positions held by ``slot``."""
        return self.lengths[slot]

    def reset(self, slot: int | None = None) -> None:
        """Empty ``slot`` (all slots when None). Stale values stay in memory but are never attended."""
        if slot is None:
            self.lengths = [0] * self.num_slots
        else:
            self._check_slot(slot)
            self.lengths[slot] = 0

    def copy_slot(self, src: int, dsts: Sequence[int]) -> None:
        """Give every slot of ``dsts`` the keys, values and length of slot ``src`` (a shared prefix: the responses
        of one GRPO group start from the same prompt). Raises IndexError for a bad slot."""
        self._check_slot(src)
        for d in dsts:
            self._check_slot(d)
        if not dsts:
            return
        n = self.lengths[src]
        idx = torch.tensor(list(dsts), device=self.k.device)
        self.k[:, idx, :, :n] = self.k[:, src:src + 1, :, :n]
        self.v[:, idx, :, :n] = self.v[:, src:src + 1, :, :n]
        for d in dsts:
            self.lengths[d] = n

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")


class LlamaModel(nn.Module):
    """Llama-family causal LM whose ``state_dict`` uses HF ``*ForCausalLM`` names.

    Args:
        config: the architecture; ``tie_word_embeddings`` makes ``lm_head.weight`` the embedding parameter.
    """

    def __init__(self, config: ModelArch) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq = rope_inv_freq(config)
        self._rope_cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._scale = config.head_dim ** -0.5
        #: adapter versions served unmerged by prefill/decode (None: the base alone, or a PEFT-wrapped trainer model)
        self.adapters: AdapterSlots | None = None

    # ------------------------------------------------------------------ helpers
    @classmethod
    def from_state_dict(cls, config: ModelArch, state_dict: dict[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "LlamaModel":
        """Build a model on ``device`` with ``dtype`` parameters and load ``state_dict`` strictly (cast)."""
        m = cls(config).to(device=device, dtype=dtype)
        m.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}, strict=True)
        return m

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """As :meth:`torch.nn.Module.load_state_dict`; a tied model also accepts a dict without ``lm_head.weight``."""
        if self.config.tie_word_embeddings and "lm_head.weight" not in state_dict \
                and "model.embed_tokens.weight" in state_dict:
            state_dict = dict(state_dict)
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters (activations and the KV cache use it too)."""
        return self.model.embed_tokens.weight.dtype

    def _rope_tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[≥n, head_dim]`` in the model's dtype (HF rotate-half layout, computed in fp32);
        the sin table is sign-folded."""
        key = (torch.device(device), self.dtype)
        cached = self._rope_cache.get(key)
        if cached is not None and cached[0].shape[0] >= n:
            return cached
        size = max(n, self.config.max_position_embeddings, 1)
        pos = torch.arange(size, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :h], sin[:, h:]), dim=-1)  # rotate_half(x)*sin == roll(x,h)*sin_signed
        out = (cos.to(device=device, dtype=self.dtype), sin_signed.to(device=device, dtype=self.dtype))
        self._rope_cache[key] = out
        return out

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., h:], x[..., :h]), dim=-1) * sin_signed

    def _lin(self, module: nn.Module, x: torch.Tensor, li: int, target: str, sel) -> torch.Tensor:
        """``module(x)`` plus, when ``sel`` names adapter slots (an int, or one per row), the served adapter's update
        of ``target`` in layer ``li``."""
        y = module(x)
        if sel is not None and self.adapters is not None:
            d = self.adapters.delta(li, target, x, sel)
            if d is not None:
                y = y + d
        return y

    def _mlp(self, mlp: MLP, h: torch.Tensor, li: int, sel) -> torch.Tensor:
        """The SwiGLU MLP of layer ``li`` (its adapters when ``sel`` names slots)."""
        if sel is None:
            return mlp(h)
        g = F.silu(self._lin(mlp.gate_proj, h, li, "gate_proj", sel)) * self._lin(mlp.up_proj, h, li, "up_proj", sel)
        return self._lin(mlp.down_proj, g, li, "down_proj", sel)

    def _qkv(self, a: Attention, h: torch.Tensor, lead: tuple[int, ...], li: int = -1, sel=None
             ) -> tuple[torch.Tensor, ...]:
        """q ``[*lead, H, hd]``, k and v ``[*lead, KV, hd]`` of normed hidden states ``h`` (biases, q/k norm; the
        adapters of layer ``li`` when ``sel`` names slots)."""
        cfg = self.config
        q = self._lin(a.q_proj, h, li, "q_proj", sel).view(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = self._lin(a.k_proj, h, li, "k_proj", sel).view(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = self._lin(a.v_proj, h, li, "v_proj", sel).view(*lead, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        return q, k, v

    # ------------------------------------------------------------------ training / scoring
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every position (differentiable).

        Args:
            input_ids: ``[B, T]`` long.
            attention_mask: ``[B, T]`` bool/int (True = real token) or None (all real). Left or right padding;
                a query attends to keys ``j ≤ i`` with ``attention_mask[b, j]``.
            position_ids: ``[B, T]`` long or None. Default: ``cumsum(mask) - 1`` clamped at 0 (so a left-padded
                sequence starts at position 0 at its first real token), or ``arange(T)`` without a mask.

        Returns:
            ``[B, T, V]`` float32 logits. Rows at padded query positions are finite but meaningless.

        Raises:
            ValueError: ``input_ids`` is not 2-D, or the mask/position shapes differ from it.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {list(input_ids.shape)}")
        B, T = input_ids.shape
        dev = input_ids.device
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {list(attention_mask.shape)} != input_ids "
                                 f"{list(input_ids.shape)}")
            attention_mask = attention_mask.to(torch.bool)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                position_ids = torch.arange(T, device=dev).expand(B, T)
        elif position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {list(position_ids.shape)} != input_ids {list(input_ids.shape)}")
        cos_t, sin_t = self._rope_tables(int(position_ids.max()) + 1 if T else 1, dev)
        cos = cos_t[position_ids].unsqueeze(1)  # [B,1,T,hd]
        sin = sin_t[position_ids].unsqueeze(1)
        allowed = None  # causal alone: no mask, or right padding (a real query never reaches a pad)
        if attention_mask is not None and not _right_padded(attention_mask):
            allowed = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & attention_mask[:, None, :]
        return self.lm_head(self.model.norm(self._trunk(input_ids, cos, sin, allowed))).float()

    def _trunk(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None,
               kv_out: list[tuple[torch.Tensor, torch.Tensor]] | None = None, sel: int | None = None) -> torch.Tensor:
        """Hidden states ``[B,T,D]`` before the final norm. ``allowed``: ``[B|1,T,T]`` bool (query, key), or None:
        causal (key ``j ≤ i``) — then attention is torch's fused ``scaled_dot_product_attention`` (no ``[B,H,T,T]``
        scores in memory: at 64 sequences of up to 270 tokens the explicit path took twice as long, 1.8× TRL's time
        per token), except on the CPU up to :data:`_EXPLICIT_MAX_T` positions, where the explicit path was ~10 %
        faster (64 sequences of ~60 tokens, one thread).

        With ``allowed``, masked scores are set to the most negative fp32 (not -inf), so fully masked rows stay finite.
        ``kv_out`` (if given) receives each layer's post-RoPE keys and values, ``[B,KV,T,hd]`` each. ``sel``: the
        adapter slot every row is served with (None: none).
        """
        cfg = self.config
        B, T = input_ids.shape
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        G = H // KV
        fused = allowed is None and (T > _EXPLICIT_MAX_T or input_ids.device.type != "cpu")
        if allowed is None and not fused:
            allowed = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None]
        bias = None
        if not fused:
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=input_ids.device)
            bias = bias.masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None, None]  # [B|1,1,1,T,T]
        x = self.model.embed_tokens(input_ids)
        for li, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = self._qkv(a, layer.input_layernorm(x), (B, T), li, sel)
            q = self._apply_rope(q.transpose(1, 2), cos, sin).view(B, KV, G, T, hd)
            k = self._apply_rope(k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            if kv_out is not None:
                kv_out.append((k, v))
            if bias is None:  # heads h = kv·G + g share key/value head kv
                kk, vv = (k, v) if G == 1 else (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))
                o = F.scaled_dot_product_attention(q.view(B, H, T, hd), kk, vv, is_causal=True, scale=self._scale)
            else:
                scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).float() * self._scale + bias
                p = torch.softmax(scores, dim=-1).to(v.dtype)
                o = torch.matmul(p, v.unsqueeze(2))  # [B,KV,G,T,hd]
            o = o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
            x = x + self._lin(a.o_proj, o, li, "o_proj", sel)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x), li, sel)
        return x

    # ------------------------------------------------------------------ generation
    def new_cache(self, num_slots: int, max_len: int | None = None) -> KVCache:
        """A :class:`KVCache` on this model's device/dtype; ``max_len`` defaults to ``max_position_embeddings``."""
        w = self.model.embed_tokens.weight
        return KVCache(self.config, num_slots, max_len or self.config.max_position_embeddings,
                       device=w.device, dtype=w.dtype)

    @torch.no_grad()
    def prefill(self, cache: KVCache, slot: int, input_ids: Sequence[int] | torch.Tensor,
                adapter: int | None = None) -> torch.Tensor:
        """Reset ``slot``, run ``input_ids`` (positions ``0..T-1``) through the model and cache their keys/values.

        Args:
            cache: the cache to fill.
            slot: slot index in ``[0, cache.num_slots)``.
            input_ids: ``T ≥ 1`` token ids (list or 1-D long tensor).
            adapter: the :attr:`adapters` slot to serve the request with (None: the base alone).

        Returns:
            ``[V]`` float32 logits of the last position. Afterwards ``cache.length(slot) == T``.

        Raises:
            IndexError: bad slot. ValueError: ``T == 0`` or ``T > cache.max_len``.
        """
        cache._check_slot(slot)
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=cache.device).reshape(-1)
        T = ids.numel()
        if T == 0 or T > cache.max_len:
            raise ValueError(f"prefill of {T} tokens into a cache of max_len {cache.max_len}")
        cache.lengths[slot] = 0
        cos_t, sin_t = self._rope_tables(T, cache.device)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = self._trunk(ids[None], cos_t[:T], sin_t[:T], None, kv_out=kv, sel=adapter)
        for li, (k, v) in enumerate(kv):
            cache.k[li, slot, :, :T] = k[0]
            cache.v[li, slot, :, :T] = v[0]
        cache.lengths[slot] = T
        return self.lm_head(self.model.norm(x[0, -1])).float()

    @torch.no_grad()
    def prefill_many(self, cache: KVCache, slots: Sequence[int], inputs: Sequence[Sequence[int]],
                     adapter: int | None = None) -> torch.Tensor:
        """:meth:`prefill` of several slots in one batched forward pass: ``inputs[i]`` into ``slots[i]``.

        The sequences are right-padded to the longest; under the causal mask a real position never attends to a
        pad (pads come after it), so each row's keys, values and last-position logits are those :meth:`prefill`
        computes for it alone, up to float rounding of the larger matmuls. Positions past a row's length are
        written to its slot too, but the slot's length is its own (they are never attended, and the next
        :meth:`decode` overwrites the first of them).

        Args:
            slots: distinct slot indices in ``[0, cache.num_slots)``, one per sequence.
            inputs: token id lists, each ``1 ≤ T ≤ cache.max_len``.
            adapter: the :attr:`adapters` slot every row is served with (None: the base alone).

        Returns:
            ``[len(slots), V]`` float32 logits of each sequence's last position.

        Raises:
            IndexError: bad slot. ValueError: no sequences, lengths differ from the slots', duplicate slots, an
            empty or too long sequence.
        """
        sl = [int(s) for s in slots]
        if not sl or len(sl) != len(inputs) or len(set(sl)) != len(sl):
            raise ValueError(f"prefill_many needs one sequence per distinct slot, got {len(inputs)} for {sl}")
        lens = [len(x) for x in inputs]
        T = max(lens)
        if min(lens) == 0 or T > cache.max_len:
            raise ValueError(f"prefill of {lens} tokens into a cache of max_len {cache.max_len}")
        for s in sl:
            cache._check_slot(s)
            cache.lengths[s] = 0
        ids = torch.zeros(len(sl), T, dtype=torch.long)
        for i, x in enumerate(inputs):
            ids[i, :lens[i]] = torch.as_tensor(x, dtype=torch.long)
        ids = ids.to(cache.device)
        cos_t, sin_t = self._rope_tables(T, cache.device)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = self._trunk(ids, cos_t[:T], sin_t[:T], None, kv_out=kv, sel=adapter)
        s0 = sl[0]
        rows = slice(s0, s0 + len(sl)) if sl == list(range(s0, s0 + len(sl))) else torch.tensor(sl, device=cache.device)
        for li, (k, v) in enumerate(kv):
            cache.k[li, rows, :, :T] = k
            cache.v[li, rows, :, :T] = v
        for s, n in zip(sl, lens):
            cache.lengths[s] = n
        last = x[torch.arange(len(sl), device=x.device), torch.tensor(lens, device=x.device) - 1]
        return self.lm_head(self.model.norm(last)).float()

    @torch.no_grad()
    def decode(self, cache: KVCache, slots: torch.Tensor | Sequence[int], input_ids: torch.Tensor,
               adapters: Sequence[int] | None = None) -> torch.Tensor:
        """Append one token to each listed slot and return the next-token logits.

        Slot ``slots[i]`` gets ``input_ids[i]`` at position ``cache.length(slots[i])`` and attends to its own
        positions ``[0, length]`` only. Attention reads ``max(length)+1`` positions, not ``max_len``; when the
        slots form a contiguous ascending range the cache is read as a view (no gather).

        Args:
            slots: ``[S]`` long (distinct slot indices).
            input_ids: ``[S]`` long.
            adapters: the :attr:`adapters` slot of each row (None: the base alone); rows may differ.

        Returns:
            ``[S, V]`` float32 logits. Each listed slot's length grows by one.

        Raises:
            ValueError: shapes differ, duplicate slots, or a slot is full (length == max_len).
            IndexError: a slot is out of range.
        """
        sl = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
        S = len(sl)
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=cache.device).reshape(-1)
        if ids.numel() != S or S == 0:
            raise ValueError(f"decode needs one input id per slot (≥1), got {ids.numel()} ids for {S} slots")
        lens = cache.lengths
        pos_list = []
        for s in sl:
            cache._check_slot(s)
            if lens[s] >= cache.max_len:
                raise ValueError(f"slot {s} is full ({lens[s]} of max_len {cache.max_len})")
            pos_list.append(lens[s])
        if len(set(sl)) != S:
            raise ValueError(f"duplicate slots in decode: {sl}")
        cfg = self.config
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        G = H // KV
        dev = cache.device
        Tm = max(pos_list) + 1
        pos = torch.tensor(pos_list, dtype=torch.long, device=dev)
        s0 = sl[0]
        contiguous = sl == list(range(s0, s0 + S))
        slot_t = None if contiguous else torch.tensor(sl, dtype=torch.long, device=dev)
        cos_t, sin_t = self._rope_tables(Tm, dev)
        cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)  # [S,1,hd]
        bias = torch.zeros(S, Tm, device=dev)
        bias.masked_fill_(torch.arange(Tm, device=dev)[None, :] > pos[:, None], float("-inf"))
        bias = bias.view(S, 1, 1, Tm)
        write_slots = slot_t if slot_t is not None else torch.arange(s0, s0 + S, device=dev)
        eps = cfg.rms_norm_eps
        sel = None
        if adapters is not None and self.adapters is not None:
            ad = [int(i) for i in adapters]
            sel = ad[0] if len(set(ad)) == 1 else torch.tensor(ad, dtype=torch.long, device=dev)
        x = F.embedding(ids, self.model.embed_tokens.weight)  # [S,D]
        for li, layer in enumerate(self.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k, v = self._qkv(a, rms_norm(x, layer.input_layernorm.weight, eps), (S,), li, sel)
            q = self._apply_rope(q, cos, sin).view(S, KV, G, hd)
            k = self._apply_rope(k, cos, sin)
            ck, cv = cache.k[li], cache.v[li]
            ck[write_slots, :, pos] = k
            cv[write_slots, :, pos] = v
            if slot_t is None:
                K, V_ = ck[s0:s0 + S, :, :Tm], cv[s0:s0 + S, :, :Tm]
            else:
                K, V_ = ck[slot_t, :, :Tm], cv[slot_t, :, :Tm]
            scores = torch.matmul(q, K.transpose(-1, -2)).float() * self._scale + bias  # [S,KV,G,Tm]
            o = torch.matmul(torch.softmax(scores, dim=-1).to(V_.dtype), V_).reshape(S, H * hd)
            if sel is None:
                x = x + F.linear(o, a.o_proj.weight)
                h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
                x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                                 mlp.down_proj.weight)
            else:
                x = x + self._lin(a.o_proj, o, li, "o_proj", sel)
                x = x + self._mlp(mlp, rms_norm(x, layer.post_attention_layernorm.weight, eps), li, sel)
        for s in sl:
            lens[s] += 1
        return self.lm_head(self.model.norm(x)).float()
