"""The ``[task]`` table of the run's configuration: a built-in task, a procedural one or your own, and the strict base
every table of the configuration uses.

Layout: ``task.kind`` (builtin, own, reasoning_gym; inferred from the tables given) and four tables of your own task —
``task.data`` (the prompts), ``task.rewards`` (functions, a reward model behind HTTP, weights, deadline, processes,
what a failure means), ``task.turns`` (multi-turn: turns, tools, tool-call syntax, their processes) and
``task.environment`` (a stateful environment). The flat keys of earlier releases (``task.dataset``,
``task.reward_functions``, ``task.max_turns``, …: :data:`MOVED_TASK_KEYS`) are still read, moved to their places: a
config file's and ``--set``'s by :func:`~rlboost_hpc.config.load_config` (one WARNING line per source, naming old and
new), a table given in code by :class:`TaskCfg` itself (a :class:`ConfigKeysMoved` warning).

Invariants: as for the whole configuration (``rlboost_hpc/config.py``), unknown keys are errors at every level and
every number carries its unit; the keys of your own task are checked against each other here (a reward without a
data set, tools without turns, weights that do not match the reward terms), their files and code when the task is
loaded (``rlboost_hpc/tasks/user_task.py``). :func:`anchor_task_paths` makes the task's file paths absolute —
from the working directory, else from the config file's directory.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("rlboost.config")

__all__ = ["ConfigKeysMoved", "EnvironmentCfg", "MOVED_TASK_KEYS", "OpenEnvCfg", "ReasoningGymCfg", "RewardModelCfg",
           "TaskCfg", "TaskDataCfg", "TaskRewardsCfg", "TaskTurnsCfg", "anchor_task_paths", "current_task_key",
           "move_flat_task_keys", "moved_task_overrides",
           "read_moved_task_keys"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RewardModelCfg(_Strict):
    """``task.rewards.model``: a reward model or LLM judge behind HTTP (called from the reward processes)."""

    url: str = Field(..., description=(
        "score: the scoring route (POST the body named by body -> {rewards} or SGLang's [{embedding}]); judge: an "
        "OpenAI-compatible chat completions URL (…/v1/chat/completions)"))
    kind: Literal["score", "judge"] = Field("judge", description="a raw scoring route or an LLM judge")
    body: Literal["openrlhf", "sglang"] = Field("openrlhf", description=(
        "score: the request the route reads — openrlhf: {prompts, completions, query, labels} (OpenRLHF's "
        "/get_reward); sglang: {text: [prompt + completion, ...]} (SGLang's /classify, a reward model served with "
        "--is-embedding)"))
    name: str = Field("reward_model", description="its name in metrics (rewards by function)")
    weight: float = Field(1.0, description="its weight (its entry of task.rewards.weights wins when given)")
    model: str = Field("", description="the model name sent in the request")
    api_key_env: str | None = Field(None, description=(
        "environment variable holding the API key (sent as Authorization: Bearer); never put the key in the config"))
    prompt_template: str = Field(
        "You grade a model's answer.\nTask:\n{prompt}\n\nAnswer:\n{completion}\n\nReply with one line: "
        "'Score: <number from 0 to 1>'.", description=(
            "judge: the request's user message; {prompt}, {completion} and the row's columns are filled in"))
    score_pattern: str = Field(r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?![\d.])", description=(
        "judge: regular expression whose first group is the verdict's number; the reply's LAST match is the verdict "
        "(a score the graded answer planted and the judge quoted comes before it)"))
    score_min: float = Field(0.0, description=(
        "the low end of the declared scale: judge: the verdict's scale (its value maps to 0); score: the lowest "
        "score the route may answer. A value outside [score_min, score_max] is a failed call, never a reward"))
    score_max: float = Field(1.0, description=(
        "the high end of the declared scale: judge: the verdict's scale (its value maps to 1); score: the highest "
        "score the route may answer (set the range your reward model's scores take)"))
    max_tokens: int = Field(64, ge=1, description="judge: max_tokens of the request")
    timeout_s: float = Field(30.0, gt=0, description="deadline of one HTTP request (s)")
    retries: int = Field(3, ge=0, description="retries (exponential backoff, full jitter) on connection errors, "
                                              "deadlines, HTTP 429 and 5xx")
    concurrency: int = Field(8, ge=1, description="judge: requests in flight per group")

    @model_validator(mode="after")
    def _scale(self) -> "RewardModelCfg":
        if not self.score_min < self.score_max:
            raise ValueError(f"score_min = {self.score_min:g} must be below score_max = {self.score_max:g} (the "
                             "declared scale of the reward model's answers)")
        return self


class ReasoningGymCfg(_Strict):
    """``task.reasoning_gym``: a procedural task of reasoning-gym (``pip install 'rlboost-hpc[reasoning-gym]'``),
    scored by its own ``score_answer``."""

    name: str = Field(..., description="the reasoning-gym data set (e.g. basic_arithmetic, chain_sum, leg_counting)")
    size: int = Field(1000, ge=2, description="entries generated: the last task.heldout_prompts are held out")
    seed: int = Field(42, description="the generator's seed (the same entries on every start)")
    config: dict[str, Any] = Field(default_factory=dict, description=(
        "the data set's own options (its config class's fields, e.g. { min_terms = 2, max_terms = 4 })"))
    answer_tag: str = Field("answer", description=(
        "the answer is what the completion writes inside <answer_tag>…</answer_tag> (reasoning-gym's convention; "
        "the prompt asks for it); \"\": the whole completion"))


class TaskDataCfg(_Strict):
    """``task.data``: your prompts (set ``path``: the task is yours)."""

    path: str | None = Field(None, description=(
        "your prompts: a JSON-lines, Parquet, JSON or CSV file, a datasets.save_to_disk directory, or a hub id "
        "(datasets.load_dataset); read once in the trainer's allocation into a memory-mapped Arrow file. Set: the "
        "task is yours (task.name only labels it)"))
    split: str = Field("train", description="the split of a save_to_disk DatasetDict or a hub data set")
    heldout_path: str | None = Field(None, description=(
        "held-out prompts (as task.data.path); unset: a seeded task.data.heldout_fraction of task.data.path's rows"))
    heldout_split: str = Field("test", description="the split of task.data.heldout_path (DatasetDict or hub)")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description=(
        "without task.data.heldout_path: the share of rows held out, drawn from each row's content hash and "
        "task.data.split_seed (an appended or reshuffled file keeps every row's side)"))
    split_seed: int = Field(0, description="seed of the held-out draw")
    prompt_field: str = Field("prompt", description=(
        "the column holding the prompt: a string, or a chat message list [{role, content}, ...] (TRL's "
        "conversational format, verl's prompt column); every other column travels to the reward"))
    system_prompt: str | None = Field(None, description=(
        "a system message put before every prompt (a message list that has one keeps its own)"))
    cache_dir: str = Field("~/.cache/rlboost-hpc/datasets", description=(
        "where the prepared (memory-mapped Arrow) copy of task.data.path is kept, one per file fingerprint"))


class TaskRewardsCfg(_Strict):
    """``task.rewards``: how a response is scored — your functions and a reward model, their weights, deadline,
    processes and what a failed one means."""

    functions: list[str] = Field(default_factory=list, description=(
        "your reward functions, 'package.module:function' or 'path/file.py:function': TRL's batched "
        "fn(prompts, completions, completion_ids, **columns) -> list[float | None] or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (async def too); they run "
        "in the reward processes under task.rewards.timeout_s per group"))
    weights: list[float] | None = Field(None, description=(
        "one weight per reward term: the functions, then the reward model, then the environment; unset: 1 each "
        "(0: a task metric, logged and evaluated, never trained on)"))
    errors: Literal["skip", "fail"] = Field("skip", description=(
        "a reward component (function, reward model, environment) that raises, times out or returns a wrong length, "
        "NaN, a non-number or a value off its scale: skip = that GRPO group is left out of the step (its rewards are "
        "no rewards: counted per function and in responses_left_out, first failure logged with the row); fail = the "
        "run exits 1 naming the function"))
    timeout_s: float = Field(5.0, gt=0, description=(
        "deadline of one answer's reward, seconds: a reward past it (e.g. SymPy on a runaway expression) scores 0, "
        "is counted (rewards_timed_out) and its worker process is replaced"))
    workers: int = Field(1, ge=1, description="processes that compute rewards (persistent across steps)")
    model: RewardModelCfg | None = Field(None, description=(
        "a reward model or LLM judge behind HTTP, combined with the reward functions by weight"))

    @field_validator("errors", mode="before")
    @classmethod
    def _errors_zero(cls, v: Any) -> Any:
        if v == "zero":
            raise ValueError("'zero' is gone: it scored a failed component 0 and trained the group on the terms left "
                             "(their advantages re-normalised, a 0.1-weight term became a full ±1 advantage); use "
                             "'skip' (the group is left out of the step) or 'fail'")
        return v


class TaskTurnsCfg(_Strict):
    """``task.turns``: multi-turn trajectories — how many assistant turns, the tool-call syntax, the tools and the
    processes that answer a turn (tools or an environment)."""

    max: int = Field(1, ge=1, description=(
        "assistant turns per trajectory: 1 = single-turn responses; > 1 = multi-turn tool use: a turn that ends "
        "with tool_call_close is a tool call, answered by the tool (in the trainer's allocation, never on a "
        "preemptible instance) with an observation the next turn continues from"))
    max_tokens: int = Field(0, ge=0, description=(
        "tokens after the prompt in a trajectory, turns and observations together (0 = task.turns.max × "
        "rollout.max_new_tokens); rollout.max_new_tokens bounds each turn"))
    tool: Literal["calculator"] = Field("calculator", description=(
        "the tool of the built-in multi-turn tasks: calculator = arithmetic by the simpleeval library (never eval)"))
    tools: list[str] = Field(default_factory=list, description=(
        "your tools (task.turns.max > 1): plain Python functions 'module:function' / 'file.py:function' whose type "
        "hints and docstring make the JSON schema the chat template gets (tools=); called in the tool processes "
        "under task.turns.timeout_s"))
    tool_call_open: str = Field("<tool_call>", description=(
        "text that opens a tool call in an assistant turn (\"\" = the whole turn is the call); the payload is JSON "
        "{\"name\": \"calculator\", \"arguments\": {\"expression\": ...}} or the bare expression"))
    tool_call_close: str = Field("</tool_call>", min_length=1, description=(
        "text that ends a tool call and the turn: must be one token of the policy's tokenizer (a stop id of "
        "every turn); a turn that ends otherwise ends the trajectory"))
    timeout_s: float = Field(5.0, gt=0, description=(
        "deadline of one tool call or environment step, seconds: past it the call's worker is killed and replaced, "
        "and the trajectory continues from an error observation (counted: environment_timeouts)"))
    workers: int = Field(1, ge=1, description="processes that run tool calls and environments (persistent)")
    max_observation_tokens: int = Field(64, ge=1, description="a tool result longer than this many tokens is cut")
    plain_format: str = Field("\nResult: {result}\n", description=(
        "the observation's text when prompts do not use a chat template ({result} is replaced); with a chat "
        "template, the observation is the template's rendering of a tool message"))


class OpenEnvCfg(_Strict):
    """``task.environment.openenv``: an OpenEnv server's environment, one WebSocket session per trajectory
    (``rlboost_hpc/tasks/openenv.py``)."""

    url: str = Field(..., pattern=r"^(https?|wss?)://[^/\s]+", description=(
        "the OpenEnv server (http://host:port, as its client takes it); each trajectory opens a session on <url>/ws "
        "from the manager's tool processes in the trainer's allocation"))
    action_field: str = Field("message", min_length=1, description=(
        "the field of the environment's Action that carries the assistant turn's text"))
    observation_field: str | None = Field(None, description=(
        "the field of the observation whose text is shown to the model; unset: the observation as JSON (reward, "
        "done and metadata left out)"))
    reset_columns: list[str] = Field(default_factory=list, description=(
        "columns of the prompt's row passed to the server's reset as keyword arguments (beside seed, a stable "
        "function of the row)"))
    connect_timeout_s: float = Field(10.0, gt=0, description="deadline of opening a session, seconds")
    retries: int = Field(2, ge=0, le=10, description=(
        "a session the server or the network dropped is reopened (replayed from reset) this many times per call"))
    backoff_s: float = Field(0.5, ge=0, description="wait before the n-th reopening: n × backoff_s seconds")


class EnvironmentCfg(_Strict):
    """``task.environment``: a stateful multi-turn environment — a class of your own (``class_path``) or an OpenEnv
    server (``openenv``); exactly one."""

    class_path: str | None = Field(None, min_length=1, description=(
        "'module:Class' / 'file.py:Class': reset(row) -> observation (appended to the prompt), "
        "step(assistant_turn) -> (observation, reward, done), one instance per trajectory in the tool processes; "
        "every assistant turn goes to step, its reward adds to the trajectory's (weight: task.rewards.weights' last "
        "entry), done ends it. Must be deterministic: an instance is rebuilt by replaying the trajectory (a "
        "different answer stops the run)"))
    openenv: OpenEnvCfg | None = Field(None, description=(
        "an OpenEnv server instead of a class: reset and step over its WebSocket session, its reward the "
        "environment's term"))
    reward_range: tuple[float, float] | None = Field(None, description=(
        "[low, high] of one step's reward: a step answering outside it is an environment error (counted, its "
        "trajectory ended; task.rewards.errors decides), never a reward; unset: any finite number"))

    @model_validator(mode="after")
    def _one_source(self) -> "EnvironmentCfg":
        if (self.class_path is None) == (self.openenv is None):
            raise ValueError("task.environment: give exactly one of class_path (a class of your own) and openenv "
                             "(an OpenEnv server)")
        if self.reward_range is not None and not self.reward_range[0] < self.reward_range[1]:
            raise ValueError(f"task.environment.reward_range = {list(self.reward_range)}: low must be below high")
        return self

    @property
    def key(self) -> str:
        """The key that names this environment in messages: ``task.environment.class_path`` or
        ``task.environment.openenv.url``."""
        return "task.environment.class_path" if self.class_path else "task.environment.openenv.url"

    @property
    def ref(self) -> str:
        """What the environment is, for messages: the class path, or the OpenEnv server's URL."""
        return self.class_path or self.openenv.url  # type: ignore[union-attr]


