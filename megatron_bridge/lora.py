"""LoRA on Megatron-core's tensor-parallel linears, with TP-sharded A and B: ``trainer.lora`` on the Megatron backend.

The adapter of HF module ``m`` of layer ``i`` is PEFT's (``W·x + (alpha/r)·B·A·x``, names and shapes of
:func:`rlboost_hpc.models.lora.adapter_shapes`), placed on Megatron's fused layers of the local layer spec:

=====================  ======================  ==========================================  =========================
HF module               Megatron layer          A (``[r, in]``)                              B (``[out, r]``)
=====================  ======================  ==========================================  =========================
q/k/v_proj              ``linear_qkv`` (column)  replicated                                   rows of this rank's query
                                                                                             groups (sharded, dim 0)
gate/up_proj            ``linear_fc1`` (column)  replicated                                   rows ``r·F/tp…`` (dim 0)
o_proj, down_proj       ``linear_proj`` /        columns of this rank's input slice          replicated
                        ``linear_fc2`` (row)     (sharded, dim 1)
=====================  ======================  ==========================================  =========================

A forward hook adds the update to each layer's output:
- column-parallel: ``z = A·x`` on the full input (every rank the same), passed through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of its gradient), then this rank's rows
  ``B_local·z``, laid out as the layer's output (q/k/v interleaved per query group, ``[gate; up]``) — so A's gradient
  is the whole model's on every rank and B's is its own;
- row-parallel: ``z = reduce_from_tensor_model_parallel_region(A_local·x_local)`` (all-reduce forward: the full
  ``A·x``, identity backward), then ``B·z`` added after the layer's own reduction — so B's gradient is whole on every
  rank and A_local's its own.

Invariants:
- Equal to PEFT's LoRA on the HF model for every TP × PP layout (tested against the torch backend's logprobs); the
  base weights are frozen and never change.
- Megatron's gradient-norm clipping counts every element once: sharded tensors carry Megatron's tensor-parallel
  attributes, replicated ones are duplicates on TP ranks > 0.
- Disabled (:meth:`MegatronLora.disabled`), the model is the base: the reference policy, no second copy.
- :meth:`MegatronLora.pieces` are zero-copy views in the bridge's :class:`~megatron_bridge.bridge.Piece` form (the
  adapter is the published version, gathered or served per holder); :meth:`MegatronLora.sharded_state_dict` gives
  ``dist_checkpointing`` the TP-aware adapter (global layer indices, so any PP split names it alike).

Not supported (refused by the backend, exit 2 naming the key): ``trainer.lora.dropout > 0`` with TP > 1 (the
replicated input's dropout masks would have to agree across TP ranks) — dropout at TP = 1 works.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from megatron_bridge.arch import ModelArch, stage_layers
from megatron_bridge.bridge import Piece, piece_key
from rlboost_hpc.models.lora import adapter_shapes, module_path

__all__ = ["MegatronLora"]

_COLUMN = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "gate_proj": "linear_fc1",
           "up_proj": "linear_fc1"}
_ROW = {"o_proj": "linear_proj", "down_proj": "linear_fc2"}
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


class MegatronLora(torch.nn.Module):
    """This (tp, pp) rank's share of the adapter, hooked into the ``GPTModel`` stage ``gpt`` (module docstring).

    Args:
        gpt: the unwrapped ``GPTModel`` of this pipeline stage (its parameters are frozen here).
        arch / rank / alpha / dropout / targets: the adapter. init: the whole adapter (HF names, fp32), sliced here.
        tp / tp_rank / pp / pp_rank: this rank's position. dtype: the parameters' dtype (the model's).
    """

    def __init__(self, gpt: torch.nn.Module, arch: ModelArch, *, rank: int, alpha: float, dropout: float,
                 targets: Sequence[str], init: Mapping[str, torch.Tensor], tp: int, tp_rank: int, pp: int,
                 pp_rank: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.arch, self.rank, self.scaling, self.dropout = arch, rank, float(alpha) / rank, float(dropout)
        self.targets, self.tp, self.tp_rank = tuple(targets), tp, tp_rank
        self.enabled = True
        self.params = torch.nn.ParameterDict()
        self._specs: dict[str, tuple[str, int, int, int, tuple, tuple]] = {}  # key → (hf_name, dim, start, stop, ...)
        full = adapter_shapes(arch, targets, rank)
        dev = next(gpt.parameters()).device
        gpt.requires_grad_(False)
        self._layers = list(stage_layers(arch, pp, pp_rank))
        for i in self._layers:
            for t in self.targets:
                for ab in ("A", "B"):
                    hf = f"model.layers.{i}.{module_path(t)}.lora_{ab}.weight"
                    dim, start, stop = self._slice(t, ab, full[hf])
                    sl = [slice(None), slice(None)]
                    sl[dim] = slice(start, stop)
                    p = torch.nn.Parameter(init[hf][tuple(sl)].to(device=dev, dtype=dtype).contiguous())
                    if stop - start != full[hf][dim]:
                        set_tensor_model_parallel_attributes(p, True, dim, 1)
                    key = f"l{i}_{t}_{ab}"
                    self.params[key] = p
                    self._specs[key] = (hf, dim, start, stop, tuple(p.shape), full[hf])
        self._handles = []
        for j, i in enumerate(self._layers):
            layer = gpt.decoder.layers[j]
            for meg in sorted({_COLUMN.get(t) or _ROW[t] for t in self.targets}):
                mod = getattr(getattr(layer, _PARENT[meg]), meg)
                hook = self._column_hook(i, meg) if meg in ("linear_qkv", "linear_fc1") else self._row_hook(i, meg)
                self._handles.append(mod.register_forward_hook(hook))

    # ------------------------------------------------------------------ layout
    def _slice(self, target: str, ab: str, shape: tuple[int, int]) -> tuple[int, int, int]:
        """(dim, start, stop) of this rank's share of an adapter tensor of HF ``shape``."""
        if target in _ROW:  # A [r, in] sharded along in; B replicated
            if ab == "B":
                return 0, 0, shape[0]
            n = shape[1] // self.tp
            return 1, self.tp_rank * n, (self.tp_rank + 1) * n
        if ab == "A":  # column-parallel: A replicated
            return 0, 0, shape[0]
        n = shape[0] // self.tp  # B's rows: this rank's query groups (q/k/v) or F slice (gate/up)
        return 0, self.tp_rank * n, (self.tp_rank + 1) * n

    def _delta(self, i: int, target: str, x: torch.Tensor, column: bool) -> torch.Tensor | None:
        """``scaling·B·A·x`` of ``target`` in layer ``i`` on this rank (None: not adapted)."""
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        if target not in self.targets:
            return None
        A, B = self.params[f"l{i}_{target}_A"], self.params[f"l{i}_{target}_B"]
        if self.dropout and self.training and torch.is_grad_enabled():  # training passes only, as PEFT in train()
            x = F.dropout(x, self.dropout)
        z = F.linear(x, A)
        z = copy_to_tensor_model_parallel_region(z) if column else reduce_from_tensor_model_parallel_region(z)
        return F.linear(z, B) * self.scaling

    def _column_hook(self, i: int, meg: str):
        arch = self.arch
        ngl, qpg, hd = arch.num_key_value_heads // self.tp, arch.num_attention_heads // arch.num_key_value_heads, \
            arch.head_dim
        Fl = arch.intermediate_size // self.tp
        parts_of = ((("q_proj", qpg), ("k_proj", 1), ("v_proj", 1)) if meg == "linear_qkv"
                    else (("gate_proj", Fl), ("up_proj", Fl)))

        def hook(module, args, output):
            if not self.enabled:
                return output
            out, bias = output
            x, lead = args[0], out.shape[:-1]
            if meg == "linear_qkv":  # [ngl, q heads + k + v, hd] per query group
                parts = []
                for t, heads in parts_of:
                    d = self._delta(i, t, x, True)
                    parts.append(out.new_zeros(*lead, ngl, heads, hd) if d is None else d.view(*lead, ngl, heads, hd))
                return out + torch.cat(parts, dim=-2).reshape(out.shape), bias
            parts = [self._delta(i, t, x, True) for t, _ in parts_of]  # [gate_r; up_r]
            return out + torch.cat([out.new_zeros(*lead, n) if d is None else d
                                    for d, (_, n) in zip(parts, parts_of)], dim=-1), bias

        return hook

    def _row_hook(self, i: int, meg: str):
        target = "o_proj" if meg == "linear_proj" else "down_proj"

        def hook(module, args, output):
            if not self.enabled:
                return output
            out, bias = output
            return out + self._delta(i, target, args[0], False), bias

        return hook

    # ------------------------------------------------------------------ the reference, export, checkpoints
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model (every adapter off) for the block."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def pieces(self) -> list[Piece]:
        """This rank's share of the adapter as :class:`Piece` views (replicated tensors from TP rank 0 only)."""
        out = []
        for key, (hf, dim, start, stop, shape, full) in self._specs.items():
            if stop - start == full[dim] and self.tp_rank != 0:
                continue
            out.append(Piece(piece_key(hf, dim, start, stop, full[dim]), hf, self.params[key].data, dim, start, stop,
                             shape, full))
        return out

    def hf_names(self) -> list[str]:
        """Every adapter tensor of the whole model (all stages), HF names."""
        return list(adapter_shapes(self.arch, self.targets, self.rank))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """``dist_checkpointing``'s view of this rank's adapter: TP-sharded tensors along their split dim, the others
        replicated; keys name the global layer, so the checkpoint is the same for any PP split."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for key, (hf, dim, start, stop, _, full) in self._specs.items():
            p = self.params[key]
            gkey = f"lora.{hf}"
            if stop - start != full[dim]:
                out[f"{prefix}params.{key}"] = make_tp_sharded_tensor_for_checkpoint(p, gkey, tp_axis=dim)
            else:
                out[f"{prefix}params.{key}"] = make_sharded_tensor_for_checkpoint(p, gkey)
        return out
