"""Rewards in a persistent pool of worker processes, each answer under a deadline.

A reward is user-level code on model output (math-verify runs SymPy on whatever the policy wrote): one answer can
take unbounded time — ``answers_match("18", "(x+1)^{9999}")`` does not return within 25 s — and, run inline, it
would stall the trainer's step forever. :class:`RewardPool` runs ``task.reward`` in a
:class:`~rlboost_hpc.tasks.pool.DeadlinePool`: an answer past ``timeout_s`` scores 0.0 and is counted in
:attr:`RewardPool.timed_out` (its worker is killed and replaced); an answer whose worker died twice, or whose reward
raised, scores 0.0 and is counted in :attr:`RewardPool.failed`. A call's answers go to the workers in one chunk
each (one round trip per worker, not per answer); a chunk that passes one answer's deadline or fails runs again answer
by answer, each under its own deadline — so only the answer at fault scores 0 and counts, and a runaway answer costs
at most two deadlines. Results come back in input order; the pool is
deterministic given deterministic rewards (a timed-out answer is 0.0 whatever the machine's load, as long as the
deadline is larger than honest answers need).

A user's task (:class:`~rlboost_hpc.tasks.user_task.UserTask`) has reward *components* — its reward functions and
its reward model —, and :meth:`RewardPool.score` runs one pool call per (group, component), each under the
component's deadline (a function's: ``task.rewards.timeout_s`` per group; the reward model's: its requests' budget).
A call that raises, times out, or returns bad values (:class:`~rlboost_hpc.tasks.user_rewards.RewardOutputError`)
is counted against that component (:attr:`RewardPool.tallies`), its first failure logged once with the row, and
``task.rewards.errors`` decides: ``skip`` (its values are ``None`` and the answers are marked failed,
:attr:`~rlboost_hpc.tasks.base.Scored.failed`: the trainer leaves their GRPO group out of the step — a failed
component is never a zero, and the group's advantages are never built from the components left) or ``fail``
(:class:`RewardFunctionFailed`, exit 1 naming the function). A completion's reward is the weighted sum of its
components' values (``None`` adds 0); a component's mean is over its successful values only.

A stateful environment (``task.environment``) is a component too (kind ``environment``): its value is what the
trajectory's steps summed to (``Response.env_return``), computed by the environment itself in the tool processes; a
trajectory whose environment failed (``Response.env_error``) is counted against it and handled by the same policy.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlboost_hpc.errors import RunFailed
from rlboost_hpc.tasks.base import Scored, Task
from rlboost_hpc.tasks.pool import CallStatus, DeadlinePool
from rlboost_hpc.tasks.user_rewards import RunProgress

log = logging.getLogger("rlboost.rewards")


class RewardFunctionFailed(RunFailed, RuntimeError):
    """A reward component failed and ``task.rewards.errors = fail``: the run stops (exit 1) naming it."""


@dataclass
class ComponentTally:
    """Counts of one reward component over the run: pool calls (one per group), calls that failed (raised or
    returned bad values), calls past their deadline, and the sum and count of its non-None values."""

    calls: int = 0
    failed: int = 0
    timed_out: int = 0
    value_sum: float = 0.0
    values: int = 0

    def to_json(self) -> dict:
        return {"calls": self.calls, "failed": self.failed, "timed_out": self.timed_out,
                "mean": self.value_sum / self.values if self.values else None}


@dataclass(frozen=True)
class _GroupCall:
    """One component (index ``ci``) on one group's completions (``ids``: their token ids, or None) at ``progress``."""

    ci: int
    prompt: Any
    texts: list[str]
    ids: list[list[int]] | None
    progress: Any = None


@dataclass(frozen=True)
class _Answers:
    """Several ``(prompt, text)`` answers of a built-in task scored in one pool call (a list of floats)."""

    items: tuple


@dataclass(frozen=True)
class _Reward:
    """The pool's handler: ``task.reward(prompt, text)`` of one ``(prompt, text)`` item."""

    task: Task

    def setup(self) -> None:
        """Import the task's reward functions once in the worker."""
        for c in self.task.components:
            if c.ref:
                c.function()

    def __call__(self, item: Any) -> Any:
        if isinstance(item, _GroupCall):
            from rlboost_hpc.tasks.user_rewards import call_component

            return call_component(self.task.components[item.ci], item.prompt, item.texts, item.ids,
                                  self.task.prompt_field, item.progress)
        if isinstance(item, _Answers):
            return [float(self.task.reward(p, t)) for p, t in item.items]
        prompt, text = item
        return float(self.task.reward(prompt, text))


