"""``rlboost-hpc task check --config X``: a dry run of a task before any GPU-hour is spent on it.

It loads the task exactly as a run does (the data set read and prepared, the reward code imported and its
signatures checked, the reward model probed, the tools' schemas built) and then prints: rows loaded and duplicates
dropped, three prompts as the model will see them, prompt-token percentiles of every prompt against
``rollout.max_new_tokens`` and the model's context, each reward function on the row's gold answer (when a column
holds one) and on an empty completion — in the run's reward processes, under their deadlines — with the seconds per
reward call, the tools' JSON schemas, and a stateful environment's first observation for three rows and its step
on an empty turn (each asked twice of new instances: an environment must be deterministic).

Invariant: any problem is exit 2 with one line naming the column, function or row (a prompt longer than the context
left for the response, a reward function that raises, hangs past its deadline or returns bad values); a task that
passes prints ``task check: OK``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rlboost_hpc.errors import BadInput

__all__ = ["TaskCheckFailed", "check_task", "task_main"]

#: Prompts whose completions the reward functions are tried on.
TRY_ROWS = 4
#: Columns that may hold a gold answer, in the order they are tried (verl's reward_model.ground_truth too).
GOLD_COLUMNS = ("answer", "ground_truth", "reward_model", "solution", "label")


class TaskCheckFailed(BadInput, ValueError):
    """The task has a problem (named in the message); exit 2."""


def _gold(prompt: Any) -> str | None:
    for col in GOLD_COLUMNS:
        v = prompt.meta.get(col)
        if isinstance(v, dict):
            v = v.get("ground_truth")
        if v is not None and not isinstance(v, (dict, list)):
            return str(v)
    return None


def _percentiles(xs: list[int]) -> dict[str, int]:
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, int(q / 100 * len(s)))] for q in (50, 90, 99)} | {"max": s[-1]}


def _check_lengths(cfg: Any, task: Any, policy: Any, out) -> None:
    lengths = []  # every row's (tokens, table, row), read in order from the memory-mapped files
    for k, length in enumerate(task.token_lengths(policy.tokenizer)):
        lengths.append(length)
        if k and k % 100_000 == 0:
            print(f"  … {k} prompts tokenised", file=out, flush=True)
    ctx, budget = policy.arch.max_position_embeddings, cfg.trajectory_tokens()
    pc = _percentiles([n for n, _, _ in lengths])
    print(f"prompt tokens: {pc} (rollout.max_new_tokens {cfg.rollout.max_new_tokens}, response budget {budget}, "
          f"context {ctx})", file=out)
    n, table, row = max(lengths)
    worst = task.row_prompt(table, row)
    if n + budget > ctx:
        raise TaskCheckFailed(f"prompt {worst.pid} ({worst.text[:60]!r}…) is {n} tokens: with the response budget of "
                              f"{budget} it exceeds the model's context of {ctx} (column {task.prompt_field!r})")


def _check_rewards(task: Any, pool: Any, out) -> None:
    prompts = list(task.train_prompts()[:TRY_ROWS])
    items = []
    for p in prompts:
        gold = _gold(p)
        items += [(p, "")] + ([(p, gold)] if gold is not None else [])
    comps = [c for c in pool.components if c.kind != "environment"]  # (its term comes with a trajectory)
    t0 = time.monotonic()
    try:
        parts = pool.score(items, None, [(0.0, "")] * len(items)).parts
    except Exception as e:  # noqa: BLE001 - RewardFunctionFailed names the function and the prompt
        raise TaskCheckFailed(str(e)) from None
    per_call = (time.monotonic() - t0) / max(1, len(prompts) * len(comps))
    for c in comps:
        vals = parts[c.name]
        on_gold = [v for (p, x), v in zip(items, vals) if x and x == _gold(p)]
        on_empty = [v for (p, x), v in zip(items, vals) if x == ""]
        print(f"reward {c.name} ({c.kind}, weight {c.weight:g}): gold answer {on_gold or 'no gold column'}, "
              f"empty completion {on_empty}", file=out)
    print(f"seconds per reward call: {per_call:.3f} (deadline {task.cfg.rewards.timeout_s:g} s per function call)",
          file=out)


def _check_environment(cfg: Any, task: Any, policy: Any, out) -> None:
    """The environment's first observation for three rows, and its step on an empty turn of the first row — each
    asked twice, of new instances, to see that they are deterministic (a replay must give the same answers)."""
    from rlboost_hpc.tasks.environment import EnvironmentCalls, EnvironmentRunner, TurnCall, row_json

    t, tok = cfg.task, policy.tokenizer
    env = f"{t.environment.key} = {t.environment.ref!r}"
    prompts = list(task.train_prompts()[:3])
    rows = [row_json(task.row_of(p)) for p in prompts]
    runner = EnvironmentRunner.of(t.environment, timeout_s=t.turns.timeout_s, tokenizer_dir=str(policy.path),
                                  use_chat=tok.use_chat, stop_ids=tuple(tok.stop_ids),
                                  plain_format=t.turns.plain_format,
                                  max_observation_tokens=t.turns.max_observation_tokens)
    calls = EnvironmentCalls(runner, workers=1, timeout_s=t.turns.timeout_s)
    try:
        names = [f"row {p.pid}" for p in prompts]
        first, again = calls.reset_all(rows, names), calls.reset_all(rows, names)
        for p, a, b in zip(prompts, first, again):
            if a != b:
                raise TaskCheckFailed(f"{env}: reset(row) of row {p.pid} gave {a!r}, "
                                      f"then {b!r}: an environment must be deterministic (seed it from the row)")
            print(f"environment {task.environment_class}: first observation of row {p.pid}: {a!r}", file=out)
        seen = []
        for n in range(2):
            o = calls.observe_all({n: TurnCall(f"check/{n}", 0, b"", rows[0], first[0])})[n]
            if o.status != "ok":
                raise TaskCheckFailed(f"{env}: step('') on row {prompts[0].pid} "
                                      f"failed ({o.status}): {o.error}")
            seen.append((tok.hf.decode(o.obs_ids, skip_special_tokens=False), o.reward, o.done))
    finally:
        calls.close()
    if seen[0] != seen[1]:
        raise TaskCheckFailed(f"{env}: step('') on row {prompts[0].pid} gave "
                              f"{seen[0]}, then {seen[1]}: an environment must be deterministic")
    obs, reward, done = seen[0]
    print(f"environment {task.environment_class}: step('') on row {prompts[0].pid}: reward {reward:g}, done {done}, "
          f"observation as the model sees it {obs!r}", file=out)


def _policy(cfg: Any):
    """The run's model and tokenizer (``model.path``, else the demo model converted once), as a run loads them."""
    from rlboost_hpc.models.hf_dir import load_model_dir
    from rlboost_hpc.models.llama2c import ensure_converted
    from rlboost_hpc.paths import using_data_dir

    with using_data_dir(cfg.data.dir):
        path = Path(cfg.model.path).expanduser() if cfg.model.path else ensure_converted(
            Path(cfg.model.cache_dir).expanduser())
        return load_model_dir(path, chat=cfg.task.chat_template)