#: The flat ``[task]`` keys of earlier releases → where each lives now (under ``task.``). A config that uses an old
#: key is still read, the key moved to its new place, with a warning naming both (:func:`move_flat_task_keys`).
MOVED_TASK_KEYS: dict[str, str] = {
    "dataset": "data.path", "dataset_split": "data.split", "heldout_dataset": "data.heldout_path",
    "heldout_split": "data.heldout_split", "heldout_fraction": "data.heldout_fraction",
    "split_seed": "data.split_seed", "prompt_field": "data.prompt_field", "system_prompt": "data.system_prompt",
    "dataset_cache_dir": "data.cache_dir",
    "reward_functions": "rewards.functions", "reward_weights": "rewards.weights", "reward_errors": "rewards.errors",
    "reward_timeout_s": "rewards.timeout_s", "reward_workers": "rewards.workers", "reward_model": "rewards.model",
    "max_turns": "turns.max", "max_trajectory_tokens": "turns.max_tokens", "tool": "turns.tool",
    "tools": "turns.tools", "tool_call_open": "turns.tool_call_open", "tool_call_close": "turns.tool_call_close",
    "tool_timeout_s": "turns.timeout_s", "tool_workers": "turns.workers",
    "max_observation_tokens": "turns.max_observation_tokens", "tool_plain_format": "turns.plain_format",
}


