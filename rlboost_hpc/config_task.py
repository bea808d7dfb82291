"""The ``[task]`` table of the run's configuration: a built-in task or your own (data set, reward functions, a reward
model behind HTTP, tools), and the strict base every table of the configuration uses.

Invariants: as for the whole configuration (``rlboost_hpc/config.py``), unknown keys are errors at every level and
every number carries its unit; the keys of your own task are checked against each other here (a reward without a
data set, tools without turns, weights that do not match the reward terms), their files and code when the task is
loaded (``rlboost_hpc/tasks/user_task.py``). :func:`anchor_task_paths` makes the task's file paths absolute —
from the working directory, else from the config file's directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["RewardModelCfg", "TaskCfg", "anchor_task_paths"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RewardModelCfg(_Strict):
    """``task.reward_model``: a reward model or LLM judge behind HTTP (called from the reward processes)."""

    url: str = Field(..., description=(
        "score: the scoring route (POST the body named by body -> {rewards} or SGLang's [{embedding}]); judge: an "
        "OpenAI-compatible chat completions URL (…/v1/chat/completions)"))
    kind: Literal["score", "judge"] = Field("judge", description="a raw scoring route or an LLM judge")
    body: Literal["openrlhf", "sglang"] = Field("openrlhf", description=(
        "score: the request the route reads — openrlhf: {prompts, completions, query, labels} (OpenRLHF's "
        "/get_reward); sglang: {text: [prompt + completion, ...]} (SGLang's /classify, a reward model served with "
        "--is-embedding)"))
    name: str = Field("reward_model", description="its name in metrics (rewards by function)")
    weight: float = Field(1.0, description="its weight (task.reward_weights' last entry wins when given)")
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


class TaskCfg(_Strict):
    """The RL task (prompt set + verifiable reward)."""

    name: str = Field("stories", description=(
        "the task: stories (the stories260K demo), gsm8k, gsm8k_tools (GSM8K with a calculator), math500"))
    train_prompts: int = Field(64, ge=1, description="prompts of the training set (the data frontier cycles them)")
    heldout_prompts: int = Field(32, ge=1, description="prompts of the held-out evaluation before and after training")
    chat_template: Literal["auto", "on", "off"] = Field("auto", description=(
        "render prompts through the tokenizer's chat template (one user message + generation prompt): auto = "
        "when the tokenizer has one (instruct models), on = require one, off = plain prompt text"))
    reward_timeout_s: float = Field(5.0, gt=0, description=(
        "deadline of one answer's reward, seconds: a reward past it (e.g. SymPy on a runaway expression) scores 0, "
        "is counted (rewards_timed_out) and its worker process is replaced"))
    reward_workers: int = Field(1, ge=1, description="processes that compute rewards (persistent across steps)")
    max_turns: int = Field(1, ge=1, description=(
        "assistant turns per trajectory: 1 = single-turn responses; > 1 = multi-turn tool use: a turn that ends "
        "with tool_call_close is a tool call, answered by the tool (in the trainer's allocation, never on a "
        "preemptible instance) with an observation the next turn continues from"))
    max_trajectory_tokens: int = Field(0, ge=0, description=(
        "tokens after the prompt in a trajectory, turns and observations together (0 = max_turns × "
        "rollout.max_new_tokens); rollout.max_new_tokens bounds each turn"))
    tool: Literal["calculator"] = Field("calculator", description=(
        "the tool of multi-turn tasks: calculator = arithmetic by the simpleeval library (never eval)"))
    tool_call_open: str = Field("<tool_call>", description=(
        "text that opens a tool call in an assistant turn (\"\" = the whole turn is the call); the payload is JSON "
        "{\"name\": \"calculator\", \"arguments\": {\"expression\": ...}} or the bare expression"))
    tool_call_close: str = Field("</tool_call>", min_length=1, description=(
        "text that ends a tool call and the turn: must be one token of the policy's tokenizer (a stop id of "
        "every turn); a turn that ends otherwise ends the trajectory"))
    tool_timeout_s: float = Field(5.0, gt=0, description=(
        "deadline of one tool call, seconds: past it the call's worker is killed and replaced, and the "
        "trajectory continues from an error observation (counted: environment_timeouts)"))
    tool_workers: int = Field(1, ge=1, description="processes that run tool calls (persistent across steps)")
    max_observation_tokens: int = Field(64, ge=1, description="a tool result longer than this many tokens is cut")
    tool_plain_format: str = Field("\nResult: {result}\n", description=(
        "the observation's text when prompts do not use a chat template ({result} is replaced); with a chat "
        "template, the observation is the template's rendering of a tool message"))
    # ---- your own task (README "Train on your own task"): prompts from a file, rewards, tools, a judge
    dataset: str | None = Field(None, description=(
        "your prompts: a JSON-lines, Parquet, JSON or CSV file, a datasets.save_to_disk directory, or a hub id "
        "(datasets.load_dataset); read once in the trainer's allocation into a memory-mapped Arrow file. Set: the "
        "task is yours (task.name only labels it)"))
    dataset_split: str = Field("train", description="the split of a save_to_disk DatasetDict or a hub data set")
    heldout_dataset: str | None = Field(None, description=(
        "held-out prompts (as task.dataset); unset: a seeded task.heldout_fraction of task.dataset's rows"))
    heldout_split: str = Field("test", description="the split of task.heldout_dataset (DatasetDict or hub)")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description=(
        "without task.heldout_dataset: the share of rows held out, drawn from each row's content hash and "
        "task.split_seed (an appended or reshuffled file keeps every row's side)"))
    split_seed: int = Field(0, description="seed of the held-out draw")
    prompt_field: str = Field("prompt", description=(
        "the column holding the prompt: a string, or a chat message list [{role, content}, ...] (TRL's "
        "conversational format, verl's prompt column); every other column travels to the reward"))
    system_prompt: str | None = Field(None, description=(
        "a system message put before every prompt (a message list that has one keeps its own)"))
    dataset_cache_dir: str = Field("~/.cache/rlboost-hpc/datasets", description=(
        "where the prepared (memory-mapped Arrow) copy of task.dataset is kept, one per file fingerprint"))
    reward_functions: list[str] = Field(default_factory=list, description=(
        "your reward functions, 'package.module:function' or 'path/file.py:function': TRL's batched "
        "fn(prompts, completions, completion_ids, **columns) -> list[float | None] or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (async def too); they run "
        "in the reward processes under task.reward_timeout_s per group"))
    reward_weights: list[float] | None = Field(None, description=(
        "one weight per reward function (then the reward model's, task.reward_model.weight); unset: 1 each"))
    reward_errors: Literal["skip", "fail"] = Field("skip", description=(
        "a reward component (function, reward model, environment) that raises, times out or returns a wrong length, "
        "NaN, a non-number or a value off its scale: skip = that GRPO group is left out of the step (its rewards are "
        "no rewards: counted per function and in responses_left_out, first failure logged with the row); fail = the "
        "run exits 1 naming the function"))

    @field_validator("reward_errors", mode="before")
    @classmethod
    def _reward_errors_zero(cls, v: Any) -> Any:
        if v == "zero":
            raise ValueError("'zero' is gone: it scored a failed component 0 and trained the group on the terms left "
                             "(their advantages re-normalised, a 0.1-weight term became a full ±1 advantage); use "
                             "'skip' (the group is left out of the step) or 'fail'")
        return v
    reward_model: RewardModelCfg | None = Field(None, description=(
        "a reward model or LLM judge behind HTTP, combined with the reward functions by weight"))
    tools: list[str] = Field(default_factory=list, description=(
        "your tools (multi-turn, task.max_turns > 1): plain Python functions 'module:function' / "
        "'file.py:function' whose type hints and docstring make the JSON schema the chat template gets (tools=); "
        "called in the tool processes under task.tool_timeout_s"))
    environment: str | None = Field(None, description=(
        "a stateful multi-turn environment (task.max_turns > 1), 'module:Class' / 'file.py:Class': reset(row) -> "
        "observation (appended to the prompt), step(assistant_turn) -> (observation, reward, done), one instance "
        "per trajectory in the tool processes; every assistant turn goes to step, its reward adds to the "
        "trajectory's (weight: task.reward_weights' last entry), done ends it. Must be deterministic: an instance "
        "is rebuilt by replaying the trajectory (a different answer stops the run)"))
    reasoning_gym: ReasoningGymCfg | None = Field(None, description=(
        "a procedural task of reasoning-gym: its generated questions, its own scorer as the reward (task.name "
        "only labels it)"))

    @model_validator(mode="after")
    def _own_task(self) -> "TaskCfg":
        if self.reasoning_gym is not None and (self.dataset or self.reward_functions or self.reward_model):
            raise ValueError("task.reasoning_gym brings its prompts and its reward: leave task.dataset, "
                             "task.reward_functions and task.reward_model unset")
        if self.reasoning_gym is not None and self.reasoning_gym.size <= self.heldout_prompts:
            raise ValueError(f"task.reasoning_gym.size = {self.reasoning_gym.size} leaves no training prompt after "
                             f"task.heldout_prompts = {self.heldout_prompts}")
        own = bool(self.reward_functions or self.reward_model or self.tools or self.environment)
        if own and not self.dataset:
            raise ValueError("task.reward_functions, task.reward_model, task.tools and task.environment need "
                             "task.dataset (your prompts)")
        if self.dataset and not (self.reward_functions or self.reward_model or self.environment):
            raise ValueError("task.dataset needs a reward: task.reward_functions, task.reward_model or "
                             "task.environment")
        n = len(self.reward_functions) + (self.reward_model is not None) + (self.environment is not None)
        if self.reward_weights is not None and len(self.reward_weights) != n:
            raise ValueError(f"task.reward_weights has {len(self.reward_weights)} weights for {n} reward terms "
                             "(the functions, then the reward model, then the environment)")
        if self.tools and self.max_turns == 1:
            raise ValueError("task.tools are multi-turn: set task.max_turns > 1")
        if self.environment and self.max_turns == 1:
            raise ValueError("task.environment is multi-turn: set task.max_turns > 1")
        if self.environment and self.tools:
            raise ValueError("task.environment answers every assistant turn itself: leave task.tools empty (call "
                             "your tools from the environment's step)")
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


def anchor_task_paths(data: dict[str, Any], base: Path | None) -> None:
    """Make ``task.dataset``, ``task.heldout_dataset`` and the files of ``task.environment``, ``task.reward_functions``
    and ``task.tools`` absolute (:func:`_anchored`), so a config beside its data works from any directory and the run directory records
    where they were."""
    task = data.get("task")
    if not isinstance(task, dict):
        return
    for k in ("dataset", "heldout_dataset", "environment"):
        if isinstance(task.get(k), str):
            task[k] = _anchored(task[k], base)
    for k in ("reward_functions", "tools"):
        if isinstance(task.get(k), list):
            task[k] = [_anchored(v, base) if isinstance(v, str) else v for v in task[k]]
