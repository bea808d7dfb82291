"""LoRA adapters of the Llama-family decoder: their tensors, their initialisation, PEFT's directory format, the merge,
and the adapter slots an engine serves them from.

An adapter on targets ``T`` (HF module names, :data:`~rlboost_hpc.config.LORA_TARGETS`) of rank ``r`` holds, for every
decoder layer ``i`` and module ``m`` of ``T``, ``model.layers.<i>.<self_attn|mlp>.<m>.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]`` — PEFT's names without the ``base_model.model.`` prefix of its files — and changes the
module's output to ``W·x + (alpha / r)·B·(A·x)`` (PEFT's LoRA without rsLoRA or DoRA; dropout on ``x`` only while
training).

Invariants:
- One naming and one shape rule (:func:`adapter_shapes`), used by both trainer backends, the engines, the export and
  the checks of an adapter directory: an adapter whose names or shapes differ is another model's.
- :func:`init_adapter` is PEFT's default initialisation (A Kaiming-uniform with a = √5, as ``nn.Linear``; B zero),
  drawn from one seed in name order, so the torch and Megatron backends start from the same adapter.
- :func:`merge` is PEFT's ``merge_and_unload`` in fp32: ``W + scaling·B·A``.
- :class:`AdapterSlots`: ``n`` versions held at once, each slot one contiguous tensor laid out as its wire version
  (a load is one copy of the adapter's bytes; the base is never touched); a request names its slot, a batch may mix
  slots.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import torch

from rlboost_hpc.models.arch import ModelArch, ModelFormatError
from rlboost_hpc.models.layout import FlatState, copy_tensors

__all__ = ["AdapterSlots", "PEFT_PREFIX", "adapter_shapes", "canonical_base", "init_adapter", "merge", "module_path", "read_peft_dir",
           "write_peft_dir", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_IDENTITY"]

#: PEFT's prefix of every tensor name in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: This project's note beside PEFT's files: the checksum of the base the adapter was trained on (PEFT ignores it).
BASE_IDENTITY = "rlboost_base.json"

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_path(target: str) -> str:
    """``q_proj`` → ``self_attn.q_proj``, ``gate_proj`` → ``mlp.gate_proj`` (the module inside a decoder layer)."""
    return ("self_attn." if target in _ATTN else "mlp.") + target


def _dims(arch: ModelArch, target: str) -> tuple[int, int]:
    """(in, out) features of ``target``."""
    D, F = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (D, arch.q_dim), "k_proj": (D, arch.kv_dim), "v_proj": (D, arch.kv_dim),
            "o_proj": (arch.q_dim, D), "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}[target]


def adapter_shapes(arch: ModelArch, targets: Sequence[str], rank: int) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's name → shape, layer by layer, targets in the given order (A before B).

    Raises:
        ValueError: ``rank`` < 1 or an unknown target.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    out: dict[str, tuple[int, int]] = {}
    for i in range(arch.num_hidden_layers):
        for t in targets:
            d_in, d_out = _dims(arch, t)
            p = f"model.layers.{i}.{module_path(t)}."
            out[p + "lora_A.weight"] = (rank, d_in)
            out[p + "lora_B.weight"] = (d_out, rank)
    return out


def canonical_base(state_dict: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """The base's tensors as its identity covers them: every name of ``arch.hf_names()`` (a tied ``lm_head.weight``
    is the embedding and left out), in that order.

    Raises:
        KeyError: a tensor of the model is missing.
    """
    return {k: state_dict[k] for k in arch.hf_names()}


def init_adapter(arch: ModelArch, targets: Sequence[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's default initialisation, fp32 on the CPU: every A Kaiming-uniform (a = √5, bound 1/√in), every B zero,
    drawn in name order from a generator seeded ``seed`` — the same adapter for any backend and layout."""
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, shape in adapter_shapes(arch, targets, rank).items():
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=√5) on [r, in]: gain √(2/6), bound gain·√(3/in)
            out[name] = (torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1) * bound
        else:
            out[name] = torch.zeros(shape, dtype=torch.float32)
    return out


