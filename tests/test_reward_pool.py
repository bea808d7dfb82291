"""Rewards in a pool of processes with a per-answer deadline (rlboost_hpc/tasks/reward_pool.py)."""
from __future__ import annotations

import os
import time

import pytest

from rlboost_hpc.tasks.base import Prompt
from rlboost_hpc.tasks.reward_pool import RewardPool


class MathAnswers:
    """A task stand-in: reward = math-verify equivalence of the response with the prompt's gold answer."""

    def reward(self, prompt: Prompt, text: str) -> float:
        from rlboost_hpc.tasks.math import answers_match

        return 1.0 if answers_match(prompt.meta["gold"], text) else 0.0


class Dies:
    def reward(self, prompt: Prompt, text: str) -> float:
        if text == "die":
            os._exit(3)
        return 1.0


def P(gold: str) -> Prompt:
    return Prompt(pid="p", text="q", meta={"gold": gold})


def test_an_answer_that_would_hang_the_trainer_scores_0_within_its_deadline():
    """Regression (issue 16): answers_match("18", "(x+1)^{9999}") did not return within 25 s, synchronously in the
    trainer. In the pool it is killed at its deadline, scored 0 and counted; honest answers around it are scored."""
    with RewardPool(MathAnswers(), workers=2, timeout_s=3.0) as pool:
        pool.score([(P("18"), "18")])  # workers warm (imports)
        t0 = time.monotonic()
        got = pool.score([(P("18"), "18"), (P("18"), "(x+1)^{9999}"), (P("1/2"), "0.5"), (P("3"), "4")])
        took = time.monotonic() - t0
        assert got == [1.0, 0.0, 1.0, 0.0]
        assert pool.timed_out == 1 and pool.replaced == 1
        assert took < 3.0 + 15.0  # the deadline plus a replacement's start, not the runaway answer
        assert pool.score([(P("7"), "7")]) == [1.0]  # the replacement works


def test_a_worker_that_dies_is_replaced_and_its_answer_retried_once():
    with RewardPool(Dies(), workers=1, timeout_s=10.0) as pool:
        assert pool.score([(P("x"), "ok"), (P("x"), "die"), (P("x"), "ok")]) == [1.0, 0.0, 1.0]
        assert pool.failed == 1 and pool.replaced == 2


def test_bad_arguments():
    with pytest.raises(ValueError):
        RewardPool(Dies(), workers=0)
    with pytest.raises(ValueError):
        RewardPool(Dies(), timeout_s=0)
