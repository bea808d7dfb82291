"""CPU/GPU plain-PyTorch trainer backend (the reference implementation of ``TrainerBackend``).

Invariants: the parameters and AdamW state are fp32 on ``device``; with a lower ``dtype`` (bf16, the GPU
default) forward passes run under ``torch.autocast`` in that dtype (mixed precision: fp32 master weights),
while logprobs, losses and gradients' accumulation stay fp32. ``old_logp`` is recomputed by the trainer, not
taken from the rollout engine: with one optimizer step per RL step θ_old = θ at every micro-batch, so the recomputed old
logprob is exactly ``logp.detach()`` of the same forward pass (no second pass needed). The engine's behaviour
logprobs measure the engine–trainer mismatch every step (``logprob_diff`` and the ``mismatch_*`` metrics) and, with
``GRPOOptions.behaviour_correction``, weight the loss (TIS/MIS: :func:`~rlboost_hpc.trainer.algorithms.grpo.
behaviour_weights`). The parameters live in one flat fp32 tensor laid out like the
wire buffer of ``wire_dtype`` (:class:`~rlboost_hpc.models.layout.FlatState`): exporting is a view, publishing
one cast-copy whatever the number of tensors; a tied head is its embedding, so it is not exported twice.

With ``lora`` (``trainer.lora``): PEFT's LoRA layers wrap the targeted linears (:mod:`rlboost_hpc.trainer.lora`), the
base is frozen, AdamW steps the adapter only, :meth:`TorchBackend.export_weights` is the adapter (the version), the
reference policy is the base with the adapter disabled (no second copy), and a checkpoint holds the adapter and its
optimizer state only (a checkpoint of the other kind is refused, naming its file).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, finish_stats, grpo_loss, stats_to_floats
from rlboost_hpc.trainer.backends.base import (Sample, StepAccumulator, TrainerBackend, behaviour_tensor,
                                              staleness_tensor, truncated_tensor)
from rlboost_hpc.trainer.checkpoint import CheckpointError
from rlboost_hpc.trainer.lora import LoraSettings, PeftAdapter
from rlboost_hpc.models.layout import FlatState


def pack(batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Right-pad prompt+response sequences.

    Returns: input_ids [B, L] long, attention_mask [B, L] bool, response mask over *predicted positions*
    [B, L-1] bool (True where position j's logits predict a trained response token j+1: every response token, or
    those of ``Sample.loss_mask`` when given), and the prompt lengths.
    """
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
    L = max(lens)
    ids = torch.zeros((len(batch), L), dtype=torch.long)
    att = torch.zeros((len(batch), L), dtype=torch.bool)
    rmask = torch.zeros((len(batch), L - 1), dtype=torch.bool)
    plens = []
    for i, s in enumerate(batch):
        seq = list(s.prompt_ids) + list(s.response_ids)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        att[i, : len(seq)] = True
        P = len(s.prompt_ids)
        rmask[i, P - 1 : P - 1 + len(s.response_ids)] = True if s.loss_mask is None else torch.tensor(
            s.loss_mask, dtype=torch.bool)
        plens.append(P)
    return ids, att, rmask, plens


