"""Weight bridge: Hugging Face tensors ⇄ Megatron-core ``GPTModel`` shards, for any TP × PP layout.

Megatron layout (local layer spec, one pipeline stage, TP rank ``r`` of ``tp``), per decoder layer ``j`` of the
stage (HF layer ``i = stage_offset + j``):

=========================================  ==========================================================
Megatron (``decoder.layers.j.`` prefix)     Hugging Face (``model.layers.i.`` prefix)
=========================================  ==========================================================
``input_layernorm.weight``                  ``input_layernorm.weight`` (replicated)
``self_attention.linear_qkv.weight``        q/k/v_proj, interleaved per query group:
                                            ``[ng/tp, (nq/ng + 2)·hd, h]`` = for each group its q heads,
                                            then k, then v; TP rank r holds groups ``[r·ng/tp, (r+1)·ng/tp)``
``self_attention.linear_qkv.bias``          q/k/v_proj biases, same interleave (Qwen2)
``self_attention.q_layernorm.weight``       ``self_attn.q_norm.weight`` (Qwen3; replicated)
``self_attention.k_layernorm.weight``       ``self_attn.k_norm.weight``
``self_attention.linear_proj.weight``       ``self_attn.o_proj.weight``, columns split over TP
``pre_mlp_layernorm.weight``                ``post_attention_layernorm.weight``
``mlp.linear_fc1.weight``                   ``[gate_r; up_r]``: rows r of gate_proj then rows r of up_proj
``mlp.linear_fc2.weight``                   ``mlp.down_proj.weight``, columns split over TP
=========================================  ==========================================================

plus ``embedding.word_embeddings.weight`` ↔ ``model.embed_tokens.weight`` (first stage, vocab rows split over
TP, padded to a multiple of tp), ``decoder.final_layernorm.weight`` ↔ ``model.norm.weight`` and
``output_layer.weight`` ↔ ``lm_head.weight`` (last stage; with tied embeddings and PP>1 the last stage holds a
copy of the embedding, which is exported by the first stage only). ``_extra_state`` entries carry no weights.

Export is expressed as :class:`Piece` s: each is a *view* (no copy) of a local Megatron tensor whose row-major
flattening is exactly a contiguous slice ``[start, stop)`` along ``dim`` of one HF tensor. A holder publishes
its pieces as they are (the publisher's cast-copy does the rearrangement for free); a puller reshapes each
received piece to ``slice_shape`` (free: received buffers are contiguous) and copies it into place
(:func:`assemble`), or an engine with the same TP split uses the pieces directly.

Invariants:
- Round trip: ``assemble(all ranks' pieces) == the HF state dict loaded by hf_to_megatron`` bit-for-bit for
  every layout, with no missing or extra names (tested at TP=1, TP=2, PP=2).
- Every HF element is exported by exactly one (tp, pp) position; replicated tensors by TP rank 0 only.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from megatron_bridge.arch import ModelArch, check_layout, padded_vocab, stage_layers
from rlboost_hpc.weights.sharded import assemble, check_tiling  # noqa: F401 (re-exported)

__all__ = ["Piece", "hf_to_megatron", "megatron_to_pieces", "assemble", "check_tiling", "hf_shapes",
           "SafetensorsSource", "piece_key"]


@dataclass(frozen=True)
class Piece:
    """A contiguous slice of one HF tensor held by one rank.

    key: unique name the holder publishes it under (``hf_name`` when the piece is the whole tensor, else
    ``"{hf_name}@{dim}:{start}:{stop}"``). tensor: a view of the Megatron parameter (any shape/strides) whose
    row-major flattening is the slice. dim/start/stop: the slice of the HF tensor. slice_shape: HF shape of the
    slice. full_shape: HF shape of the whole tensor.
    """

    key: str
    hf_name: str
    tensor: torch.Tensor
    dim: int
    start: int
    stop: int
    slice_shape: tuple[int, ...]
    full_shape: tuple[int, ...]

    def spec(self) -> dict:
        """JSON-able description (everything but the tensor)."""
        return {"key": self.key, "hf_name": self.hf_name, "dim": self.dim, "start": self.start, "stop": self.stop,
                "slice_shape": list(self.slice_shape), "full_shape": list(self.full_shape)}


def piece_key(hf_name: str, dim: int, start: int, stop: int, full: int) -> str:
    return hf_name if (start == 0 and stop == full) else f"{hf_name}@{dim}:{start}:{stop}"


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF name → shape for every tensor of ``arch`` (``lm_head.weight`` only when untied)."""
    D, F, V, hd = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.head_dim
    out: dict[str, tuple[int, ...]] = {}
    for n in arch.hf_names():
        leaf = n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            out[n] = (V, D)
        elif n == "model.norm.weight" or leaf in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[n] = (D,)
        elif leaf == "q_proj.weight":
            out[n] = (arch.q_dim, D)
        elif leaf in ("k_proj.weight", "v_proj.weight"):
            out[n] = (arch.kv_dim, D)
        elif leaf == "q_proj.bias":
            out[n] = (arch.q_dim,)
        elif leaf in ("k_proj.bias", "v_proj.bias"):
            out[n] = (arch.kv_dim,)
        elif leaf in ("q_norm.weight", "k_norm.weight"):
            out[n] = (hd,)
        elif leaf == "o_proj.weight":
            out[n] = (D, arch.q_dim)
        elif leaf in ("gate_proj.weight", "up_proj.weight"):
            out[n] = (F, D)
        elif leaf == "down_proj.weight":
            out[n] = (D, F)
        else:  # pragma: no cover - hf_names and this table are kept in step
            raise KeyError(n)
    return out