class RewardPool:
    """Score answers of ``task`` in ``workers`` processes with a per-answer deadline (see the module docstring).

    Args:
        task: a picklable :class:`~rlboost_hpc.tasks.base.Task` (sent to each worker once).
        workers: processes (≥ 1).
        timeout_s: per-answer deadline, seconds (> 0; ``task.rewards.timeout_s``).

    Raises:
        ValueError: ``workers < 1`` or ``timeout_s <= 0``.
    """

    def __init__(self, task: Task, *, workers: int = 2, timeout_s: float = 5.0) -> None:
        self.task, self.timeout_s = task, timeout_s
        self.components = list(task.components)  # a user's task: its reward functions, model and environment
        self.errors = task.reward_errors
        self.tallies = {c.name: ComponentTally() for c in self.components}
        self._pool = DeadlinePool(_Reward(task), workers=workers, timeout_s=timeout_s)
        # chunks of answers that passed their deadline or failed as a whole: run again one by one (their answers count)
        self._chunk_timeouts = self._chunk_failures = 0

    @property
    def timed_out(self) -> int:
        """Answers that ran past their deadline (scored 0.0); a chunk of answers that did is not one of them (its
        answers ran again one by one, and those count)."""
        return self._pool.timed_out - self._chunk_timeouts

    @property
    def failed(self) -> int:
        """Answers whose reward raised or whose worker died twice (scored 0.0)."""
        return self._pool.failed - self._chunk_failures

    @property
    def replaced(self) -> int:
        """Workers killed or died and started anew."""
        return self._pool.replaced

    def score(self, items: Sequence[tuple[Any, str]], completion_ids: Sequence[list[int]] | None = None,
              environment: Sequence[tuple[float, str]] | None = None, groups: Sequence[Any] | None = None,
              progress: RunProgress | None = None) -> Scored:
        """Rewards (and each component's values) of ``(prompt, response_text)`` pairs, in order — the one way every
        task is scored; never raises on model output, never waits more than a deadline per call plus queueing.

        Args:
            completion_ids: each text's token ids (a user's TRL-style functions receive them), or None.
            environment: with a stateful environment, each pair's ``(return, error)`` (its trajectory's summed step
                rewards; the error text of a failed step, "" if none) — its component's values.
            groups: each pair's GRPO group (any hashable; default: its prompt's id): a component is called once per
                group with the group's completions.
            progress: the run's step (TRL's ``trainer_state`` for the functions that take it); None: outside a step.

        Raises:
            RewardFunctionFailed: a component failed and ``task.rewards.errors = fail``.
            ValueError: the task has an environment and ``environment`` is not one entry per pair.
        """
        items = list(items)
        if self.components:
            return self._score_components(items, completion_ids, environment, groups, progress)
        return Scored(self._score_answers(items), {})

    def _score_answers(self, items: list[tuple[Any, str]]) -> list[float]:
        """A task whose reward is one function: its value per answer."""
        if len(items) <= 1:
            return [float(c.value) if c.status == CallStatus.OK else 0.0 for c in self._pool.run_all(items)]
        # one call per worker, each chunk under one answer's deadline (answers of a built-in task take micro- to
        # milliseconds: 64 calls cost 5 ms of round trips per step); a chunk that fails or passes its deadline is
        # run again answer by answer, each under its own deadline — only the answer at fault scores 0 and counts
        n = min(len(items), self._pool.workers)
        bounds = [len(items) * i // n for i in range(n + 1)]
        chunks = [_Answers(tuple(items[a:b])) for a, b in zip(bounds, bounds[1:])]
        out: list[float] = []
        for chunk, c in zip(chunks, self._pool.run_all(chunks)):
            if c.status == CallStatus.OK and isinstance(c.value, list) and len(c.value) == len(chunk.items):
                out += [float(v) for v in c.value]
                continue
            self._chunk_timeouts += c.status == CallStatus.TIMEOUT
            self._chunk_failures += c.status == CallStatus.FAILED
            out += [float(d.value) if d.status == CallStatus.OK else 0.0 for d in self._pool.run_all(list(chunk.items))]
        return out

    def _score_components(self, items: list[tuple[Any, str]], completion_ids: Sequence[list[int]] | None,
                          environment: Sequence[tuple[float, str]] | None, groups: Sequence[Any] | None,
                          progress: RunProgress | None = None) -> Scored:
        """A task with components (a user's task): one pool call per (group, component), the environment's values
        from the trajectories."""
        failed = [False] * len(items)
        by_group: dict[Any, list[int]] = {}
        for i, (p, _) in enumerate(items):
            by_group.setdefault(p.pid if groups is None else groups[i], []).append(i)
        calls = [(idxs, _GroupCall(ci, items[idxs[0]][0], [items[i][1] for i in idxs],
                                   None if completion_ids is None else [list(completion_ids[i]) for i in idxs],
                                   progress))
                 for idxs in by_group.values() for ci, c in enumerate(self.components) if c.kind != "environment"]
        done = self._pool.run_all([c for _, c in calls], [self.components[c.ci].timeout_s for _, c in calls])
        parts: dict[str, list[float | None]] = {c.name: [None] * len(items) for c in self.components}
        for (idxs, call), res in zip(calls, done):
            comp = self.components[call.ci]
            values = self._values(comp, call, res)
            for i, v in zip(idxs, values or [None] * len(idxs)):
                parts[comp.name][i] = v
                failed[i] |= values is None and comp.weight != 0  # (a weight-0 function is a metric, no reward)
        for comp in self.components:
            if comp.kind == "environment":
                if environment is None or len(environment) != len(items):
                    raise ValueError(f"the task has an environment ({comp.name}): score each completion with its "
                                     "trajectory's (return, error)")
                parts[comp.name] = self._environment_values(comp, items, environment)
                for i, (_, err) in enumerate(environment):
                    failed[i] |= bool(err)
        rewards = [sum(c.weight * (parts[c.name][i] or 0.0) for c in self.components) for i in range(len(items))]
        return Scored(rewards, parts, tuple(failed) if any(failed) else ())

    def _environment_values(self, comp, items: Sequence[tuple[Any, str]],
                            environment: Sequence[tuple[float, str]]) -> list[float | None]:
        """The environment's values: each trajectory's return, None for one whose environment failed (counted, the
        first logged with its row; ``fail``: :class:`RewardFunctionFailed`)."""
        t, out = self.tallies[comp.name], []
        for (prompt, _), (ret, err) in zip(items, environment):
            t.calls += 1
            if not err:
                t.value_sum, t.values = t.value_sum + ret, t.values + 1
                out.append(float(ret))
                continue
            if err.startswith("timeout"):
                t.timed_out += 1
            else:
                t.failed += 1
            self._failure(comp, prompt, err)
            out.append(None)
        return out

    def _failure(self, comp, prompt: Any, why: str) -> None:
        """Log a component's first failure with its row; stop the run under ``task.rewards.errors = fail``."""
        t = self.tallies[comp.name]
        if t.failed + t.timed_out == 1 or self.errors == "fail":
            row = json.dumps({"prompt": prompt.text[:200], **prompt.meta}, default=str)[:600]
            log.warning("reward %s (%s) failed on prompt %s: %s; row: %s", comp.name, comp.key, prompt.pid, why, row)
        if self.errors == "fail":
            raise RewardFunctionFailed(f"reward {comp.name} ({comp.key}) failed on prompt {prompt.pid}: {why} "
                                       "(task.rewards.errors = fail)")

    def _values(self, comp, call: _GroupCall, res) -> list[float | None] | None:
        """The component's values of one call; None when it failed (counted, logged once, handled per policy)."""
        t = self.tallies[comp.name]
        t.calls += 1
        if res.status == CallStatus.OK:
            for v in res.value:
                if v is not None:
                    t.value_sum, t.values = t.value_sum + v, t.values + 1
            return list(res.value)
        why = res.error or res.status.value
        if res.status == CallStatus.TIMEOUT:
            t.timed_out += 1
        else:
            t.failed += 1
        self._failure(comp, call.prompt, why)
        return None

    def take_tallies(self) -> dict[str, dict]:
        """Each component's tally as JSON (name → ``calls``, ``failed``, ``timed_out``, ``mean``)."""
        return {name: t.to_json() for name, t in self.tallies.items()}

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._pool.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