def _check_procedural(cfg: Any, out) -> None:
    """A reasoning-gym task (``task.reasoning_gym``): its generator made (name and options checked), three prompts
    as the model will see them, the longest prompt against the context, and the scorer in the run's reward
    processes on the generator's own answers (inside ``answer_tag``: each must score 1) and on empty completions."""
    from rlboost_hpc.tasks.reward_pool import RewardPool
    from rlboost_hpc.tasks.user_task import make_task

    task, rg = make_task(cfg.task), cfg.task.reasoning_gym
    policy = _policy(cfg)
    print(f"reasoning-gym {rg.name}: {len(task.train_prompts())} train, {len(task.heldout_prompts())} held out "
          f"(seed {rg.seed}, options {rg.config})", file=out)
    for p in task.train_prompts()[:3]:
        print(f"--- prompt {p.pid}:\n{policy.tokenizer.render_prompt(task.prompt_ids(p, policy.tokenizer))}", file=out)
    n, worst = task.longest_prompt(policy.tokenizer)
    ctx, budget = policy.arch.max_position_embeddings, cfg.trajectory_tokens()
    print(f"longest prompt: {n} tokens (response budget {budget}, context {ctx})", file=out)
    if n + budget > ctx:
        raise TaskCheckFailed(f"prompt {worst.pid} is {n} tokens: with the response budget of {budget} it exceeds "
                              f"the model's context of {ctx}")
    prompts = task.train_prompts()[:TRY_ROWS]
    golds = [f"<{rg.answer_tag}>{p.meta['answer']}</{rg.answer_tag}>" if rg.answer_tag else p.meta["answer"]
             for p in prompts]
    with RewardPool(task, workers=1, timeout_s=cfg.task.rewards.timeout_s) as pool:
        scored = pool.score([(p, g) for p, g in zip(prompts, golds)] + [(p, "") for p in prompts])
    on_gold, on_empty = scored.rewards[:len(prompts)], scored.rewards[len(prompts):]
    print(f"reward (reasoning-gym's score_answer): gold answer {on_gold}, empty completion {on_empty}", file=out)
    if any(r != 1.0 for r in on_gold) or pool.failed:
        raise TaskCheckFailed(f"task.reasoning_gym: the generator's own answers scored {on_gold} ({pool.failed} "
                              f"failed), not 1 — check task.reasoning_gym.answer_tag = {rg.answer_tag!r}")
    print("task check: OK", file=out)


