"""Held-out evaluation of a policy version with a local torch engine, and the quality gate's KL estimate.

Invariants:
- Evaluation is reproducible: sample j of held-out prompt i uses seed ``base_seed + 1000·i + j``, so "before"
  and "after" see the same random draws and differ only by the weights. Prompts are encoded exactly as the
  trainer encodes them (:meth:`rlboost_hpc.tasks.base.Task.prompt_ids`: the chat template when the tokenizer
  is in chat mode), and responses stop at the model's stop tokens.
- :func:`kl_to_reference` is the k3 estimator of KL(π_θ ‖ π_ref) per token, on responses sampled from π_θ:
  mean over tokens of ``exp(r) − r − 1`` with ``r = log π_ref(t) − log π_θ(t)`` (unbiased, never negative;
  Schulman, "Approximating KL divergence", 2020), both logprobs at the sampling temperature.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.tasks.base import Task
from rlboost_hpc.tasks.stories import repetition_rate
from rlboost_hpc.trainer.backends.base import Sample, TrainerBackend


def strip_stop(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """Response ids without a trailing stop token (the reward sees new text only)."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def evaluate(arch: ModelArch, weights: Mapping[str, torch.Tensor], tokenizer, task: Task, *,
             samples: int, max_new_tokens: int, temperature: float, top_p: float, base_seed: int = 12345,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             score: Callable[[list[tuple[Any, str]]], list[float]] | None = None) -> dict:
    """Mean reward over held-out prompts (``samples`` sampled responses each, plus one greedy).

    Args:
        tokenizer: a :class:`~rlboost_hpc.models.hf_dir.PolicyTokenizer` (prompt ids, stop ids, decoding).
        score: rewards of ``(prompt, text)`` pairs (the run's ``RewardPool.score``; inline ``task.reward`` when
            ``None``).

    Returns:
        A dict: reward_sampled, reward_greedy, repetition_rate (mean over sampled responses), responses (int),
        examples (first few greedy texts), sampled (the sampled responses as :class:`Sample` s, advantage 0,
        for :func:`kl_to_reference`).
    """
    eng = TorchEngine(arch, weights, max_batch=64, device=device, dtype=dtype)
    stop_ids = tokenizer.stop_ids
    reqs, meta = [], {}
    for i, p in enumerate(task.heldout_prompts()):
        ids = task.prompt_ids(p, tokenizer)
        for j in range(samples + 1):
            greedy = j == samples
            rid = f"eval/{i}/{j}"
            sp = SamplingParams(temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                seed=base_seed + 1000 * i + j, stop_token_ids=stop_ids)
            reqs.append(GenRequest(rid=rid, prompt_ids=ids, max_new_tokens=max_new_tokens, sampling=sp))
            meta[rid] = (p, greedy, ids)
    out = generate_all(eng, reqs)
    texts = {rid: tokenizer.decode(strip_stop(list(ids), stop_ids)) for rid, (ids, _l, _f) in out.items()}
    rids = list(out)
    scored = (score or (lambda items: [task.reward(p, t) for p, t in items]))(
        [(meta[rid][0], texts[rid]) for rid in rids])
    reward_of = dict(zip(rids, scored))
    sampled, greedy_r, rep, examples, drawn = [], [], [], [], []
    for rid, (ids, lps, _fin) in out.items():
        p, greedy, prompt_ids = meta[rid]
        text, r = texts[rid], reward_of[rid]
        if greedy:
            greedy_r.append(r)
            if len(examples) < 4:
                examples.append(task.format_prompt(p) + text)
        else:
            sampled.append(r)
            rep.append(repetition_rate(text))
            drawn.append(Sample(prompt_ids=list(prompt_ids), response_ids=list(ids), behaviour_logprobs=list(lps),
                                advantage=0.0))
    return {
        "reward_sampled": sum(sampled) / len(sampled),
        "reward_greedy": sum(greedy_r) / len(greedy_r),
        "repetition_rate": sum(rep) / len(rep),
        "responses": len(sampled) + len(greedy_r),
        "examples": examples,
        "sampled": drawn,
    }


def kl_to_reference(backend: TrainerBackend, samples: list[Sample], batch: int = 16) -> float:
    """k3 estimate of KL(π_θ ‖ π_ref) in nats per token over ``samples`` drawn from π_θ (module docstring).

    Raises:
        ValueError: the backend keeps no reference policy.
    """
    num, den = 0.0, 0
    for i in range(0, len(samples), batch):
        part = [s for s in samples[i:i + batch] if s.response_ids]
        if not part:
            continue
        pol = backend.token_logprobs(part)
        ref = backend.token_logprobs(part, reference=True)
        for a, b in zip(pol, ref):
            r = (b - a).double()
            num += float((torch.exp(r) - r - 1.0).sum())
            den += r.numel()
    return num / max(1, den)
