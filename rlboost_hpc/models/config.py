"""The Llama architecture description shared by the loader, the pure-torch model and the engines.

Invariants:
- A :class:`LlamaConfig` is immutable and always valid: every dimension is positive, ``hidden_size`` is a
  multiple of ``num_attention_heads``, ``num_attention_heads`` a multiple of ``num_key_value_heads``, the head
  dimension is even (RoPE rotates pairs), ``rms_norm_eps`` and ``rope_theta`` are positive. Construction with
  anything else raises :class:`ModelFormatError` naming the offending field(s).
- ``to_hf_dict()`` produces a ``config.json`` payload that ``transformers.LlamaConfig`` reads (both the legacy
  top-level ``rope_theta`` and the v5 ``rope_parameters`` are written); ``from_hf_dict(to_hf_dict(c)) == c``.
- No bias terms, SwiGLU MLP ("silu"), RMSNorm, RoPE with HF's rotate-half convention; the config does not
  describe anything else and :meth:`LlamaConfig.from_hf_dict` refuses configs that ask for anything else.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping


class ModelFormatError(ValueError):
    """A model file or config is missing, truncated or inconsistent; the message names the file and the problem."""


# Keys a config.json must carry (rope_theta may instead come from ``rope_parameters``).
REQUIRED_HF_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
)


@dataclass(frozen=True)
class LlamaConfig:
    """Dimensions of a bias-free Llama (GQA, RMSNorm, SwiGLU, RoPE).

    Raises:
        ModelFormatError: a dimension is non-positive or the head layout is inconsistent.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name}={v!r} must be a positive integer")
        if not problems:
            if self.hidden_size % self.num_attention_heads:
                problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                                f"num_attention_heads={self.num_attention_heads}")
            elif (self.hidden_size // self.num_attention_heads) % 2:
                problems.append(f"head_dim={self.hidden_size // self.num_attention_heads} must be even for RoPE")
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                f"num_key_value_heads={self.num_key_value_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                problems.append(f"{name}={v!r} must be a positive number")
        if problems:
            raise ModelFormatError("invalid Llama config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Output rows of k_proj / v_proj: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` payload for ``transformers.LlamaForCausalLM`` (fp32, no biases, silu)."""
        d = asdict(self)
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            head_dim=self.head_dim,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
            torch_dtype="float32",
        )
        d["rms_norm_eps"] = float(self.rms_norm_eps)
        d["rope_theta"] = float(self.rope_theta)
        return d

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "LlamaConfig":
        """Read the fields this project uses from an HF Llama config dict.

        Raises:
            ModelFormatError: a required key is missing (all missing keys are named), or the config asks
                for a feature this model does not implement (biases, non-silu activation, rope scaling,
                a head_dim other than hidden_size/num_attention_heads), or the values are invalid.
        """
        missing = [k for k in REQUIRED_HF_KEYS if k not in d]
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")
        if rope_theta is None and isinstance(rp, Mapping):
            rope_theta = rp.get("rope_theta")
        if rope_theta is None:
            missing.append("rope_theta")
        if missing:
            raise ModelFormatError(f"{source}: missing required key(s) {missing}")
        unsupported = []
        if d.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={d['hidden_act']!r}")
        if d.get("attention_bias", False) or d.get("mlp_bias", False):
            unsupported.append("bias terms")
        if d.get("rope_scaling"):
            unsupported.append(f"rope_scaling={d['rope_scaling']!r}")
        if isinstance(rp, Mapping) and rp.get("rope_type", "default") != "default":
            unsupported.append(f"rope_type={rp['rope_type']!r}")
        hd = d.get("head_dim")
        if hd is not None and d["num_attention_heads"] and hd * d["num_attention_heads"] != d["hidden_size"]:
            unsupported.append(f"head_dim={hd} != hidden_size/num_attention_heads")
        if unsupported:
            raise ModelFormatError(f"{source}: unsupported Llama variant: {', '.join(unsupported)}")
        eos = d.get("eos_token_id", 2)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else 2
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d["num_key_value_heads"],
                max_position_embeddings=d["max_position_embeddings"],
                rms_norm_eps=float(d["rms_norm_eps"]),
                rope_theta=float(rope_theta),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=int(d.get("bos_token_id") if d.get("bos_token_id") is not None else 1),
                eos_token_id=int(eos if eos is not None else 2),
            )
        except ModelFormatError as e:
            raise ModelFormatError(f"{source}: {e}") from None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name → shape for ``LlamaForCausalLM`` with this config (``lm_head.weight`` included)."""
        D, H, V = self.hidden_size, self.intermediate_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (D, D)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_dim, D)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_dim, D)
            shapes[p + "self_attn.o_proj.weight"] = (D, D)
            shapes[p + "mlp.gate_proj.weight"] = (H, D)
            shapes[p + "mlp.up_proj.weight"] = (H, D)
            shapes[p + "mlp.down_proj.weight"] = (D, H)
            shapes[p + "input_layernorm.weight"] = (D,)
            shapes[p + "post_attention_layernorm.weight"] = (D,)
        shapes["model.norm.weight"] = (D,)
        shapes["lm_head.weight"] = (V, D)
        return shapes


def validate_state_dict(config: LlamaConfig, state_dict: Mapping[str, Any], source: str = "state dict",
                        allow_missing_tied_head: bool = True) -> None:
    """Check that ``state_dict`` has exactly the HF tensor names and shapes of ``config``.

    ``lm_head.weight`` may be absent when ``config.tie_word_embeddings`` and ``allow_missing_tied_head``
    (HF's ``save_pretrained`` drops tied copies). Values are not inspected, only names, shapes and that
    each value is a floating-point tensor.

    Raises:
        ModelFormatError: naming every missing and unexpected tensor, or the first tensors with a wrong shape
            or a non-float dtype (expected vs actual).
    """
    expected = config.expected_shapes()
    if config.tie_word_embeddings and allow_missing_tied_head:
        optional = {"lm_head.weight"}
    else:
        optional = set()
    missing = sorted(k for k in expected if k not in state_dict and k not in optional)
    unexpected = sorted(k for k in state_dict if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {missing}")
        if unexpected:
            parts.append(f"unexpected tensor(s) {unexpected}")
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
