"""Held-out evaluation of a policy version with a local torch engine.

Invariant: evaluation is reproducible — sample j of held-out prompt i uses seed ``base_seed + 1000·i + j``,
so "before" and "after" see the same random draws and differ only by the weights.
"""
from __future__ import annotations

from typing import Mapping

import torch

from rlboost_hpc.models.config import LlamaConfig
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.tasks.base import Task
from rlboost_hpc.tasks.stories import repetition_rate


def strip_stop(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """Response ids without a trailing stop token (the reward sees new text only)."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def evaluate(config: LlamaConfig, weights: Mapping[str, torch.Tensor], tokenizer, task: Task, *,
             samples: int, max_new_tokens: int, temperature: float, top_p: float, stop_ids: tuple[int, ...],
             base_seed: int = 12345) -> dict:
    """Mean reward over held-out prompts (``samples`` sampled responses each, plus one greedy).

    Returns a dict: reward_sampled, reward_greedy, repetition_rate (mean over sampled responses),
    responses (int), examples (first few greedy texts).
    """
    eng = TorchEngine(config, weights, max_batch=64)
    prompts = task.heldout_prompts()
    reqs, meta = [], {}
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(task.format_prompt(p), bos=True)
        for j in range(samples + 1):
            greedy = j == samples
            rid = f"eval/{i}/{j}"
            sp = SamplingParams(temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                seed=base_seed + 1000 * i + j, stop_token_ids=stop_ids)
            reqs.append(GenRequest(rid=rid, prompt_ids=ids, max_new_tokens=max_new_tokens, sampling=sp))
            meta[rid] = (p, greedy)
    out = generate_all(eng, reqs)
    sampled, greedy_r, rep, examples = [], [], [], []
    for rid, (ids, _lps, _fin) in out.items():
        p, greedy = meta[rid]
        text = tokenizer.decode(strip_stop(list(ids), stop_ids))
        r = task.reward(p, text)
        if greedy:
            greedy_r.append(r)
            if len(examples) < 4:
                examples.append(task.format_prompt(p) + text)
        else:
            sampled.append(r)
            rep.append(repetition_rate(text))
    return {
        "reward_sampled": sum(sampled) / len(sampled),
        "reward_greedy": sum(greedy_r) / len(greedy_r),
        "repetition_rate": sum(rep) / len(rep),
        "responses": len(sampled) + len(greedy_r),
        "examples": examples,
    }
