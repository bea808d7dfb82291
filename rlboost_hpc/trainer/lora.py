"""``trainer.lora`` on the torch backend: PEFT's LoRA layers in the policy, the adapter as the published version.

PEFT (``peft.inject_adapter_in_model``, its API for models that are not ``transformers`` classes) wraps every targeted
linear layer of the project's :class:`~rlboost_hpc.models.llama.LlamaModel`; the base weights are frozen and only the
adapter trains. Invariants:
- The adapter's parameters live in one flat fp32 tensor laid out like the published version
  (:class:`~rlboost_hpc.models.layout.FlatState`, names of :func:`~rlboost_hpc.models.lora.adapter_shapes`): a
  publish is one cast-copy of the adapter's bytes, never the base's.
- The reference policy is the base itself: :meth:`PeftAdapter.disabled` switches every LoRA layer off for the
  duration of a no-grad pass (PEFT's ``enable_adapters(False)``) — no second copy of the weights.
- The initial adapter is :func:`~rlboost_hpc.models.lora.init_adapter` of the run's seed (PEFT's initialisation) or a
  PEFT directory's, copied into PEFT's parameters, so every backend starts from the same numbers.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from rlboost_hpc.models.lora import adapter_shapes, canonical_base, init_adapter, merge, read_peft_dir, write_peft_dir
from rlboost_hpc.models.layout import FlatState, copy_tensors

__all__ = ["LoraSettings", "PeftAdapter", "export", "require_peft", "settings_from_config"]


@dataclass(frozen=True)
class LoraSettings:
    """What a trainer backend needs of ``trainer.lora``: rank r, alpha, dropout, the targeted modules (model order)
    and the initial adapter (name → fp32 tensor: :func:`~rlboost_hpc.models.lora.init_adapter` of the run's seed, or
    a PEFT directory's)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    init: Mapping[str, torch.Tensor]


def _wire_name(peft_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.default.weight`` → ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return peft_name.replace(".default.", ".")


class PeftAdapter:
    """PEFT's LoRA in ``model`` (module docstring).

    Args:
        model: the policy (parameters frozen here; LoRA layers injected in place).
        arch: its architecture. rank / alpha / dropout / targets: ``trainer.lora``.
        init: the initial adapter (name → tensor, :func:`~rlboost_hpc.models.lora.adapter_shapes`).
        wire_dtype: the dtype versions are published in (the flat layout follows it).

    Raises:
        ValueError: ``init`` is not this adapter's tensors.
    """

    def __init__(self, model: torch.nn.Module, arch, *, rank: int, alpha: float, dropout: float,
                 targets: Sequence[str], init: Mapping[str, torch.Tensor],
                 wire_dtype: torch.dtype | None = torch.bfloat16) -> None:
        import peft

        model.requires_grad_(False)
        cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                              bias="none", init_lora_weights=True)
        peft.inject_adapter_in_model(cfg, model)
        params = {_wire_name(n): p for n, p in model.named_parameters() if ".lora_" in n}
        want = adapter_shapes(arch, targets, rank)
        if set(params) != set(want):
            raise ValueError(f"PEFT made adapter tensors {sorted(set(params) ^ set(want))[:4]} the project does not "
                             "name")
        if set(init) != set(want):
            raise ValueError(f"initial adapter lacks or adds tensors: {sorted(set(init) ^ set(want))[:4]}")
        for p in params.values():
            p.requires_grad_(True)
        copy_tensors([params[k] for k in want], [init[k] for k in want])
        self.params = {k: params[k] for k in want}
        self.flat = FlatState.pack(self.params, wire_dtype)
        self.flat.adopt(self.params)
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self.rank, self.alpha, self.targets = rank, alpha, tuple(targets)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Every LoRA layer off (the base model) for the block; on again after it, whatever happens."""
        for m in self._layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in self._layers:
                m.enable_adapters(True)

    def state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (fp32 views of the live parameters), in :func:`adapter_shapes` order."""
        return dict(self.params)

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy an adapter (a checkpoint's) into the parameters.

        Raises:
            ValueError: names differ from this adapter's."""
        if set(state) != set(self.params):
            raise ValueError(f"adapter tensors differ: {sorted(set(state) ^ set(self.params))[:4]}")
        copy_tensors(list(self.params.values()), [state[k] for k in self.params])


def require_peft(backend: str) -> None:
    """The torch backend trains LoRA with PEFT.

    Raises:
        ConfigError: ``trainer.lora`` on the torch backend without ``peft`` installed (naming the key and the
            package extra)."""
    from rlboost_hpc.config import ConfigError

    if backend != "torch":
        return
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("trainer.lora.rank > 0 on the torch backend needs PEFT: pip install 'rlboost-hpc[lora]' "
                          "(or peft==0.21.2)") from None


def settings_from_config(cfg, arch, base_checksum: int) -> LoraSettings:
    """``trainer.lora`` of the run config ``cfg`` as :class:`LoraSettings`: the initial adapter is
    ``trainer.lora.adapter_path``'s (checked against ``arch`` and the base's checksum) or PEFT's initialisation drawn
    from ``trainer.seed``.

    Raises:
        ModelFormatError: the adapter directory is missing, of another rank/alpha/targets, or of another base (named).
    """
    lo = cfg.trainer.lora
    targets = lo.targets()
    if lo.adapter_path:
        init = read_peft_dir(lo.adapter_path, arch, rank=lo.rank, alpha=lo.alpha, targets=targets,
                             base_checksum=base_checksum)
    else:
        init = init_adapter(arch, targets, lo.rank, cfg.trainer.seed)
    return LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=targets, init=init)


def export(adapter_dir, model_dir, policy, adapter: Mapping[str, torch.Tensor], spec, *, dropout: float,
           merged: bool) -> dict:
    """Write the trained ``adapter`` (as rollout instances receive it) to ``adapter_dir`` in PEFT's format and, with
    ``merged``, the base with it merged in to ``model_dir`` as a model directory (in the adapter's dtype). Returns
    ``{"adapter": path, "model": path or None}``."""
    from rlboost_hpc.models.hf_dir import save_model_dir

    out = write_peft_dir(adapter_dir, adapter, rank=spec.rank, alpha=spec.alpha, dropout=dropout,
                         targets=spec.targets, base_model=str(policy.path), base_checksum=spec.base_checksum)
    model = None
    if merged:
        dtype = next(iter(adapter.values())).dtype
        full = merge(canonical_base(policy.state_dict, policy.arch), adapter, spec.scaling)
        model = save_model_dir(model_dir, policy, {k: v.to(dtype) for k, v in full.items()})
    return {"adapter": str(out), "model": None if model is None else str(model)}