class SafetensorsSource(Mapping):
    """Lazy HF tensors from a directory (``model.safetensors`` or a sharded ``*.index.json``) or one file:
    each rank reads only the tensors it converts."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        p = Path(path)
        self._open = safe_open
        files: dict[str, Path] = {}
        if p.is_dir():
            idx = sorted(p.glob("*.safetensors.index.json"))
            if idx:
                wm = json.loads(idx[0].read_text())["weight_map"]
                files = {k: p / v for k, v in wm.items()}
            else:
                p = p / "model.safetensors"
        if not files:
            with safe_open(str(p), "pt") as f:
                files = {k: p for k in f.keys()}
        self._files = files
        self._handles: dict[Path, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self._files[name]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(str(f), "pt")
        return h.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch, *, tp: int, tp_rank: int, pp: int,
                   pp_rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The local Megatron state dict (unwrapped ``GPTModel`` names, no ``_extra_state``) of one (tp, pp) rank.

    Args:
        hf: HF name → tensor (a dict, or a lazy :class:`SafetensorsSource`); only the names this rank needs
            are read. ``lm_head.weight`` is not read when embeddings are tied.
        dtype: dtype of the returned tensors.

    Raises:
        KeyError: a needed HF tensor is missing (named). ValueError: a tensor has the wrong shape (named).
    """
    check_layout(arch, tp, pp)
    shapes = hf_shapes(arch)

    def get(name: str) -> torch.Tensor:
        try:
            t = hf[name]
        except KeyError:
            raise KeyError(f"HF tensor {name!r} is missing") from None
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"HF tensor {name!r} has shape {list(t.shape)}, expected {list(shapes[name])}")
        return t.to(dtype)

    out: dict[str, torch.Tensor] = {}
    D, hd = arch.hidden_size, arch.head_dim
    ng, qpg = arch.num_key_value_heads, arch.num_attention_heads // arch.num_key_value_heads
    ngl = ng // tp
    g0 = tp_rank * ngl
    Fl = arch.intermediate_size // tp
    Vp = padded_vocab(arch, tp)
    Vl = Vp // tp

    def vocab_rows(t: torch.Tensor) -> torch.Tensor:
        a, b = tp_rank * Vl, (tp_rank + 1) * Vl
        w = torch.zeros(Vl, D, dtype=dtype)
        n = max(0, min(b, arch.vocab_size) - a)
        if n:
            w[:n] = t[a : a + n]
        return w

    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab_rows(get("model.embed_tokens.weight"))
    for j, i in enumerate(stage_layers(arch, pp, pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        out[m + "input_layernorm.weight"] = get(h + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = get(h + "post_attention_layernorm.weight")
        q = get(h + "self_attn.q_proj.weight").view(ng, qpg * hd, D)[g0 : g0 + ngl]
        k = get(h + "self_attn.k_proj.weight").view(ng, hd, D)[g0 : g0 + ngl]
        v = get(h + "self_attn.v_proj.weight").view(ng, hd, D)[g0 : g0 + ngl]
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, D).contiguous()
        if arch.qkv_bias:
            qb = get(h + "self_attn.q_proj.bias").view(ng, qpg * hd)[g0 : g0 + ngl]
            kb = get(h + "self_attn.k_proj.bias").view(ng, hd)[g0 : g0 + ngl]
            vb = get(h + "self_attn.v_proj.bias").view(ng, hd)[g0 : g0 + ngl]
            out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1).contiguous()
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = get(h + "self_attn.q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = get(h + "self_attn.k_norm.weight")
        ql = arch.q_dim // tp
        out[m + "self_attention.linear_proj.weight"] = \
            get(h + "self_attn.o_proj.weight")[:, tp_rank * ql : (tp_rank + 1) * ql].contiguous()
        gate = get(h + "mlp.gate_proj.weight")[tp_rank * Fl : (tp_rank + 1) * Fl]
        up = get(h + "mlp.up_proj.weight")[tp_rank * Fl : (tp_rank + 1) * Fl]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0).contiguous()
        out[m + "mlp.linear_fc2.weight"] = \
            get(h + "mlp.down_proj.weight")[:, tp_rank * Fl : (tp_rank + 1) * Fl].contiguous()
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = vocab_rows(get("lm_head.weight"))
        elif pp > 1:
            out["output_layer.weight"] = vocab_rows(get("model.embed_tokens.weight"))
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_pieces(local: Mapping[str, torch.Tensor], arch: ModelArch, *, tp: int, tp_rank: int, pp: int,
                       pp_rank: int) -> list[Piece]:
    """This rank's share of the HF weights as :class:`Piece` views of ``local`` (no copies).

    ``local`` is the unwrapped ``GPTModel`` state dict of this (tp, pp) rank (``_extra_state`` ignored).
    Replicated tensors (norms) come from TP rank 0 only; a tied output layer is never exported (the
    embedding is); padded vocabulary rows are dropped.

    Raises:
        KeyError: an expected Megatron tensor is missing from ``local``.
    """
    shapes = hf_shapes(arch)
    D, hd = arch.hidden_size, arch.head_dim
    ng, qpg = arch.num_key_value_heads, arch.num_attention_heads // arch.num_key_value_heads
    ngl = ng // tp
    g0 = tp_rank * ngl
    Fl = arch.intermediate_size // tp
    Vl = padded_vocab(arch, tp) // tp
    ql = arch.q_dim // tp
    pieces: list[Piece] = []

    def add(hf_name: str, t: torch.Tensor, dim: int, start: int, stop: int) -> None:
        full = shapes[hf_name]
        sl = list(full)
        sl[dim] = stop - start
        if t.numel() != math.prod(sl):  # pragma: no cover - layout bug guard
            raise AssertionError(f"{hf_name}: piece of {t.numel()} elements for slice {sl}")
        pieces.append(Piece(piece_key(hf_name, dim, start, stop, full[dim]), hf_name, t, dim, start, stop,
                            tuple(sl), full))

    def whole(hf_name: str, t: torch.Tensor) -> None:
        if tp_rank == 0:
            add(hf_name, t, 0, 0, shapes[hf_name][0])

    def vocab(hf_name: str, t: torch.Tensor) -> None:
        a = tp_rank * Vl
        n = max(0, min(a + Vl, arch.vocab_size) - a)
        if n:
            add(hf_name, t[:n], 0, a, a + n)

    def need(name: str) -> torch.Tensor:
        try:
            return local[name]
        except KeyError:
            raise KeyError(f"Megatron tensor {name!r} is missing from the local state dict") from None

    if pp_rank == 0:
        vocab("model.embed_tokens.weight", need("embedding.word_embeddings.weight"))
    for j, i in enumerate(stage_layers(arch, pp, pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        whole(h + "input_layernorm.weight", need(m + "input_layernorm.weight"))
        whole(h + "post_attention_layernorm.weight", need(m + "pre_mlp_layernorm.weight"))
        w = need(m + "self_attention.linear_qkv.weight").view(ngl, qpg + 2, hd, D)
        add(h + "self_attn.q_proj.weight", w[:, :qpg], 0, g0 * qpg * hd, (g0 + ngl) * qpg * hd)
        add(h + "self_attn.k_proj.weight", w[:, qpg], 0, g0 * hd, (g0 + ngl) * hd)
        add(h + "self_attn.v_proj.weight", w[:, qpg + 1], 0, g0 * hd, (g0 + ngl) * hd)
        if arch.qkv_bias:
            b = need(m + "self_attention.linear_qkv.bias").view(ngl, qpg + 2, hd)
            add(h + "self_attn.q_proj.bias", b[:, :qpg], 0, g0 * qpg * hd, (g0 + ngl) * qpg * hd)
            add(h + "self_attn.k_proj.bias", b[:, qpg], 0, g0 * hd, (g0 + ngl) * hd)
            add(h + "self_attn.v_proj.bias", b[:, qpg + 1], 0, g0 * hd, (g0 + ngl) * hd)
        if arch.qk_norm:
            whole(h + "self_attn.q_norm.weight", need(m + "self_attention.q_layernorm.weight"))
            whole(h + "self_attn.k_norm.weight", need(m + "self_attention.k_layernorm.weight"))
        add(h + "self_attn.o_proj.weight", need(m + "self_attention.linear_proj.weight"), 1,
            tp_rank * ql, (tp_rank + 1) * ql)
        fc1 = need(m + "mlp.linear_fc1.weight")
        add(h + "mlp.gate_proj.weight", fc1[:Fl], 0, tp_rank * Fl, (tp_rank + 1) * Fl)
        add(h + "mlp.up_proj.weight", fc1[Fl:], 0, tp_rank * Fl, (tp_rank + 1) * Fl)
        add(h + "mlp.down_proj.weight", need(m + "mlp.linear_fc2.weight"), 1, tp_rank * Fl, (tp_rank + 1) * Fl)
    if pp_rank == pp - 1:
        whole("model.norm.weight", need("decoder.final_layernorm.weight"))
        if not arch.tie_word_embeddings:
            vocab("lm_head.weight", need("output_layer.weight"))
    return pieces


