"""The emulated trainer backend (``trainer.backend = "emulated"``): a model-sized weight set and a real model's
training time, no model compute — the trainer half of a load test whose rollout instances are emulated too.

It lets the live system (trainer, manager, weight server with delta and relay, instances, local cluster or Slurm) run
at a production shape on machines without the GPUs: versions of ``weight_bytes`` bytes of bf16 travel through the
real publish, delta, pull and relay paths, and a step takes the time the modelled trainer would take.

Invariants (each tested):

- **The weights are real bytes**: ``weight_bytes`` of bf16 (rounded down to whole elements) in tensors of at most
  ``tensor_bytes``, named ``emulated.layers.<i>.weight``, drawn once from N(0, 0.02²) with the run's seed.
- **A step changes a stated share of them, as an RL step does**: :meth:`EmulatedBackend.optimizer_step` moves
  ``delta_density`` of the elements of every tensor (drawn per step from the run's seed, so a resumed run
  changes the same ones) by one unit in the last place (the last mantissa bit flipped) — the change an Adam step at RL learning rates makes to
  1–5 % of bf16 elements. Nothing proportional to the weight size runs in a Python loop (one vectorised pass per
  tensor).
- **LoRA** (``lora``: rank and targets): a version is the adapter of that rank on the profile's model shape (real bf16
  tensors named as PEFT names them, :func:`~rlboost_hpc.models.lora.adapter_shapes`), of which every element moves at
  each step (Adam moves every adapter parameter) in its low 6 mantissa bits — the delta then takes ≈ 42 % of the
  adapter's bytes, as real adapters' do (36–45 % measured on the tiny Qwen3 and the demo, ``bench_lora.py``);
  ``weight_bytes`` and ``delta_density`` do not apply. The base is emulated (``AdapterSpec.base_path`` = ``emulated:<profile>``): its bytes
  are the profile's, its load the emulated engine's modelled time.
- **Time is the model's**: each micro-batch sleeps the simulator's training time of its tokens
  (:meth:`rlboost_hpc.sim.profiles.Profile.train_time` of the profile the rollout instances emulate — one source
  for both), divided by ``time_scale``.
- **Checkpoints are real too**: the weights (safetensors) and the step count, restored bit for bit.

What it does not model: the loss and its gradients (the step's metrics are the behaviour logprobs' own:
``loss`` 0, ``kl`` 0), the reference policy (its logprobs are the behaviour logprobs), optimizer state in memory
and checkpoints (only the weights), and anything an evaluation or an exported model could show — there is no
model to evaluate.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping

import torch

from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions
from rlboost_hpc.trainer.backends.base import Sample, StepAccumulator, TrainerBackend

__all__ = ["EmulatedBackend", "tensor_sizes"]

#: bf16: two bytes per element.
ELEMENT_BYTES = 2


def tensor_sizes(weight_bytes: int, tensor_bytes: int) -> list[int]:
    """Element counts of the emulated tensors: ``weight_bytes`` split into tensors of ``tensor_bytes`` (the last
    one smaller), in bf16 elements.

    Raises:
        ValueError: ``weight_bytes`` below one element or ``tensor_bytes`` below one element.
    """
    if weight_bytes < ELEMENT_BYTES or tensor_bytes < ELEMENT_BYTES:
        raise ValueError(f"weight_bytes ({weight_bytes}) and tensor_bytes ({tensor_bytes}) must be >= "
                         f"{ELEMENT_BYTES} (one bf16 element)")
    total, per = weight_bytes // ELEMENT_BYTES, tensor_bytes // ELEMENT_BYTES
    return [per] * (total // per) + ([total % per] if total % per else [])


class EmulatedBackend(TrainerBackend):
    """The emulated trainer (module docstring).

    Args:
        weight_bytes: S, bytes of one weight version (bf16).
        tensor_bytes: the largest tensor (bytes); a 70B model's largest is ~2 GB, a 7B model's ~1 GB.
        delta_density: share of the elements one optimizer step changes (0 < d ≤ 1).
        train_time: seconds the modelled trainer takes for responses totalling ``tokens`` tokens whose squared
            lengths sum to ``sq_tokens`` (``Profile.train_time``), before ``time_scale``.
        time_scale: model seconds per wall second (> 0).
        seed: the initial weights' and every step's draw.
        objective: the GRPO options (their normaliser only: the step's responses and loss tokens).
        sleep: the clock's sleep (injected by tests).
        lora: ``(rank, targets, arch)``: versions are a LoRA adapter on the ``arch`` shape (module docstring).
    """

    def __init__(self, *, weight_bytes: int, tensor_bytes: int, delta_density: float, train_time,
                 time_scale: float, seed: int = 0, objective: GRPOOptions | None = None, sleep=time.sleep,
                 lora: tuple | None = None) -> None:
        if not 0 < delta_density <= 1:
            raise ValueError(f"delta_density must be in (0, 1] (got {delta_density})")
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0 (got {time_scale})")
        self.delta_density, self.train_time, self.time_scale, self.seed = delta_density, train_time, time_scale, seed
        self.sleep = sleep
        g = torch.Generator().manual_seed(seed)
        self.lora = lora is not None
        if lora is not None:
            from rlboost_hpc.models.lora import adapter_shapes

            rank, targets, arch = lora
            self.weights = {k: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
                            for k, shape in adapter_shapes(arch, targets, rank).items()}
        else:
            self.weights = {f"emulated.layers.{i}.weight": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
                            for i, n in enumerate(tensor_sizes(weight_bytes, tensor_bytes))}
        self.steps = 0  # optimizer steps taken: the draw of the next one
        self.step = StepAccumulator(objective or GRPOOptions())
        self.slept_s = 0.0  # modelled training seconds slept (wall)

    @property
    def nbytes(self) -> int:
        """Bytes of one version."""
        return sum(t.numel() for t in self.weights.values()) * ELEMENT_BYTES

    def accumulate(self, batch: list[Sample], responses_in_step: int) -> dict[str, float]:
        """Sleep the modelled training time of the batch's tokens; the metrics of a loss that is not computed."""
        lens = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
        wait = self.train_time(float(sum(lens)), float(sum(n * n for n in lens))) / self.time_scale
        self.sleep(wait)
        self.slept_s += wait
        self.step.add_batch(batch, responses_in_step)
        return {"loss": 0.0, "tokens": sum(s.generated_tokens() for s in batch)}

    def optimizer_step(self) -> dict[str, float]:
        """Move ``delta_density`` of every tensor's elements by one ulp (drawn from (seed, step)). Returns
        ``grad_norm`` 0, ``lr`` 0 and ``changed_share`` (the elements changed ÷ all: duplicates of the draw make it
        slightly less than the density)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps + 1)
        changed = total = 0
        if self.lora:  # every adapter element moves, in its low 6 mantissa bits
            for t in self.weights.values():
                bits = t.view(torch.int16)
                bits ^= torch.randint(1, 64, bits.shape, generator=g, dtype=torch.int16)
                changed += t.numel()
                total += t.numel()
            self.steps += 1
            self.step.finish()
            return {"grad_norm": 0.0, "lr": 0.0, "changed_share": 1.0}
        for t in self.weights.values():
            n = t.numel()
            k = max(1, int(n * self.delta_density))
            idx = torch.randint(n, (k,), generator=g)
            bits = t.view(torch.int16)
            bits[idx] = bits[idx] ^ 1  # the last mantissa bit: ±1 ulp, never a NaN or an infinity
            changed += int(torch.unique(idx).numel())
            total += n
        self.steps += 1
        self.step.finish()
        return {"grad_norm": 0.0, "lr": 0.0, "changed_share": changed / max(1, total)}

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """The live bf16 tensors (no copy: the publisher copies them into the weight server)."""
        return self.weights

    def token_logprobs(self, batch: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """The behaviour logprobs (there is no model): a list of ``[len(response)]`` float32 tensors."""
        return [torch.tensor(s.behaviour_logprobs, dtype=torch.float32) for s in batch]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Raises RuntimeError: the emulated trainer has no model."""
        raise RuntimeError("trainer.backend = emulated has no model: no logits")

    def save_checkpoint(self, path: str | os.PathLike, extra_state: Mapping | None = None) -> None:
        """The weights into ``path/emulated.safetensors`` and the step count (and ``extra_state``) into
        ``path/emulated.json`` (directory created)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        save_file(self.weights, str(p / "emulated.safetensors"))
        (p / "emulated.json").write_text(json.dumps({"steps": self.steps, "extra": dict(extra_state or {})}))

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore :meth:`save_checkpoint`; returns its ``extra_state``.

        Raises:
            ValueError: the checkpoint's tensors are not this backend's (another ``weight_bytes`` or
                ``tensor_bytes``).
        """
        from safetensors.torch import load_file

        p = Path(path)
        loaded = load_file(str(p / "emulated.safetensors"))
        shapes = {k: tuple(v.shape) for k, v in loaded.items()}
        if shapes != {k: tuple(v.shape) for k, v in self.weights.items()}:
            raise ValueError(f"{p}: an emulated checkpoint of other tensors (trainer.emulated.weight_bytes or "
                             "tensor_bytes changed since it was written)")
        self.weights = loaded
        st = json.loads((p / "emulated.json").read_text())
        self.steps = int(st["steps"])
        return st["extra"]
