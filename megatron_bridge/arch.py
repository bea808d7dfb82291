"""Hugging Face config → architecture description → Megatron-core ``TransformerConfig`` / ``GPTModel``.

Supported families (decoder-only, dense): ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` —
GQA, RMSNorm, SwiGLU, RoPE (HF rotate-half = Megatron non-interleaved), tied or untied embeddings, Qwen2's
q/k/v biases, Qwen3's per-head q/k RMSNorm and explicit ``head_dim``. Built with Megatron's *local* layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``): no TransformerEngine or Apex needed.

Invariants:
- :func:`arch_from_hf` accepts exactly what it can reproduce bit-for-bit in fp32 and raises
  :class:`UnsupportedArchitecture` (naming every offending field) for anything else — rope scaling, sliding
  windows, MLP/output biases, non-silu activations, MoE.
- The parallel layout is explicit: ``num_layers >= pp`` (stage 0 takes the remainder of an uneven split,
  e.g. 5 layers at PP=2 → 3 + 2), ``num_kv_heads % tp == 0`` (Megatron splits
  query groups across TP ranks), ``intermediate_size % tp == 0``; the vocabulary is padded up to a multiple of
  ``tp`` (:attr:`ArchSpec.padded_vocab`); padded rows are zero and their logits are masked (never sampled,
  never exported).
- Pipeline stage ``p`` holds the HF layers :func:`stage_layers` names — the split Megatron uses for ``GPTModel``
  without virtual stages, given ``num_layers_in_first_pipeline_stage`` set by :func:`transformer_config`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["ArchSpec", "UnsupportedArchitecture", "arch_from_hf", "load_hf_config", "stage_layers",
           "transformer_config", "build_gpt_model"]


class UnsupportedArchitecture(ValueError):
    """The HF config asks for something the bridge does not reproduce exactly; the message names it."""


@dataclass(frozen=True)
class ArchSpec:
    """Dimensions and features of one dense decoder (HF field names where they exist)."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows Megatron holds: ``vocab_size`` rounded up to a multiple of ``tp``."""
        return -(-self.vocab_size // tp) * tp

    def num_params(self) -> int:
        """Parameters of the HF model (a tied head counted once)."""
        D, F, V, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        per_layer = D * (self.q_dim + 2 * self.kv_dim) + self.q_dim * D + 3 * D * F + 2 * D
        if self.qkv_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        return V * D * (1 if self.tie_word_embeddings else 2) + L * per_layer + D

    def hf_names(self) -> list[str]:
        """Every HF tensor name of this architecture (``lm_head.weight`` only when untied)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                      p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                      p + "mlp.down_proj.weight"]
            if self.qkv_bias:
                names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
            if self.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_layout(self, tp: int, pp: int) -> None:
        """Raise :class:`UnsupportedArchitecture` if this model cannot be split ``tp`` × ``pp`` ways."""
        problems = []
        if tp < 1 or pp < 1:
            problems.append(f"tp={tp}, pp={pp} must be >= 1")
        else:
            if self.num_layers < pp:
                problems.append(f"num_layers={self.num_layers} is smaller than pp={pp}")
            if self.num_kv_heads % tp:
                problems.append(f"num_key_value_heads={self.num_kv_heads} is not divisible by tp={tp}")
            if self.intermediate_size % tp:
                problems.append(f"intermediate_size={self.intermediate_size} is not divisible by tp={tp}")
        if problems:
            raise UnsupportedArchitecture("parallel layout: " + "; ".join(problems))


_FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def load_hf_config(source: Any) -> dict[str, Any]:
    """An HF config dict from a dict, a ``transformers`` config, a project ``LlamaConfig``, a ``config.json``
    path or a directory holding one."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_hf_dict"):
        return dict(source.to_hf_dict())
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):
        return dict(source.to_dict())
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            p = p / "config.json"
        return json.loads(p.read_text())
    raise TypeError(f"cannot read an HF config from {type(source).__name__}")