def current_task_key(key: str) -> str:
    """``key`` (a dotted key such as ``task.dataset`` or ``task.reward_model.url``) under its name of this layout
    (``task.data.path``, ``task.rewards.model.url``); any other key unchanged. For keys written by earlier releases
    (a checkpoint's data-set fingerprints, ``--set`` overrides)."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] == "task" and parts[1] in MOVED_TASK_KEYS:
        return ".".join(["task", MOVED_TASK_KEYS[parts[1]], *parts[2:]])
    return key


def read_moved_task_keys(data: dict[str, Any], where: str) -> None:
    """Move the ``[task]`` keys of the earlier layout in a config file's raw ``data`` to their places
    (:func:`move_flat_task_keys`) — before the ``--set`` overrides apply, so an override of the new name overrides
    them — and say so once, as a WARNING line of logger ``rlboost.config`` naming the file (``where``) and each
    old → new. A key given under both names is left for the validation to refuse (naming where it came from)."""
    task = data.get("task")
    if not isinstance(task, dict):
        return
    try:
        moves = move_flat_task_keys(task)
    except ValueError:
        return
    if moves:
        log.warning("%s uses keys of the earlier [task] layout, read under their new names (rename them): %s", where,
                    "; ".join(moves))


def moved_task_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` (``key=value`` of ``--set``) with each key of the earlier ``[task]`` layout written under its
    new name (``task.max_turns=3`` → ``task.turns.max=3``; ``task.reward_model.url=…`` → ``task.rewards.model.url=…``;
    a string ``task.environment`` → ``task.environment.class_path``), said once as a WARNING line of logger
    ``rlboost.config``. Others unchanged."""
    out, moves = [], []
    for item in overrides:
        key, eq, value = item.partition("=")
        key = key.strip()
        new = current_task_key(key)
        if key == "task.environment" and eq and not value.strip().startswith("{"):
            new = "task.environment.class_path"
        if new == key:
            out.append(item)
            continue
        moves.append(f"{key} → {new}")
        out.append(f"{new}{eq}{value}")
    if moves:
        log.warning("--set keys of the earlier [task] layout, read under their new names (rename them): %s",
                    "; ".join(moves))
    return out