def merge(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float
          ) -> dict[str, torch.Tensor]:
    """The base with the adapter merged in (fp32): ``W + scaling·B·A`` for every adapted weight, the rest as it is
    (a new dict; the base is not modified).

    Raises:
        KeyError: an adapter tensor names a weight the base lacks.
    """
    out = dict(base)
    for name in adapter:
        if not name.endswith(".lora_A.weight"):
            continue
        stem = name[: -len(".lora_A.weight")]
        w = stem + ".weight"
        if w not in base:
            raise KeyError(f"adapter tensor {name} has no base weight {w}")
        A, B = adapter[name].float(), adapter[stem + ".lora_B.weight"].float()
        out[w] = base[w].float() + scaling * (B @ A)
    return out


# ---------------------------------------------------------------------------------------------------- PEFT's format
def write_peft_dir(path: str | Path, adapter: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                   dropout: float, targets: Sequence[str], base_model: str, base_checksum: int) -> Path:
    """Write ``adapter`` as PEFT saves one (``adapter_config.json``, ``adapter_model.safetensors`` with PEFT's
    ``base_model.model.`` names), plus :data:`BASE_IDENTITY` (the base's checksum). Tensors keep their dtype. Returns
    the directory (created)."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
           "r": int(rank), "lora_alpha": float(alpha), "lora_dropout": float(dropout),
           "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    (d / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2))
    save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in adapter.items()}, str(d / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (d / BASE_IDENTITY).write_text(json.dumps({"base_checksum": f"{int(base_checksum):016x}",
                                                 "base_model": str(base_model)}))
    return d


def read_peft_dir(path: str | Path, arch: ModelArch, *, rank: int, alpha: float, targets: Sequence[str],
                  base_checksum: int | None = None) -> dict[str, torch.Tensor]:
    """The fp32 adapter of a PEFT directory, checked against the run: its rank, alpha and targets must be the run's,
    its tensors exactly :func:`adapter_shapes` of ``arch`` (an adapter of another base has other names or shapes), and
    — when the directory records one (:data:`BASE_IDENTITY`) and ``base_checksum`` is given — its base checksum the
    run's.

    Raises:
        ModelFormatError: a missing or unreadable file, another adapter type (DoRA, rsLoRA), a rank, alpha or target
            list that differs from the run's, tensors of another model, or another base — naming the file.
    """
    d = Path(path).expanduser()
    cfg_file, w_file = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise ModelFormatError(f"{f}: missing (trainer.lora.adapter_path must be a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{cfg_file}: unreadable: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ModelFormatError(f"{cfg_file}: a {cfg.get('peft_type')} adapter with use_dora={cfg.get('use_dora')}, "
                               f"use_rslora={cfg.get('use_rslora')}; only plain LoRA is supported")
    theirs = cfg.get("target_modules") or []
    theirs = sorted(theirs) if isinstance(theirs, list) else theirs
    if cfg.get("r") != rank or float(cfg.get("lora_alpha", -1)) != float(alpha) or theirs != sorted(targets):
        raise ModelFormatError(f"{cfg_file}: r = {cfg.get('r')}, lora_alpha = {cfg.get('lora_alpha')}, target_modules"
                               f" = {cfg.get('target_modules')}; the run has trainer.lora.rank = {rank}, alpha = "
                               f"{alpha}, target_modules = {list(targets)}")
    _check_base(d / BASE_IDENTITY, base_checksum)
    from safetensors.torch import load_file

    try:
        raw = load_file(str(w_file))
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
        raise ModelFormatError(f"{w_file}: unreadable: {e}") from None
    got = {k.removeprefix(PEFT_PREFIX).replace(".default.", "."): v.float() for k, v in raw.items()}
    want = adapter_shapes(arch, targets, rank)
    bad = sorted(set(got) ^ set(want))[:4] + [f"{k} {list(v.shape)} (expected {list(want[k])})"
                                               for k, v in got.items() if k in want and tuple(v.shape) != want[k]][:4]
    if bad:
        raise ModelFormatError(f"{w_file}: an adapter of another model (or another base): {bad}")
    return {k: got[k] for k in want}


def _check_base(note: Path, base_checksum: int | None) -> None:
    if base_checksum is None or not note.is_file():
        return
    try:
        recorded = int(json.loads(note.read_text())["base_checksum"], 16)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{note}: unreadable: {e}") from None
    if recorded != int(base_checksum):
        raise ModelFormatError(f"{note}: the adapter was trained on a base of checksum {recorded:016x}, this run's "
                               f"base (model.path) is {int(base_checksum):016x}: an adapter for another base")


# ---------------------------------------------------------------------------------------------------- engine slots
class AdapterSlots:
    """``n`` adapter versions an engine serves at once (module docstring), on ``device`` in ``dtype``.

    Args:
        arch / targets / rank / scaling: the adapter (:func:`adapter_shapes`; scaling = alpha / r).
        n: slots (≥ 1). table: the wire layout of one version (a single-dtype
            :class:`~rlboost_hpc.protocol.weight_msgs.TensorTable` of exactly these tensors, as :func:`plan` places
            them), so a pulled version is one copy into its slot.

    Raises:
        ValueError: ``n`` < 1, or a table that is not the adapter's tensors.
    """

    def __init__(self, arch: ModelArch, targets: Sequence[str], rank: int, scaling: float, n: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 wire_dtype: torch.dtype = torch.bfloat16) -> None:
        if n < 1:
            raise ValueError(f"adapter slots must be >= 1, got {n}")
        shapes = adapter_shapes(arch, targets, rank)
        self.n, self.scaling, self.rank = n, float(scaling), rank
        proto = FlatState.pack({k: torch.zeros(s, dtype=dtype, device=device) for k, s in shapes.items()}, wire_dtype)
        self.table = proto.table
        per = proto.flat.numel()
        self.flat = torch.zeros(n, per, dtype=dtype, device=device)
        self.slots = [FlatState(self.table, self.flat[s]) for s in range(n)]
        #: (layer, target) → (A [n, r, in], B [n, out, r]) views across slots
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(arch.num_hidden_layers):
            for t in targets:
                p = f"model.layers.{i}.{module_path(t)}."
                self._stacks[(i, t)] = (self._stacked(p + "lora_A.weight"), self._stacked(p + "lora_B.weight"))

    def _stacked(self, name: str) -> torch.Tensor:
        v = self.slots[0][name]
        return torch.as_strided(self.flat, (self.n, *v.shape), (self.flat.stride(0), *v.stride()),
                                v.storage_offset())

    @property
    def nbytes(self) -> int:
        """Bytes of one slot in the engine's dtype."""
        return self.flat[0].numel() * self.flat.element_size()

    def load(self, slot: int, state: Mapping[str, torch.Tensor]) -> int:
        """Copy one adapter version into ``slot`` (one copy when ``state`` is a FlatState of this layout, else tensor
        by tensor after a name and shape check). Returns the bytes written (the slot's, never the base's).

        Raises:
            ValueError: a missing, unexpected or misshapen tensor (nothing is written).
        """
        dst = self.slots[slot]
        if isinstance(state, FlatState) and dst.copy_from(state):
            return self.nbytes
        names = set(state)
        if names != set(self.table.names):
            missing, extra = sorted(set(self.table.names) - names)[:3], sorted(names - set(self.table.names))[:3]
            raise ValueError(f"adapter tensors do not match the engine's adapter: missing {missing}, unexpected {extra}")
        for k in self.table.names:
            if tuple(state[k].shape) != tuple(dst[k].shape):
                raise ValueError(f"adapter tensor {k} has shape {list(state[k].shape)}, expected {list(dst[k].shape)}")
        copy_tensors([dst[k] for k in self.table.names], [state[k] for k in self.table.names])
        return self.nbytes

    def targets(self, layer: int, target: str) -> bool:
        """Whether ``target`` of ``layer`` is adapted."""
        return (layer, target) in self._stacks

    def delta(self, layer: int, target: str, x: torch.Tensor, sel: "int | torch.Tensor") -> torch.Tensor | None:
        """``scaling·B·A·x`` of ``target`` in ``layer`` (None when it is not adapted). ``sel``: one slot for every row
        of ``x`` (``[..., in]``), or a ``[S]`` long tensor of slots, one per row of a 2-D ``x`` ``[S, in]``."""
        ab = self._stacks.get((layer, target))
        if ab is None:
            return None
        A, B = ab
        if isinstance(sel, int):
            return (x @ A[sel].t()) @ B[sel].t() * self.scaling
        t = torch.bmm(A[sel], x.unsqueeze(-1))  # [S, r, 1]
        return torch.bmm(B[sel], t).squeeze(-1) * self.scaling