def arch_from_hf(cfg: Any) -> ArchSpec:
    """Parse an HF config (anything :func:`load_hf_config` reads).

    Raises:
        UnsupportedArchitecture: unknown family, or a feature outside the supported set (all named).
    """
    d = load_hf_config(cfg)
    archs = d.get("architectures") or []
    family = None
    for a in list(archs) + [d.get("model_type", "")]:
        if a in _FAMILIES:
            family = _FAMILIES[a]
            break
    if family is None:
        raise UnsupportedArchitecture(f"unsupported model family: architectures={archs}, "
                                      f"model_type={d.get('model_type')!r} (supported: Llama, Qwen2, Qwen3)")
    problems = []
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise UnsupportedArchitecture(f"config is missing {missing}")
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={d['hidden_act']!r} (only silu)")
    if d.get("mlp_bias", False):
        problems.append("mlp_bias")
    rs = d.get("rope_scaling")
    rp = d.get("rope_parameters")
    if rs and (not isinstance(rs, Mapping) or rs.get("rope_type", rs.get("type", "default")) != "default"):
        problems.append(f"rope_scaling={rs!r}")
    if isinstance(rp, Mapping) and rp.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={rp.get('rope_type')!r}")
    if d.get("use_sliding_window", False):
        problems.append("use_sliding_window")
    if d.get("num_experts") or d.get("num_local_experts"):
        problems.append("mixture of experts")
    attention_bias = bool(d.get("attention_bias", False))
    if family == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases (no o_proj bias)
        if attention_bias:
            problems.append("attention_bias=True on Qwen2 (o_proj bias) is not supported")
    else:
        qkv_bias = False
        if attention_bias:
            problems.append("attention_bias=True (q/k/v/o biases)")
    if problems:
        raise UnsupportedArchitecture(f"unsupported {family} variant: " + "; ".join(problems))
    theta = d.get("rope_theta")
    if theta is None and isinstance(rp, Mapping):
        theta = rp.get("rope_theta")
    heads = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or d["hidden_size"] // heads  # explicit head_dim → Megatron kv_channels
    return ArchSpec(
        family=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=family == "qwen3",
    )


def first_stage_layers(arch: ArchSpec, pp: int) -> int:
    """Layers of pipeline stage 0: ``L//pp`` plus the remainder ``L % pp`` (the other stages hold ``L//pp``
    each; Megatron's ``num_layers_in_first_pipeline_stage``)."""
    return arch.num_layers // pp + arch.num_layers % pp


def stage_layers(arch: ArchSpec, pp: int, pp_rank: int) -> range:
    """Global (HF) layer indices held by pipeline stage ``pp_rank`` (see :func:`first_stage_layers`)."""
    base, first = arch.num_layers // pp, first_stage_layers(arch, pp)
    if pp_rank == 0:
        return range(0, first)
    return range(first + (pp_rank - 1) * base, first + pp_rank * base)


def transformer_config(arch: ArchSpec, *, tp: int = 1, pp: int = 1, bf16: bool = False,
                       recompute: str | None = None, recompute_num_layers: int = 1,
                       init_weights: bool = True, init_method_std: float = 0.02, **overrides: Any):
    """The Megatron ``TransformerConfig`` reproducing ``arch`` (dropout 0, no fused kernels).

    Args:
        recompute: None, ``"full"`` (uniform, ``recompute_num_layers`` layers per checkpoint) or
            ``"selective"`` (core attention only).
        init_weights: False skips Megatron's random init (weights are loaded right after).
        overrides: any further ``TransformerConfig`` field.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=init_weights,
        init_method_std=init_method_std,
        calculate_per_token_loss=True,
        variable_seq_lengths=pp > 1,  # micro-batches of one RL step have different padded lengths
        moe_token_dispatcher_type="alltoall",  # 0.16.1 rejects variable_seq_lengths with the (unused) default
        batch_p2p_comm=True,
    )
    if pp > 1 and arch.num_layers % pp:
        kw["num_layers_in_first_pipeline_stage"] = first_stage_layers(arch, pp)
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=recompute_num_layers)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute is not None:
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(arch: ArchSpec, config, *, pre_process: bool, post_process: bool, tp: int = 1):
    """One Megatron ``GPTModel`` stage of ``arch`` (local layer spec) on the current device."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bridge import compat

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    with compat.scope():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=arch.padded_vocab(tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
        )
        if not config.perform_initialization:
            _mark_tensor_parallel(model)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
    return model


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set the ``tensor_model_parallel`` attributes Megatron only sets inside its random init.

    With ``perform_initialization=False`` (weights are loaded right after), Megatron 0.16.1 skips
    ``set_tensor_model_parallel_attributes`` for the weights of column/row-parallel linears and vocab-parallel
    embeddings; the optimizer then counts TP-sharded weights as duplicates (gradient-norm clipping sees only
    TP rank 0's shard). Set them as the init path would.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(mod, RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(mod, "weight", None)
        if w is not None and not getattr(w, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(w, True, dim, getattr(mod, "stride", 1))
