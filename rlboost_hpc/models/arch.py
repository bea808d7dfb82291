"""The one reader of Hugging Face model configs: ``config.json`` → :class:`ModelArch`.

Every component that needs the shape of the policy (the torch model and engine, the torch and Megatron trainer
backends, the SGLang engine, the weight checks of every loader) builds it from a :class:`ModelArch` made here.
``config.json`` is parsed by ``transformers`` (the config class of its ``model_type``, exactly what
``AutoConfig.from_pretrained`` does), so defaults and the RoPE parameters are HF's own.

Supported families (dense decoders): ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` — GQA,
RMSNorm, SwiGLU, RoPE with HF's rotate-half layout, tied or untied embeddings, Qwen2's q/k/v biases, Qwen3's
per-head q/k RMSNorm and explicit ``head_dim`` (``heads × head_dim`` may differ from ``hidden_size``), RoPE
theta, and RoPE scaling of type ``llama3`` (Llama 3.1+).

Invariants:
- :func:`arch_from_hf` accepts exactly what the project's models reproduce and raises
  :class:`UnsupportedModel` (a :class:`ModelFormatError`) naming every offending key otherwise: another family
  (the message lists the supported ones), another RoPE type, sliding windows, MLP or o_proj biases,
  non-silu activations, mixture of experts.
- A :class:`ModelArch` is immutable and always valid (positive sizes, heads a multiple of KV heads, even
  ``head_dim``); :meth:`ModelArch.expected_shapes` lists exactly the HF tensor names and shapes of the model.
- ``eos_token_ids`` is a tuple (``config.json`` may give one id or a list).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping
from rlboost_hpc.errors import BadInput
from rlboost_hpc.paths import unreadable

__all__ = ["ModelArch", "ModelFormatError", "UnsupportedModel", "RopeScaling", "arch_from_hf", "read_config_json",
           "validate_state_dict", "SUPPORTED_ARCHITECTURES"]


class ModelFormatError(BadInput, ValueError):
    """A model file or config is missing, truncated or inconsistent; the message names the file and the problem."""


class UnsupportedModel(ModelFormatError):
    """The config asks for an architecture or feature the project does not reproduce; the message names it."""


#: HF ``architectures`` entry → family, and ``model_type`` → family.
SUPPORTED_ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                                           "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_OF_FAMILY = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of type ``llama3`` (HF ``rope_parameters``): inverse frequencies with wavelength above
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
    ``… / high_freq_factor`` kept, those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelArch:
    """Dimensions and features of one supported dense decoder (HF field names).

    Raises:
        ModelFormatError: a size is non-positive or the head layout is inconsistent (construction).
    """

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name}={v!r} must be a positive integer")
        if not problems:
            if self.head_dim % 2:
                problems.append(f"head_dim={self.head_dim} must be even for RoPE")
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                f"num_key_value_heads={self.num_key_value_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                problems.append(f"{name}={v!r} must be a positive number")
        if self.family not in _ARCH_OF_FAMILY:
            problems.append(f"family={self.family!r} (supported: {', '.join(_ARCH_OF_FAMILY)})")
        if problems:
            raise ModelFormatError("invalid model config: " + "; ".join(problems))

    @property
    def q_dim(self) -> int:
        """Output rows of q_proj: ``num_attention_heads × head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Output rows of k_proj / v_proj: ``num_key_value_heads × head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @property
    def architecture(self) -> str:
        """The HF class name (``"Qwen3ForCausalLM"``)."""
        return _ARCH_OF_FAMILY[self.family]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name → shape of the full model (``lm_head.weight`` included even when tied)."""
        D, F, V, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (self.q_dim, D)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_dim, D)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_dim, D)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_dim,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_dim,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_dim,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "self_attn.o_proj.weight"] = (D, self.q_dim)
            shapes[p + "mlp.gate_proj.weight"] = (F, D)
            shapes[p + "mlp.up_proj.weight"] = (F, D)
            shapes[p + "mlp.down_proj.weight"] = (D, F)
            shapes[p + "input_layernorm.weight"] = (D,)
            shapes[p + "post_attention_layernorm.weight"] = (D,)
        shapes["model.norm.weight"] = (D,)
        shapes["lm_head.weight"] = (V, D)
        return shapes

    def hf_names(self) -> list[str]:
        """Every tensor name a checkpoint of this model holds (``lm_head.weight`` only when untied)."""
        return [k for k in self.expected_shapes() if k != "lm_head.weight" or not self.tie_word_embeddings]

    def num_params(self) -> int:
        """Parameters of the model (a tied head counted once)."""
        total = 0
        for name in self.hf_names():
            n = 1
            for s in self.expected_shapes()[name]:
                n *= s
            total += n
        return total

    def to_json(self) -> dict[str, Any]:
        """This architecture as plain JSON data (what the trainer sends rollout instances, so they need not parse
        ``config.json`` again — nor import ``transformers``, ≈ 2 s per process start); :meth:`from_json` inverts it."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ModelArch":
        """Inverse of :meth:`to_json`, validated like every construction.

        Raises:
            ModelFormatError: a missing, unknown or invalid field (named).
        """
        try:
            rs = d.get("rope_scaling")
            return cls(**{**d, "rope_scaling": RopeScaling(**rs) if rs else None,
                          "eos_token_ids": tuple(int(e) for e in d.get("eos_token_ids", ()))})
        except TypeError as e:
            raise ModelFormatError(f"model architecture record: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` payload that ``transformers`` reads back as this architecture (fp32)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.family, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": float(self.rms_norm_eps), "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "torch_dtype": "float32",
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling is not None:
            rope = {**asdict(self.rope_scaling), "rope_theta": float(self.rope_theta)}
        d["rope_parameters"] = rope
        d["rope_theta"] = float(self.rope_theta)
        if self.family == "llama":
            d.update(attention_bias=False, mlp_bias=False)
        if self.family == "qwen3":
            d.update(attention_bias=False)
        if self.family in ("qwen2", "qwen3"):
            d.update(use_sliding_window=False)
        return d


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` (or a directory holding it) as a dict.

    Raises:
        ModelFormatError: missing, not JSON, or not a JSON object (the file is named).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    why = unreadable(p)
    if why is not None:  # "not found" only when it is not there
        raise ModelFormatError(f"{p}: config.json {why}")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _family(d: Mapping[str, Any], source: str) -> str:
    archs = d.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[a]
    mt = d.get("model_type")
    if not archs and mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt]
    raise UnsupportedModel(f"{source}: unsupported architecture (architectures={list(archs)}, model_type={mt!r}); "
                           f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def arch_from_hf(source: Mapping[str, Any] | str | os.PathLike[str], *, name: str | None = None) -> ModelArch:
    """Parse an HF config (a dict, a ``config.json`` path, or a model directory) with ``transformers``.

    Args:
        source: the config.
        name: how errors name the config (default: its path, or ``"config.json"`` for a dict).

    Raises:
        ModelFormatError: unreadable ``config.json``, missing keys, invalid values.
        UnsupportedModel: another family or a feature outside the supported set (every one named).
    """
    if isinstance(source, Mapping):
        d, where = dict(source), name or "config.json"
    else:
        p = Path(source)
        d, where = read_config_json(p), name or str(p / "config.json" if p.is_dir() else p)
    family = _family(d, where)
    from transformers import CONFIG_MAPPING

    try:
        cfg = CONFIG_MAPPING[family].from_dict(dict(d, model_type=family))
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/TypeError/KeyError for bad configs
        raise ModelFormatError(f"{where}: transformers cannot read it as a {family} config: {e}") from None
    problems = []
    if getattr(cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg.hidden_act!r} (only silu)")
    if getattr(cfg, "mlp_bias", False):
        problems.append("mlp_bias=true")
    if getattr(cfg, "use_sliding_window", False):
        problems.append("use_sliding_window=true")
    if d.get("num_experts") or d.get("num_local_experts"):
        problems.append("mixture of experts")
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    if attention_bias:  # Llama/Qwen3 attention_bias puts a bias on o_proj too
        problems.append("attention_bias=true (q/k/v/o biases)")
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = RopeScaling(factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
                                  high_freq_factor=float(rp["high_freq_factor"]),
                                  original_max_position_embeddings=int(rp["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"rope_parameters of type llama3 lacks or has a bad {e}")
    elif rope_type != "default":
        problems.append(f"rope_parameters.rope_type={rope_type!r} (supported: default, llama3)")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={rp['partial_rotary_factor']}")
    if problems:
        raise UnsupportedModel(f"{where}: unsupported {family} variant: " + "; ".join(problems))
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    try:
        return ModelArch(
            family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads or heads,
            head_dim=int(head_dim), max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling, tie_word_embeddings=bool(cfg.tie_word_embeddings),
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
            bos_token_id=None if cfg.bos_token_id is None else int(cfg.bos_token_id), eos_token_ids=eos_ids)
    except ModelFormatError as e:
        raise ModelFormatError(f"{where}: {e}") from None


def validate_state_dict(arch: ModelArch, state_dict: Mapping[str, Any], source: str = "state dict",
                        allow_missing_tied_head: bool = True) -> None:
    """Check that ``state_dict`` has exactly the HF tensor names and shapes of ``arch``.

    ``lm_head.weight`` may be absent when ``arch.tie_word_embeddings`` and ``allow_missing_tied_head``
    (HF's ``save_pretrained`` drops tied copies). Values are not inspected, only names, shapes and that each
    value is a floating-point tensor.

    Raises:
        ModelFormatError: naming every missing and unexpected tensor, or the first tensors with a wrong shape
            or a non-float dtype (expected vs actual).
    """
    expected = arch.expected_shapes()
    optional = {"lm_head.weight"} if arch.tie_word_embeddings and allow_missing_tied_head else set()
    missing = sorted(k for k in expected if k not in state_dict and k not in optional)
    unexpected = sorted(k for k in state_dict if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {missing[:8]}" + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected tensor(s) {unexpected[:8]}"
                         + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
        raise ModelFormatError(f"{source}: " + "; ".join(parts))
    bad = []
    for name, t in state_dict.items():
        shape = tuple(getattr(t, "shape", ()))
        if shape != expected[name]:
            bad.append(f"{name} has shape {list(shape)}, expected {list(expected[name])}")
        elif not getattr(getattr(t, "dtype", None), "is_floating_point", False):
            bad.append(f"{name} has dtype {getattr(t, 'dtype', type(t).__name__)}, expected a float dtype")
    if bad:
        raise ModelFormatError(f"{source}: " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