class ConfigKeysMoved(FutureWarning):
    """A configuration used keys of an earlier layout; they were read under their new names (the message lists
    each old → new)."""


def move_flat_task_keys(task: dict[str, Any]) -> list[str]:
    """Move the earlier layout's keys of a raw ``[task]`` table (:data:`MOVED_TASK_KEYS`; ``environment`` given as
    a string is ``environment.class_path``) to their places, in place. Returns ``"task.old → task.new"`` per move.

    Raises:
        ValueError: a key given under its old and its new name both; an old key written as a table
            (``[task.dataset]``); a new table that is no table.
    """
    moves = [(old, new) for old, new in MOVED_TASK_KEYS.items() if old in task]
    if isinstance(task.get("environment"), str):
        task["environment"] = {"class_path": task["environment"]}
        moves_env = ["task.environment = '…' → task.environment.class_path"]
    else:
        moves_env = []
    for old, new in moves:
        table, key = new.split(".")
        if isinstance(task[old], dict) and new != "rewards.model":
            raise ValueError(f"[task.{old}] is no table: task.{old} was the earlier layout's key that is now "
                             f"task.{new} (its table is [task.{table}])")
        sub = task.setdefault(table, {})
        if not isinstance(sub, dict):
            raise ValueError(f"task.{table} must be a table (task.{old} is now task.{new})")
        if key in sub:
            raise ValueError(f"task.{old} and task.{new} are the same key (its old and new name): give task.{new}")
        sub[key] = task.pop(old)
    return [f"task.{old} → task.{new}" for old, new in moves] + moves_env