class TorchBackend(TrainerBackend):
    """AdamW on an fp32 :class:`LlamaModel` on ``device``; logprobs at ``temperature`` (matching the engine).

    Args:
        config / state_dict: the policy (HF names, any float dtype).
        device: where the model trains (``cpu`` or a CUDA device).
        dtype: compute dtype of forward passes (``torch.float32``: none; ``torch.bfloat16``: autocast).
        keep_reference: keep a frozen copy of the initial policy (the KL penalty's and the quality gate's
            reference), in ``dtype`` on ``device``.
        wire_dtype: the dtype versions are published in (None: fp32), which the flat parameter layout follows
            (another publish dtype still works, tensor by tensor).
        objective: the GRPO objective's options (None: ``GRPOOptions(clip_eps=clip_eps, kl_coef=kl_coef)``; when
            given, ``clip_eps`` and ``kl_coef`` are ignored).
        lora: train a LoRA adapter with PEFT instead of every weight (module docstring); ``keep_reference`` is then
            moot: the reference is the base with the adapter off.
    """

    def __init__(self, config: ModelArch, state_dict: Mapping[str, torch.Tensor], *, lr: float,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, clip_eps: float = 0.2,
                 kl_coef: float = 0.0, temperature: float = 1.0, keep_reference: bool = True,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 wire_dtype: torch.dtype | None = torch.bfloat16, objective: GRPOOptions | None = None,
                 lora: LoraSettings | None = None) -> None:
        objective = objective or GRPOOptions(clip_eps=clip_eps, kl_coef=kl_coef)
        kl_coef = objective.kl_coef
        self.device = torch.device(device)
        self.amp_dtype = None if dtype == torch.float32 else dtype
        self.model = LlamaModel.from_state_dict(config, dict(state_dict), device=self.device)
        self.model.train()
        self.ref = None
        self.lora: PeftAdapter | None = None
        if lora is not None:
            self.lora = PeftAdapter(self.model, config, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                    targets=lora.targets, init=lora.init, wire_dtype=wire_dtype)
            self.flat = self.lora.flat  # the version: the adapter
            self.trainable = list(self.lora.params.values())
        else:
            self.flat = FlatState.of_parameters(self.model, wire_dtype)  # a tied head once, as the embedding
            self.trainable = list(self.model.parameters())
            if keep_reference or kl_coef > 0:
                self.ref = LlamaModel.from_state_dict(config, dict(state_dict), device=self.device, dtype=dtype)
                self.ref.eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.trainable, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))
        self.grad_clip, self.objective = grad_clip, objective
        self.step = StepAccumulator(objective)
        self.temperature = temperature if temperature > 0 else 1.0
        self.lr = lr

    def _logp(self, model: LlamaModel, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """``[B, L-1]`` fp32 logprobs of tokens 1.. of ``ids`` (``[B, L]``) under ``model``."""
        ids, att = ids.to(self.device), att.to(self.device)
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.bfloat16, enabled=self.amp_dtype is not None):
            logits = model(ids, attention_mask=att)
        logits = logits[:, :-1].float() / self.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def _ref_logp(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Logprobs under the reference policy: the frozen copy, or — LoRA — the base with the adapter off.

        Raises:
            ValueError: no reference was kept (``keep_reference=False`` and no KL term)."""
        if self.lora is not None:
            with self.lora.disabled():
                return self._logp(self.model, ids, att)
        if self.ref is None:
            raise ValueError("no reference model kept (keep_reference=False)")
        return self._logp(self.ref, ids, att)

    def accumulate(self, batch: list[Sample], responses_in_step: int) -> dict[str, float]:
        ids, att, rmask, _ = pack(batch)
        rmask = rmask.to(self.device)
        logp = self._logp(self.model, ids, att)
        old = logp.detach()
        ref = None
        if self.objective.kl_coef > 0:
            ref = self._ref_logp(ids, att)
        adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32, device=self.device)
        loss_sum, st = grpo_loss(logp, old, adv, rmask, self.objective, ref_logp=ref,
                                 behaviour_logp=behaviour_tensor(batch, tuple(old.shape), self.device),
                                 truncated=truncated_tensor(batch, self.device),
                                 staleness=staleness_tensor(batch, tuple(old.shape), self.device))
        (loss_sum / responses_in_step).backward()
        stats = stats_to_floats(st)
        self.step.add_batch(batch, responses_in_step)
        self.step.add_stats(stats)
        return {"loss": stats["loss_sum"] / responses_in_step, "tokens": int(stats["tokens"]), **finish_stats(stats)}

    def optimizer_step(self) -> dict[str, float]:
        scale = self.step.gradient_scale()
        if scale != 1.0:  # token_mean: the step's token count is known now (see StepAccumulator)
            for p in self.trainable:
                if p.grad is not None:
                    p.grad.mul_(scale)
        gn = torch.nn.utils.clip_grad_norm_(self.trainable, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(gn), "lr": self.lr, **self.step.finish()}

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """The parameters as a :class:`FlatState` (fp32 views of the live weights; no copy). A tied
        ``lm_head.weight`` is absent: it is ``model.embed_tokens.weight``. LoRA: the adapter's tensors only."""
        return self.flat

    def save_checkpoint(self, path: str | os.PathLike, extra_state: Mapping | None = None) -> None:
        """Model (fp32), AdamW state and torch's RNG into ``path/torch_backend.pt`` (directory created). The
        reference policy is not saved: it is the initial weights the backend is constructed with."""
        _write_checkpoint(self._checkpoint_state(extra_state), path)

    def checkpoint_writer(self, path: str | os.PathLike) -> Callable[[], None]:
        """Copy model, AdamW state and RNG now (host memory: the model's fp32 bytes plus the optimizer's two
        moments); the returned function writes the copy as :meth:`save_checkpoint` would, in any thread."""
        def copy(x):
            if isinstance(x, torch.Tensor):
                return x.detach().to("cpu", copy=True)
            if isinstance(x, dict):
                return {k: copy(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(copy(v) for v in x)
            return x

        state = copy(self._checkpoint_state())
        return lambda: _write_checkpoint(state, path)

    def _checkpoint_state(self, extra_state: Mapping | None = None) -> dict:
        weights = {"adapter": self.lora.state()} if self.lora is not None else {"model": self.model.state_dict()}
        return {**weights, "opt": self.opt.state_dict(), "rng": torch.get_rng_state(), "extra": dict(extra_state or {})}

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore :meth:`save_checkpoint`; returns its ``extra_state``.

        Raises:
            CheckpointError: a checkpoint of a full run into a LoRA run or the reverse (naming the file)."""
        f = Path(path) / "torch_backend.pt"
        st = torch.load(f, map_location=self.device, weights_only=True)
        if ("adapter" in st) != (self.lora is not None):
            kind = "a LoRA adapter" if "adapter" in st else "every weight"
            raise CheckpointError(f"{f}: a checkpoint of a run that trained {kind}; this run has trainer.lora.rank = "
                                  f"{self.lora.rank if self.lora else 0}: use a new --out or trainer.resume=never")
        if self.lora is not None:
            self.lora.load(st["adapter"])
        else:
            self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        torch.set_rng_state(st["rng"].cpu())
        return st["extra"]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        amp = self.amp_dtype
        with torch.autocast(self.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            return self.model(ids).float().cpu()

    @torch.no_grad()
    def token_logprobs(self, batch: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        ids, att, rmask, plens = pack(batch)
        with _eval_mode(self.model):  # no LoRA dropout outside training passes
            logp = self._ref_logp(ids, att) if reference else self._logp(self.model, ids, att)
        return [logp[i, p - 1 : p - 1 + len(s.response_ids)].cpu() for i, (s, p) in enumerate(zip(batch, plens))]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block (train mode again after it)."""
    model.eval()
    try:
        yield
    finally:
        model.train()


def _write_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """The one format of a torch-backend checkpoint: ``state`` into ``path/torch_backend.pt`` (directory created)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    torch.save(state, Path(path) / "torch_backend.pt")
