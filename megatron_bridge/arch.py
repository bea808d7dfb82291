"""Hugging Face config → :class:`~rlboost_hpc.models.arch.ModelArch` → Megatron-core ``TransformerConfig`` /
``GPTModel``.

The architecture is read by the project's one config reader (:func:`rlboost_hpc.models.arch.arch_from_hf`:
Llama, Qwen2, Qwen3 — GQA, RMSNorm, SwiGLU, RoPE (HF rotate-half = Megatron non-interleaved), tied or untied
embeddings, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm and explicit ``head_dim``). Built with Megatron's
*local* layer spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``): no TransformerEngine or Apex needed.

Invariants:
- :func:`arch_from_hf` accepts exactly what Megatron reproduces bit-for-bit in fp32 and raises
  :class:`UnsupportedArchitecture` (an ``UnsupportedModel``: exit 2 in the CLI) naming every offending field for
  anything else — on top of the project reader's refusals, RoPE scaling other than Megatron's fixed Llama 3.1 rule
  (``low_freq_factor`` 1, ``high_freq_factor`` 4, ``original_max_position_embeddings`` 8192; any ``factor``).
- The parallel layout is explicit (:func:`check_layout`): ``num_hidden_layers >= pp`` (stage 0 takes the
  remainder of an uneven split, e.g. 5 layers at PP=2 → 3 + 2), ``num_key_value_heads % tp == 0`` (Megatron splits
  query groups across TP ranks), ``intermediate_size % tp == 0``; the vocabulary is padded up to a multiple of
  ``tp`` (:func:`padded_vocab`); padded rows are zero and their logits are masked (never sampled, never exported).
- Pipeline stage ``p`` holds the HF layers :func:`stage_layers` names — the split Megatron uses for ``GPTModel``
  without virtual stages, given ``num_layers_in_first_pipeline_stage`` set by :func:`transformer_config`.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import torch

from rlboost_hpc.models.arch import ModelArch, UnsupportedModel, read_config_json
from rlboost_hpc.models.arch import arch_from_hf as _read_arch

__all__ = ["ModelArch", "UnsupportedArchitecture", "arch_from_hf", "load_hf_config", "stage_layers",
           "transformer_config", "build_gpt_model", "padded_vocab", "check_layout", "arch_dict"]

#: The only RoPE scaling Megatron's ``RotaryEmbedding`` implements (Llama 3.1's; the factor is free).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedArchitecture(UnsupportedModel):
    """The HF config or the parallel layout asks for something the bridge does not reproduce exactly."""


def padded_vocab(arch: ModelArch, tp: int) -> int:
    """Vocabulary rows Megatron holds: ``vocab_size`` rounded up to a multiple of ``tp``."""
    return -(-arch.vocab_size // tp) * tp


def check_layout(arch: ModelArch, tp: int, pp: int) -> None:
    """Raise :class:`UnsupportedArchitecture` if ``arch`` cannot be split ``tp`` × ``pp`` ways."""
    problems = []
    if tp < 1 or pp < 1:
        problems.append(f"tp={tp}, pp={pp} must be >= 1")
    else:
        if arch.num_hidden_layers < pp:
            problems.append(f"num_hidden_layers={arch.num_hidden_layers} is smaller than pp={pp}")
        if arch.num_key_value_heads % tp:
            problems.append(f"num_key_value_heads={arch.num_key_value_heads} is not divisible by tp={tp}")
        if arch.intermediate_size % tp:
            problems.append(f"intermediate_size={arch.intermediate_size} is not divisible by tp={tp}")
    if problems:
        raise UnsupportedArchitecture("parallel layout: " + "; ".join(problems))


def arch_dict(arch: ModelArch) -> dict[str, Any]:
    """``arch`` as plain JSON data (checkpoint and export manifests; lists, not tuples)."""
    return arch.to_json()


def load_hf_config(source: Any) -> dict[str, Any]:
    """An HF config dict from a dict, a ``transformers`` config, a :class:`ModelArch`, a ``config.json`` path or
    a directory holding one."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, ModelArch):
        return source.to_hf_dict()
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):
        return dict(source.to_dict())
    if isinstance(source, (str, os.PathLike)):
        return read_config_json(Path(source))
    raise TypeError(f"cannot read an HF config from {type(source).__name__}")


def arch_from_hf(cfg: Any) -> ModelArch:
    """Parse an HF config (anything :func:`load_hf_config` reads) for Megatron.

    Raises:
        UnsupportedArchitecture: another family, or a feature outside the supported set (all named).
    """
    try:
        arch = _read_arch(load_hf_config(cfg))
    except UnsupportedModel as e:
        raise UnsupportedArchitecture(str(e)) from None
    rs = arch.rope_scaling
    if rs is not None and any(getattr(rs, k) != v for k, v in MEGATRON_LLAMA3_ROPE.items()):
        raise UnsupportedArchitecture(
            f"rope_parameters (llama3: {asdict(rs)}) differ from the only RoPE scaling Megatron implements "
            f"({MEGATRON_LLAMA3_ROPE}, any factor); use trainer.backend = 'torch' for this model")
    return arch


def first_stage_layers(arch: ModelArch, pp: int) -> int:
    """Layers of pipeline stage 0: ``L//pp`` plus the remainder ``L % pp`` (the other stages hold ``L//pp``
    each; Megatron's ``num_layers_in_first_pipeline_stage``)."""
    return arch.num_hidden_layers // pp + arch.num_hidden_layers % pp


def stage_layers(arch: ModelArch, pp: int, pp_rank: int) -> range:
    """Global (HF) layer indices held by pipeline stage ``pp_rank`` (see :func:`first_stage_layers`)."""
    base, first = arch.num_hidden_layers // pp, first_stage_layers(arch, pp)
    if pp_rank == 0:
        return range(0, first)
    return range(first + (pp_rank - 1) * base, first + pp_rank * base)


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, bf16: bool = False,
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
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
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
    if pp > 1 and arch.num_hidden_layers % pp:
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


def build_gpt_model(arch: ModelArch, config, *, pre_process: bool, post_process: bool, tp: int = 1):
    """One Megatron ``GPTModel`` stage of ``arch`` (local layer spec) on the current device."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bridge import compat

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    with compat.scope():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab(arch, tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            rope_scaling=arch.rope_scaling is not None,
            rope_scaling_factor=arch.rope_scaling.factor if arch.rope_scaling is not None else 8.0,
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
