"""Rewards in a pool of processes with a per-answer deadline (rlboost_hpc/tasks/reward_pool.py)."""
from __future__ import annotations

import os
import time

import pytest

from rlboost_hpc.tasks.base import Prompt, Task
from rlboost_hpc.tasks.reward_pool import RewardPool


class RewardOnly(Task):
    """A task of no prompts (the pool scores prompts it is given): only its reward is the test's."""

    def train_prompts(self) -> list[Prompt]:
        return []

    def heldout_prompts(self) -> list[Prompt]:
        return []


class MathAnswers(RewardOnly):
    """A task stand-in: reward = math-verify equivalence of the response with the prompt's gold answer."""

    def reward(self, prompt: Prompt, text: str) -> float:
        from rlboost_hpc.tasks.math import answers_match

        return 1.0 if answers_match(prompt.meta["gold"], text) else 0.0


class Dies(RewardOnly):
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
        got = pool.score([(P("18"), "18"), (P("18"), "(x+1)^{9999}"), (P("1/2"), "0.5"), (P("3"), "4")]).rewards
        took = time.monotonic() - t0
        assert got == [1.0, 0.0, 1.0, 0.0]
        # the answers run in one chunk per worker (issue 55: one round trip instead of one per answer); the chunk
        # holding the runaway passed its deadline, ran again answer by answer, and only the runaway counts
        assert pool.timed_out == 1 and pool.replaced == 2
        assert took < 2 * 3.0 + 15.0  # two deadlines plus the replacements' starts, not the runaway answer
        assert pool.score([(P("7"), "7")]).rewards == [1.0]  # the replacement works


def test_a_worker_that_dies_is_replaced_and_its_answer_retried_once():
    with RewardPool(Dies(), workers=1, timeout_s=10.0) as pool:
        assert pool.score([(P("x"), "ok"), (P("x"), "die"), (P("x"), "ok")]).rewards == [1.0, 0.0, 1.0]
        # the chunk's worker died twice (retried once), then the answers ran one by one: only "die" failed
        assert pool.failed == 1 and pool.replaced == 4


class Quotes(RewardOnly):
    def reward(self, prompt: Prompt, text: str) -> float:
        return 1.0 if '"' in text else 0.0


def test_a_steps_answers_cost_one_round_trip_per_worker_and_keep_their_order():
    with RewardPool(Quotes(), workers=2, timeout_s=5.0) as pool:
        texts = [f'{i} "' if i % 3 == 0 else str(i) for i in range(64)]
        calls = []
        run_all = pool._pool.run_all
        pool._pool.run_all = lambda items, *a: calls.append(len(items)) or run_all(items, *a)
        assert pool.score([(P("x"), t) for t in texts]).rewards == [1.0 if i % 3 == 0 else 0.0 for i in range(64)]
        assert calls == [2] and pool.timed_out == pool.failed == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        RewardPool(Dies(), workers=0)
    with pytest.raises(ValueError):
        RewardPool(Dies(), timeout_s=0)


class ClosedOnce(RewardOnly):
    """A task that counts its ``close`` calls (a stateful environment's reset process is closed there)."""

    def __init__(self) -> None:
        self.closed = 0

    def reward(self, prompt: Prompt, text: str) -> float:
        return float(len(text))

    def close(self) -> None:
        self.closed += 1


def test_the_task_runtime_owns_the_reward_and_turn_processes_and_closes_each_on_every_way_out():
    """Issue 56 item 1: one owner of a task's processes. Entered, its reward pool scores in processes of its own (and
    a single-turn task has no turn pool); left, those processes are gone and the task is closed, once. A start that
    fails half-way (the turn pool refuses its arguments) closes what it had started, the task too."""
    import psutil

    from rlboost_hpc.config_task import TaskRewardsCfg
    from rlboost_hpc.tasks.environment import TurnSpec
    from rlboost_hpc.tasks.runtime import TaskRuntime

    me, task = psutil.Process(), ClosedOnce()

    def workers() -> set[int]:  # this process's multiprocessing workers (not its resource tracker)
        out = set()
        for p in me.children(recursive=True):
            try:
                if "spawn_main" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    out.add(p.pid)
            except psutil.Error:  # (it ended meanwhile)
                pass
        return out

    before = workers()
    with TaskRuntime(task, TaskRewardsCfg(workers=2, timeout_s=5.0), None) as rt:
        assert rt.eval_turns is None
        assert rt.rewards.score([(P("x"), "abc"), (P("x"), "a")]).rewards == [3.0, 1.0]
        assert len(workers() - before) == 2  # its two reward processes
    assert not workers() - before and task.closed == 1  # (close waits for them)
    broken, task2 = TurnSpec(env=None, workers=0, timeout_s=5.0), ClosedOnce()
    with pytest.raises(ValueError):
        with TaskRuntime(task2, TaskRewardsCfg(), broken):
            pass
    assert task2.closed == 1