def check_task(cfg: Any, out=sys.stdout) -> None:
    """Run the checks of the module docstring on the run configuration ``cfg`` (a ``RunConfig``).

    Raises:
        BadInput: the first problem found (a :class:`TaskCheckFailed` or the loader's own error).
    """
    from rlboost_hpc.tasks.user_task import UserTask

    if cfg.task.kind == "reasoning_gym":
        return _check_procedural(cfg, out)
    if cfg.task.kind != "own":
        raise TaskCheckFailed("task check is for your own task: set task.data.path (and its rewards) or "
                              "task.reasoning_gym")
    cfg.task.rewards.errors = "fail"  # the first failure names its function and row
    policy = _policy(cfg)
    task = UserTask(cfg.task).load()
    try:
        _check_loaded(cfg, task, policy, out)
    finally:
        task.close()
    print("task check: OK", file=out)


def _check_loaded(cfg: Any, task: Any, policy: Any, out) -> None:
    from rlboost_hpc.tasks.reward_pool import RewardFunctionFailed, RewardPool

    if task.tool_schemas:
        print("tools:", json.dumps(task.tool_schemas, indent=1), file=out)
    print(f"rows: {len(task.table)} read into {task.table.path} ({task.table.duplicates} duplicates dropped); "
          f"train {len(task.train_prompts())}, held out {len(task.heldout_prompts())} (first of "
          f"{len(task.heldout_table) if task.heldout_table is not None else 'the drawn'} rows)", file=out)
    for p in list(task.train_prompts()[:3]):
        print(f"--- prompt {p.pid}:\n{policy.tokenizer.render_prompt(task.prompt_ids(p, policy.tokenizer))}", file=out)
    if task.environment_class:
        _check_environment(cfg, task, policy, out)
    _check_lengths(cfg, task, policy, out)
    secs = task.check_endpoint()
    if secs:
        print(f"reward model {cfg.task.rewards.model.url}: answered in {secs:.3f} s", file=out)
    with RewardPool(task, workers=cfg.task.rewards.workers, timeout_s=cfg.task.rewards.timeout_s) as pool:
        try:
            _check_rewards(task, pool, out)
        except RewardFunctionFailed as e:
            raise TaskCheckFailed(str(e)) from None


def task_main(argv: list[str]) -> int:
    """``rlboost-hpc task check --config X [--set K=V ...]``; returns the exit status (0, or raises BadInput)."""
    from rlboost_hpc.clihelp import DefaultsHelpFormatter
    from rlboost_hpc.config import load_config

    p = argparse.ArgumentParser(prog="rlboost-hpc task", description="Dry-run your own task before training: "
                                "data, prompts, prompt lengths, rewards, tools.", formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("check", help="check a task (exit 2 naming the column, function or row on any problem)",
                       formatter_class=DefaultsHelpFormatter)
    c.add_argument("--config", required=True, help="the run's TOML config (its [task] table is checked)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override (repeatable)")
    a = p.parse_args(argv)
    check_task(load_config(a.config, a.set))
    return 0
