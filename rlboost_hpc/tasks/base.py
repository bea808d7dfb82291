"""Tasks: the prompts a run trains and evaluates on, and the reward of a response.

Invariants every task honours (tested per task in ``tests/test_tasks.py``):
- Prompts are data: a :class:`Prompt` is a frozen record with a stable, unique ``pid`` (the same prompt has
  the same id in every process and every run) and a ``meta`` dict of plain JSON values (the gold answer
  lives there), so a prompt can cross a process boundary and its reward be computed anywhere.
- Splits are deterministic and disjoint: :meth:`Task.train_prompts` and :meth:`Task.heldout_prompts`
  return the same lists on every call and in every process, and no ``pid`` is in both.
- The reward is a pure function: :meth:`Task.reward` depends only on ``(prompt, response_text)``, returns a
  float in ``[0, 1]``, never raises on any response text (malformed model output scores 0), touches no
  file, and works in any thread (no signal-based timeouts).
- ``response_text`` is the decoded *new* text only (no prompt, stop token excluded); stripping the stop
  token is the caller's job.
- Task names are resolved through one registry, :func:`get_task`; an unknown name or option is a
  ``ValueError`` that lists what is accepted.
"""
from __future__ import annotations

import abc
import importlib
import inspect
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

__all__ = ["Prompt", "Scored", "Task", "get_task", "register_task", "known_tasks"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    pid: stable unique id (e.g. ``"gsm8k/test/17"``); equal across processes and runs.
    text: the raw prompt content (a story opening, a question); :meth:`Task.format_prompt` turns it into
        the text given to the tokenizer.
    meta: plain JSON-serialisable values the reward needs (e.g. ``{"answer": "18"}``).
    messages: a chat prompt (a user's data set whose prompt column is a message list ``[{role, content}, ...]``);
        ``None`` for a text prompt. ``text`` is then its last user message (for display).
    """

    pid: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None


class Scored(NamedTuple):
    """What scoring ``n`` answers gives, for every task alike: ``rewards`` (n floats, each the weighted sum of its
    components' values), ``parts`` (component name → n values, ``None`` where the component gave none — it does not
    apply, or it failed; empty for a task whose :meth:`~rlboost_hpc.tasks.base.Task.reward` is its one component) and
    ``failed`` (n flags: a component failed on that answer — its reward is not a reward, and its GRPO group is left
    out of the step; empty: none failed)."""

    rewards: list[float]
    parts: dict[str, list[float | None]]
    failed: tuple[bool, ...] = ()


class Task(abc.ABC):
    """A task: two fixed prompt splits and a verifiable reward.

    Subclasses set :attr:`name` and implement :meth:`train_prompts`, :meth:`heldout_prompts` and
    :meth:`reward`; they may override :meth:`format_prompt` (identity by default) and
    :attr:`stop_strings` (none by default).

    The contract the run holds a task to is this class: every capability the run uses is declared here with its
    default (no caller probes a task with ``hasattr``): :attr:`components` and :attr:`reward_errors` (how the reward
    pool scores), :meth:`longest_prompt` and :meth:`length_check_prompts` (the context check),
    :meth:`check_endpoint` (an outside scorer checked before anything starts), :meth:`fingerprints` and
    :meth:`data_source` (what a checkpoint records and names), :meth:`environment_of` (a stateful environment),
    :meth:`close` (what the task started), and :attr:`takes_tool_syntax` (the task is built with the run's tool-call
    syntax, :func:`get_task`).
    """

    #: registry name of the task (e.g. ``"stories"``).
    name: str = ""
    #: strings that end a response when generated (in addition to the engine's stop token ids);
    #: empty when the task has none.
    stop_strings: tuple[str, ...] = ()
    #: the shared data files the task reads (paths under the data directory, ``rlboost_hpc.paths.data_file``):
    #: checked before a run loads anything heavy (:func:`task_data_files`).
    data_files: tuple[str, ...] = ()
    #: the task tells the policy how to call its tool, in the run's syntax: it is built with ``tool_syntax=`` (a
    #: :class:`~rlboost_hpc.tasks.tools.ToolSyntax` of ``task.turns.tool_call_open`` / ``task.turns.tool_call_close``).
    takes_tool_syntax: ClassVar[bool] = False
    #: the reward's components, each scored on its own with its own deadline (a user's task: its functions, reward
    #: model and environment, :class:`~rlboost_hpc.tasks.user_rewards.RewardComponent`); empty: :meth:`reward` is
    #: the one component.
    components: Sequence[Any] = ()
    #: what a failed component does (``task.rewards.errors``): ``"skip"`` (counted, its group left out of the step)
    #: or ``"fail"`` (the run stops naming it).
    reward_errors: Literal["skip", "fail"] = "skip"

    @abc.abstractmethod
    def train_prompts(self) -> list[Prompt]:
        """The training split: the same list (order included) on every call; a fresh list object."""

    @abc.abstractmethod
    def heldout_prompts(self) -> list[Prompt]:
        """The held-out split, disjoint from :meth:`train_prompts`; deterministic like it."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, response_text: str) -> float:
        """Reward of ``response_text`` (new text only, stop token excluded) for ``prompt``.

        Pure and deterministic, in ``[0, 1]``; never raises on model output (only on a prompt that is
        not this task's, e.g. a missing gold answer: ``ValueError``).
        """

    def format_prompt(self, prompt: Prompt) -> str:
        """The plain-text prompt given to the tokenizer for ``prompt`` (BOS is the tokenizer's business)."""
        return prompt.text

    def chat_content(self, prompt: Prompt) -> str:
        """The user message for ``prompt`` when the model's chat template is used (instruct models)."""
        return prompt.text

    def prompt_ids(self, prompt: Prompt, tokenizer) -> list[int]:
        """The token ids a rollout starts from: the chat template applied to :meth:`chat_content` when
        ``tokenizer.use_chat`` (the standard RLVR setup for instruct models), else :meth:`format_prompt` encoded
        with the tokenizer's own special tokens. ``tokenizer``: a
        :class:`~rlboost_hpc.models.hf_dir.PolicyTokenizer` (anything with ``use_chat``, ``encode_chat``,
        ``encode_text``). Every component that builds prompts calls this one method."""
        if tokenizer.use_chat:
            return tokenizer.encode_chat(self.chat_content(prompt))
        return tokenizer.encode_text(self.format_prompt(prompt))

    def environment_of(self, prompt: Prompt) -> tuple[str, str] | None:
        """A task with a stateful environment (``task.environment``): ``(the prompt's row as JSON, the observation its
        ``reset(row)`` gave)``, what every trajectory of the prompt's groups starts from; None (the default): the
        task has none."""
        return None

    def length_check_prompts(self) -> Sequence[Prompt]:
        """The prompts whose token counts bound the run's context (the longest prompt plus the response budget must
        fit the model): by default every prompt of both splits."""
        return list(self.train_prompts()) + self.heldout_prompts()

    def longest_prompt(self, tokenizer) -> tuple[int, Prompt]:
        """``(tokens, prompt)`` of the longest of :meth:`length_check_prompts` as :meth:`prompt_ids` renders them with
        ``tokenizer`` — what the run's context check takes (every prompt of a built-in task)."""
        return max(((len(self.prompt_ids(p, tokenizer)), p) for p in self.length_check_prompts()), key=lambda x: x[0])

    def check_endpoint(self) -> float:
        """Call each outside scorer once (a reward model's endpoint) before anything heavy starts; the seconds it
        took (0.0: the task has none).

        Raises:
            BadInput: an endpoint unreachable or answering wrongly (the key and the cause named).
        """
        return 0.0

    def fingerprints(self) -> dict[str, str]:
        """Config key → fingerprint of each data set the task read (what a checkpoint records and a resume checks);
        empty for a task whose prompts are built in."""
        return {}

    def data_source(self, key: str) -> str | None:
        """The file or data set id configured under ``key`` (a key of :meth:`fingerprints`); None if unknown."""
        return None

    def close(self) -> None:
        """Stop what the task started (a stateful environment's reset process); idempotent. Nothing by default."""

    def prompts(self, split: Literal["train", "heldout"]) -> list[Prompt]:
        """:meth:`train_prompts` or :meth:`heldout_prompts` by name.

        Raises:
            ValueError: ``split`` is neither ``"train"`` nor ``"heldout"``.
        """
        if split == "train":
            return self.train_prompts()
        if split == "heldout":
            return self.heldout_prompts()
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# name -> "module:Class" (imported on first use, so importing this module stays cheap) or a Task class.
_REGISTRY: dict[str, str | type[Task]] = {
    "stories": "rlboost_hpc.tasks.stories:StoryQuoteTask",
    "gsm8k": "rlboost_hpc.tasks.math:GSM8KTask",
    "gsm8k_tools": "rlboost_hpc.tasks.math:GSM8KToolTask",
    "math500": "rlboost_hpc.tasks.math:Math500Task",
}


def strip_stop(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """Response token ids without a trailing stop token (one of ``stop_ids``): what a reward reads is the text
    the model wrote, not its end-of-sequence marker."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def register_task(name: str, cls: type[Task] | str) -> None:
    """Register ``cls`` (a :class:`Task` subclass or a ``"module:Class"`` string) under ``name``.

    Raises:
        ValueError: ``name`` is already registered to something else.
    """
    current = _REGISTRY.get(name)
    if current is not None and current is not cls and current != cls:
        raise ValueError(f"task name {name!r} is already registered to {current!r}")
    _REGISTRY[name] = cls


def known_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_REGISTRY)


def task_data_files(name: str) -> tuple[str, ...]:
    """The data files the task registered as ``name`` reads (its class's :attr:`Task.data_files`; its module is
    imported, nothing is read). Raises ValueError for an unknown ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    return tuple(_resolve(name).data_files)


def _resolve(name: str) -> type[Task]:
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module_name, _, cls_name = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), cls_name)
    return entry


def get_task(name: str, *, tool_syntax: Any = None, **options: Any) -> Task:
    """Build the task registered as ``name`` with constructor ``options``.

    Known names: ``"stories"`` (:class:`~rlboost_hpc.tasks.stories.StoryQuoteTask`, the stories260K demo),
    ``"gsm8k"`` (:class:`~rlboost_hpc.tasks.math.GSM8KTask`), ``"gsm8k_tools"`` (GSM8K with a calculator,
    :class:`~rlboost_hpc.tasks.math.GSM8KToolTask`), ``"math500"``
    (:class:`~rlboost_hpc.tasks.math.Math500Task`).

    ``tool_syntax`` (a :class:`~rlboost_hpc.tasks.tools.ToolSyntax`, None: the default) goes to a task that
    :attr:`~Task.takes_tool_syntax`; the others have no tool to call.

    Raises:
        ValueError: unknown ``name`` (the message lists the known names) or an option the task does
            not accept (the message lists the accepted ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    cls = _resolve(name)
    if tool_syntax is not None and cls.takes_tool_syntax:
        options["tool_syntax"] = tool_syntax
    sig = inspect.signature(cls)
    try:
        sig.bind(**options)
    except TypeError as e:
        accepted = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        raise ValueError(
            f"task {name!r}: bad options {sorted(options)} ({e}); accepted options: {', '.join(accepted) or 'none'}"
        ) from None
    return cls(**options)
