"""The processes a task runs in the trainer's allocation, owned in one place: :class:`TaskRuntime`.

A run's task needs processes of its own beside the trainer: the reward processes (a persistent pool under
``task.rewards.timeout_s``, :class:`~rlboost_hpc.tasks.reward_pool.RewardPool`), the turn processes of the held-out
evaluation's trajectories (a multi-turn task's tools or stateful environment, from the run's
:class:`~rlboost_hpc.tasks.environment.TurnSpec`) and the task's own (a stateful environment's ``reset`` process,
held by :class:`~rlboost_hpc.tasks.user_task.UserTask`). The run's services enter one runtime; leaving it closes every
one of them — the task's own last — whatever ended the run. The manager's process runs the training trajectories'
turn processes itself, from the same ``TurnSpec``.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlboost_hpc.config_task import TaskRewardsCfg
    from rlboost_hpc.tasks.base import Task
    from rlboost_hpc.tasks.environment import TurnSpec
    from rlboost_hpc.tasks.reward_pool import RewardPool
    from rlboost_hpc.tasks.tools import TurnCalls

__all__ = ["TaskRuntime"]


class TaskRuntime:
    """The task's processes (see the module docstring): ``rewards`` (the reward pool: ``rewards_cfg.workers``
    processes, ``rewards_cfg.timeout_s`` seconds per answer) and ``eval_turns`` (the held-out evaluation's turn pool
    for a multi-turn task, from ``turns``; None for a single-turn one) exist while it is entered; ``close`` (or
    leaving the ``with`` block) stops them and closes the task.

    Raises (on entering):
        whatever starting a pool raises; what was started by then is closed first.
    """

    def __init__(self, task: Task, rewards_cfg: TaskRewardsCfg, turns: TurnSpec | None) -> None:
        self.task, self._rewards_cfg, self._turns = task, rewards_cfg, turns
        self.rewards: RewardPool | None = None
        self.eval_turns: TurnCalls | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "TaskRuntime":
        from rlboost_hpc.tasks.reward_pool import RewardPool

        self._stack.callback(self.task.close)  # (closed last: a stateful environment's reset process)
        try:
            self.rewards = RewardPool(self.task, workers=self._rewards_cfg.workers,
                                      timeout_s=self._rewards_cfg.timeout_s)
            self._stack.callback(self.rewards.close)
            if self._turns is not None:  # held-out trajectories call the tools too (their own workers, same deadline)
                self.eval_turns = self._turns.calls()
                self._stack.callback(self.eval_turns.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process of the task (idempotent)."""
        self._stack.close()
