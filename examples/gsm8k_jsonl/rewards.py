"""A user's reward file for GSM8K (TRL's batched signature): what a team brings, nothing of rlboost-hpc changed.

``correct`` is the built-in ``gsm8k`` task's reward written as a user would — the last number or ``\\boxed{}``
answer of the completion against the row's ``answer`` column, verified with math-verify through the package's
public helpers — so training with this file and ``train.jsonl`` gives the built-in task's rewards exactly.
``concise`` is a second, shaping reward (used by ``config.toml`` with a small weight; the equivalence test leaves
it out): 1 when the completion states an answer within 200 characters, else 0.
"""
from __future__ import annotations

from rlboost_hpc.tasks.math import answers_match, extract_answer


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when a completion's final answer equals the row's gold ``answer``, else 0.0 (one per completion)."""
    return [1.0 if answers_match(gold, extract_answer(text, "gsm8k")) else 0.0
            for text, gold in zip(completions, answer)]


def concise(prompts, completions, **kwargs) -> list[float]:
    """1.0 when a completion gives a number within its first 200 characters, else 0.0."""
    return [1.0 if extract_answer(text[:200], "gsm8k") is not None else 0.0 for text in completions]