class TaskCfg(_Strict):
    """The RL task: a built-in one (``task.name``), a procedural one (``task.reasoning_gym``) or your own
    (``task.data.path`` with ``task.rewards``, ``task.turns``, ``task.environment``). ``kind`` says which; it is
    inferred from the keys given, and a given one must agree with them."""

    kind: Literal["builtin", "own", "reasoning_gym"] = Field("builtin", description=(
        "which task this is: builtin (task.name), own (task.data.path: your prompts, rewards, tools or "
        "environment), reasoning_gym (task.reasoning_gym); inferred when unset"))
    name: str = Field("stories", description=(
        "the task: stories (the stories260K demo), gsm8k, gsm8k_tools (GSM8K with a calculator), math500; for your "
        "own or a procedural task, its label"))
    train_prompts: int = Field(64, ge=1, description="prompts of the training set (the data frontier cycles them)")
    heldout_prompts: int = Field(32, ge=1, description="prompts of the held-out evaluation before and after training")
    chat_template: Literal["auto", "on", "off"] = Field("auto", description=(
        "render prompts through the tokenizer's chat template (one user message + generation prompt): auto = "
        "when the tokenizer has one (instruct models), on = require one, off = plain prompt text"))
    data: TaskDataCfg = Field(TaskDataCfg(), description="your prompts (task.data.path set: the task is yours)")
    rewards: TaskRewardsCfg = Field(TaskRewardsCfg(), description=(
        "your reward functions and reward model, their weights, deadline and processes (the built-in tasks' "
        "deadline and processes too)"))
    turns: TaskTurnsCfg = Field(TaskTurnsCfg(), description="multi-turn trajectories: turns, tools, tool-call syntax")
    environment: EnvironmentCfg | None = Field(None, description=(
        "a stateful multi-turn environment of your own (task.turns.max > 1)"))
    reasoning_gym: ReasoningGymCfg | None = Field(None, description=(
        "a procedural task of reasoning-gym: its generated questions, its own scorer as the reward (task.name "
        "only labels it)"))

    @model_validator(mode="before")
    @classmethod
    def _layout(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        moves = move_flat_task_keys(data)
        if moves:
            warnings.warn("configuration keys of the earlier layout, read under their new names: " + "; ".join(moves),
                          ConfigKeysMoved, stacklevel=2)
        if "kind" not in data:
            d = data.get("data")
            path = d.get("path") if isinstance(d, dict) else getattr(d, "path", None)  # (a TaskDataCfg given)
            data["kind"] = "own" if path else "reasoning_gym" if data.get("reasoning_gym") is not None else "builtin"
        return data

    @model_validator(mode="after")
    def _own_task(self) -> "TaskCfg":
        r, turns = self.rewards, self.turns
        own = bool(r.functions or r.model or turns.tools or self.environment)
        if self.kind == "reasoning_gym":
            if self.reasoning_gym is None:
                raise ValueError("task.kind = reasoning_gym needs task.reasoning_gym (its data set's name)")
            if self.data.path or r.functions or r.model:
                raise ValueError("task.reasoning_gym brings its prompts and its reward: leave task.data.path, "
                                 "task.rewards.functions and task.rewards.model unset")
            if self.reasoning_gym.size <= self.heldout_prompts:
                raise ValueError(f"task.reasoning_gym.size = {self.reasoning_gym.size} leaves no training prompt "
                                 f"after task.heldout_prompts = {self.heldout_prompts}")
        elif self.reasoning_gym is not None:
            raise ValueError(f"task.reasoning_gym is set but task.kind = {self.kind}")
        if self.kind == "own" and not self.data.path:
            raise ValueError("task.kind = own needs task.data.path (your prompts)")
        if self.kind != "own" and self.data.path:
            raise ValueError(f"task.data.path is set but task.kind = {self.kind}")
        if own and self.kind != "own":
            raise ValueError("task.rewards.functions, task.rewards.model, task.turns.tools and task.environment need "
                             "task.data.path (your prompts)")
        if self.kind == "own" and not (r.functions or r.model or self.environment):
            raise ValueError("task.data.path needs a reward: task.rewards.functions, task.rewards.model or "
                             "task.environment")
        n = len(r.functions) + (r.model is not None) + (self.environment is not None)
        if r.weights is not None and len(r.weights) != n:
            raise ValueError(f"task.rewards.weights has {len(r.weights)} weight(s) for {n} reward terms "
                             "(the functions, then the reward model, then the environment)")
        if turns.tools and turns.max == 1:
            raise ValueError("task.turns.tools are multi-turn: set task.turns.max > 1")
        if self.environment and turns.max == 1:
            raise ValueError("task.environment is multi-turn: set task.turns.max > 1")
        if self.environment and turns.tools:
            raise ValueError("task.environment answers every assistant turn itself: leave task.turns.tools empty "
                             "(call your tools from the environment's step)")
        return self


def _anchored(value: str, base: Path | None) -> str:
    """``value`` (a path, or the file part of ``file.py:name``) made absolute: taken from the working directory when
    it exists there, else from ``base`` (the config file's directory) when it exists there; else unchanged."""
    where, sep, name = value.rpartition(":") if value.rpartition(":")[0].endswith(".py") else (value, "", "")
    p = Path(where).expanduser()
    if p.is_absolute():
        return value
    for root in (Path.cwd(), base):
        if root is not None and (root / p).exists():
            return str((root / p).resolve()) + sep + name
    return value


#: Where a raw ``[task]`` table holds file paths: (sub-table, key) (the earlier layout's keys are moved before).
_PATH_KEYS = (("data", "path"), ("data", "heldout_path"), ("environment", "class_path"), ("rewards", "functions"),
              ("turns", "tools"))


def anchor_task_paths(data: dict[str, Any], base: Path | None) -> None:
    """Make ``task.data.path``, ``task.data.heldout_path`` and the files of ``task.environment``,
    ``task.rewards.functions`` and ``task.turns.tools`` absolute
    (:func:`_anchored`), so a config beside its data works from any directory and the run directory records where
    they were."""
    task = data.get("task")
    if not isinstance(task, dict):
        return
    for table, k in _PATH_KEYS:
        node = task.get(table)
        if not isinstance(node, dict):
            continue
        if isinstance(node.get(k), str):
            node[k] = _anchored(node[k], base)
        elif isinstance(node.get(k), list):
            node[k] = [_anchored(v, base) if isinstance(v, str) else v for v in node[k]]
