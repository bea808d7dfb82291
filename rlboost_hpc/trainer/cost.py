"""What a run's steps will cost, said before the first one starts: tokens per step and per held-out evaluation, the
rollout engine's prefill and decode rates measured on this machine, and the time they imply.

A configuration sized for GPUs (32 prompts × 8 responses × 1,024 tokens) takes hours per step on a CPU; without an
estimate the first sign of it is a progress bar that never moves. :func:`probe_rates` times the run's own engine
(:class:`~rlboost_hpc.rollout.engines.torch_engine.TorchEngine` on the rollout device and dtype, the initial
weights, the run's first training prompts) for a second or two; :func:`estimate` turns the measured rates into
times (pure arithmetic, unit-tested).

What the estimate is: a bound for ONE engine (the reserved one) producing every token of a step at the measured
batch — preemptible instances only shorten it — with each response at its full budget (a response that stops
early costs less) and decode measured at a short context (long responses decode more slowly). It tells a
ten-second step from a ten-hour one; it does not replace ``benchmarks/``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all

#: A step whose estimate exceeds this many seconds is announced as a warning, with the CPU-sized config to try.
SLOW_STEP_S = 600.0


@dataclass(frozen=True)
class EngineRates:
    """Measured throughput of one engine at ``batch`` concurrent requests: ``prefill_tokens_per_s`` (prompt tokens
    processed per second) and ``decode_tokens_per_s`` (new tokens per second, all requests together)."""

    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class StepCost:
    """The estimate for one step and one held-out evaluation (token counts are upper bounds: full budgets)."""

    step_tokens: int
    step_prompt_tokens: int
    eval_tokens: int
    eval_prompt_tokens: int
    step_s: float
    eval_s: float

    def describe(self, rates: EngineRates, device: str) -> str:
        """One line for the log: tokens, rates and the implied times."""
        return (f"a step generates up to {self.step_tokens:,} tokens ({self.step_prompt_tokens:,} prompt tokens), a "
                f"held-out evaluation up to {self.eval_tokens:,}; the torch engine on {device} measured "
                f"{rates.prefill_tokens_per_s:,.0f} prefill and {rates.decode_tokens_per_s:,.0f} decode tokens/s at "
                f"batch {rates.batch}: up to ≈ {_dur(self.step_s)} per step on the reserved engine alone, "
                f"≈ {_dur(self.eval_s)} per evaluation (run twice)")


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def estimate(rates: EngineRates, *, step_responses: int, eval_responses: int, tokens_per_response: int,
             mean_prompt_tokens: float) -> StepCost:
    """Seconds for ``step_responses`` and ``eval_responses`` responses of ``tokens_per_response`` new tokens each
    after prompts of ``mean_prompt_tokens``, at ``rates``: prefill + decode, each at its measured rate.

    Raises:
        ValueError: a non-positive rate or a negative count.
    """
    if rates.prefill_tokens_per_s <= 0 or rates.decode_tokens_per_s <= 0:
        raise ValueError(f"rates must be positive: {rates}")
    if min(step_responses, eval_responses, tokens_per_response) < 0 or mean_prompt_tokens < 0:
        raise ValueError("counts must not be negative")

    def secs(responses: int) -> float:
        return (responses * mean_prompt_tokens / rates.prefill_tokens_per_s
                + responses * tokens_per_response / rates.decode_tokens_per_s)

    return StepCost(step_tokens=step_responses * tokens_per_response,
                    step_prompt_tokens=round(step_responses * mean_prompt_tokens),
                    eval_tokens=eval_responses * tokens_per_response,
                    eval_prompt_tokens=round(eval_responses * mean_prompt_tokens),
                    step_s=secs(step_responses), eval_s=secs(eval_responses))


def probe_rates(arch: ModelArch, weights: Mapping[str, torch.Tensor], prompts: list[list[int]], *, batch: int,
                device: torch.device, dtype: torch.dtype, decode_steps: int = 6, prefill_prompts: int = 4) -> EngineRates:
    """Time the torch engine: prefill of ``prefill_prompts`` of ``prompts`` (a one-token generation), then
    ``decode_steps`` batched decode steps of ``batch`` requests (started from each prompt's first 8 tokens, so
    filling the batch costs little: decode time hardly depends on so short a context). Greedy with no stop token,
    so every request decodes every step. Costs about ``prefill_prompts`` prompts' prefill plus a few decode steps.

    Raises:
        ValueError: no prompts or ``batch`` < 1.
    """
    if not prompts or batch < 1:
        raise ValueError("probe_rates needs prompts and batch ≥ 1")
    sp = SamplingParams(temperature=0.0, top_p=1.0, seed=0, stop_token_ids=())
    first = prompts[:prefill_prompts]
    eng = TorchEngine(arch, weights, max_batch=batch, max_len=max(8, *map(len, first)) + 2 + decode_steps,
                      device=device, dtype=dtype)
    generate_all(eng, [GenRequest(rid="probe/warm", prompt_ids=list(first[0][:8]), max_new_tokens=2, sampling=sp)])
    t0 = time.perf_counter()
    generate_all(eng, [GenRequest(rid=f"probe/prefill/{i}", prompt_ids=list(p), max_new_tokens=1, sampling=sp)
                       for i, p in enumerate(first)])
    t_prefill = time.perf_counter() - t0
    for i in range(batch):
        eng.add(GenRequest(rid=f"probe/decode/{i}", prompt_ids=list(prompts[i % len(prompts)][:8]),
                           max_new_tokens=2 + decode_steps, sampling=sp))
    eng.step()  # their prefill (and first token)
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        eng.step()
    t_decode = time.perf_counter() - t0
    return EngineRates(batch=batch, prefill_tokens_per_s=sum(map(len, first)) / max(t_prefill, 1e-9),
                       decode_tokens_per_s=batch * decode_steps / max(t_decode, 1e-9))
