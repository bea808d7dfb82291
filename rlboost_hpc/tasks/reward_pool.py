"""Rewards in a persistent pool of worker processes, each answer under a deadline.

A reward is user-level code on model output (math-verify runs SymPy on whatever the policy wrote): one answer can
take unbounded time — ``answers_match("18", "(x+1)^{9999}")`` does not return within 25 s — and, run inline, it
would stall the trainer's step forever. :class:`RewardPool` runs ``task.reward`` in a
:class:`~rlboost_hpc.tasks.pool.DeadlinePool`: an answer past ``timeout_s`` scores 0.0 and is counted in
:attr:`RewardPool.timed_out` (its worker is killed and replaced); an answer whose worker died twice, or whose reward
raised, scores 0.0 and is counted in :attr:`RewardPool.failed`. Results come back in input order; the pool is
deterministic given deterministic rewards (a timed-out answer is 0.0 whatever the machine's load, as long as the
deadline is larger than honest answers need).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlboost_hpc.tasks.pool import CallStatus, DeadlinePool


@dataclass(frozen=True)
class _Reward:
    """The pool's handler: ``task.reward(prompt, text)`` of one ``(prompt, text)`` item."""

    task: Any

    def __call__(self, item: tuple[Any, str]) -> float:
        prompt, text = item
        return float(self.task.reward(prompt, text))


class RewardPool:
    """Score answers of ``task`` in ``workers`` processes with a per-answer deadline (see the module docstring).

    Args:
        task: a picklable :class:`~rlboost_hpc.tasks.base.Task` (sent to each worker once).
        workers: processes (≥ 1).
        timeout_s: per-answer deadline, seconds (> 0; ``task.reward_timeout_s``).

    Raises:
        ValueError: ``workers < 1`` or ``timeout_s <= 0``.
    """

    def __init__(self, task: Any, *, workers: int = 2, timeout_s: float = 5.0) -> None:
        self.task, self.timeout_s = task, timeout_s
        self._pool = DeadlinePool(_Reward(task), workers=workers, timeout_s=timeout_s)

    @property
    def timed_out(self) -> int:
        """Answers that ran past their deadline (scored 0.0)."""
        return self._pool.timed_out

    @property
    def failed(self) -> int:
        """Answers whose reward raised or whose worker died twice (scored 0.0)."""
        return self._pool.failed

    @property
    def replaced(self) -> int:
        """Workers killed or died and started anew."""
        return self._pool.replaced

    def score(self, items: Sequence[tuple[Any, str]]) -> list[float]:
        """Rewards of ``(prompt, response_text)`` pairs, in order; never raises on model output, never waits
        more than ``timeout_s`` per answer plus queueing."""
        return [float(c.value) if c.status == CallStatus.OK else 0.0 for c in self._pool.run_all(list(items))]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._pool.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
