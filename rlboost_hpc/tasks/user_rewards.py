"""A user's reward functions: how they are named, checked, called on a group of completions, and combined.

Two signatures are accepted, chosen by the function's parameters (:func:`classify`):

* TRL's batched reward function, ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``: one
  call per GRPO group; ``prompts`` repeats the row's prompt value (a string, or a chat message list); ``completions``
  are strings — or, when the prompt is a message list, one-message lists ``[{"role": "assistant", "content": …}]``
  (TRL's conversational format); ``completion_ids`` the generated token ids; every other column of the row comes as a
  keyword, one value per completion. A function receives only the keywords it declares unless it takes ``**kwargs``.
  ``None`` means "does not apply" and adds nothing (TRL's NaN-sum).
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`` (a dict's ``score``):
  one call per completion; ``ground_truth`` is the row's ``reward_model.ground_truth`` (verl's parquet layout), else
  its ``ground_truth`` column, else its ``answer`` column; ``data_source`` and ``extra_info`` are those columns.

``async def`` functions of either kind are awaited (a verl one concurrently over the group).

Invariants:
- A function's result is checked (:func:`check_values`) where it ran: anything but one finite number (or ``None``)
  per completion — a wrong length, ``NaN``, a string — is a :class:`RewardOutputError`, which the reward pool counts
  against that function like an exception or a timeout.
- A signature neither convention fits, or a required parameter that names no column, is a
  :class:`~rlboost_hpc.tasks.user_code.UserCodeError` (exit 2) before anything starts.
- A completion's reward is ``Σ weight_f · value_f`` over the functions (and the reward model), ``None`` adding 0.
"""
from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlboost_hpc.tasks.user_code import UserCodeError, load_object

__all__ = ["RewardComponent", "RewardOutputError", "VERL_PARAMS", "TRL_PARAMS", "call_component", "check_values",
           "classify", "component_inputs"]

#: verl's ``compute_score`` parameters.
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
#: What a TRL reward function receives besides the row's columns.
TRL_PARAMS = ("prompts", "completions", "completion_ids", "trainer_state")


@dataclass(frozen=True)
class RunProgress:
    """Where the run is when a group is scored — what a TRL reward function receives as ``trainer_state`` (TRL's
    ``GRPOTrainer`` passes its ``transformers.TrainerState``; this has the same progress attributes under the same
    names — ``global_step`` (optimizer steps done before this group's step: its step number, 0-based), ``max_steps``
    (``trainer.steps``; 0: no end), ``epoch`` (passes over the training prompts, fractional) — without importing
    ``transformers.trainer_callback``, which costs every reward worker ~6 s at its start)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


class RewardOutputError(ValueError):
    """A reward function returned something other than one finite number (or None) per completion."""


@dataclass(frozen=True)
class RewardComponent:
    """One term of the reward: ``name`` (its metrics' name), ``weight``, ``kind`` (``trl``, ``verl`` or ``model``: a
    reward model behind HTTP, ``model`` then holds its client), the function's ``ref`` and ``key`` (config key), the
    keywords it accepts (``None``: any, it takes ``**kwargs``), whether it is ``async``, and the deadline of one call
    in the reward pool (s)."""

    name: str
    weight: float
    kind: str
    ref: str = ""
    key: str = ""
    accepts: tuple[str, ...] | None = None
    is_async: bool = False
    timeout_s: float = 5.0
    model: Any = None
    _fn: Any = field(default=None, repr=False, compare=False)

    def function(self) -> Callable[..., Any]:
        """The function (imported on first use in this process)."""
        if self._fn is None:
            object.__setattr__(self, "_fn", load_object(self.ref, self.key))
        return self._fn

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fn": None}  # each process imports the function itself

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def classify(fn: Callable[..., Any], ref: str, key: str, columns: Sequence[str]) -> tuple[str, tuple[str, ...] | None]:
    """``(kind, accepts)`` of a reward function: ``"verl"`` when it has ``solution_str``, ``"trl"`` when it has
    ``completions``; ``accepts`` the keyword names it takes (``None`` with ``**kwargs``).

    Raises:
        UserCodeError: neither signature; positional-only or ``*args``-only parameters; a required parameter that is
            no column of the data set (named, with the columns).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UserCodeError(f"{key} = {ref!r}: its signature cannot be read") from None
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [p for p in params.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if any(p.kind is p.POSITIONAL_ONLY for p in named):
        raise UserCodeError(f"{key} = {ref!r}: positional-only parameters cannot be passed by name")
    required = [p.name for p in named if p.default is p.empty]
    if "solution_str" in params:
        extra = [n for n in required if n not in VERL_PARAMS]
        if extra:
            raise UserCodeError(f"{key} = {ref!r}: verl's compute_score(data_source, solution_str, ground_truth, "
                                f"extra_info) has no parameter {extra[0]!r}")
        return "verl", None if var_kw else tuple(p.name for p in named)
    if "completions" in params:
        unknown = [n for n in required if n not in TRL_PARAMS and n not in columns]
        if unknown:
            raise UserCodeError(f"{key} = {ref!r}: parameter {unknown[0]!r} is no column of the data set (columns: "
                                f"{', '.join(columns)}) nor one of {', '.join(TRL_PARAMS)}")
        return "trl", None if var_kw else tuple(p.name for p in named)
    raise UserCodeError(
        f"{key} = {ref!r}: unusable signature {sig}; expected TRL's fn(prompts, completions, completion_ids, "
        "**columns) -> list[float] or verl's compute_score(data_source, solution_str, ground_truth, extra_info)")


def check_values(values: Any, n: int, name: str) -> list[float | None]:
    """``values`` as ``n`` floats or Nones.

    Raises:
        RewardOutputError: not a sequence of ``n``; an element that is not a finite number or None.
    """
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardOutputError(f"{name} returned a {type(values).__name__}, not a list of {n} numbers")
    if len(values) != n:
        raise RewardOutputError(f"{name} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        if isinstance(v, str) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise RewardOutputError(f"{name} returned a {type(v).__name__} ({str(v)[:40]!r}), not a number")
        f = float(v)
        if not math.isfinite(f):
            raise RewardOutputError(f"{name} returned {f}, not a finite number")
        out.append(f)
    return out


def _verl_value(v: Any, name: str) -> Any:
    if isinstance(v, dict):
        if "score" not in v:
            raise RewardOutputError(f"{name} returned a dict without 'score' (keys: {', '.join(map(str, v))})")
        return v["score"]
    return v


def component_inputs(prompt: Any, texts: Sequence[str], ids: Sequence[Sequence[int]] | None,
                     prompt_field: str) -> dict[str, Any]:
    """TRL's keyword arguments for one group: ``prompts``, ``completions`` (conversational when the prompt is a
    message list), ``completion_ids`` and every column of the row (``prompt.meta``), one value per completion."""
    n = len(texts)
    value = prompt.messages if prompt.messages is not None else prompt.text
    conversational = prompt.messages is not None
    out: dict[str, Any] = {
        "prompts": [value] * n,
        "completions": [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts),
        "completion_ids": [list(x) for x in ids] if ids is not None else [[] for _ in texts],
    }
    for col, v in prompt.meta.items():
        if col not in out and col != prompt_field:
            out[col] = [v] * n
    return out


def _ground_truth(meta: dict[str, Any]) -> Any:
    rm = meta.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    return meta.get("ground_truth", meta.get("answer"))


def call_component(c: RewardComponent, prompt: Any, texts: Sequence[str], ids: Sequence[Sequence[int]] | None,
                   prompt_field: str, progress: RunProgress | None = None) -> list[float | None]:
    """Run component ``c`` on one group of completions of ``prompt`` (in a reward worker) and check its values. A TRL
    function that takes ``trainer_state`` (or ``**kwargs``, as TRL passes it to every function) gets ``progress``'s
    (an empty run's when None: held-out evaluation, ``task check``).

    Raises:
        RewardOutputError: bad values (see :func:`check_values`); whatever the user's function raises.
    """
    n = len(texts)
    if c.kind == "model":
        return check_values(c.model.score(prompt, texts), n, c.name)
    fn = c.function()
    if c.kind == "verl":
        meta = prompt.meta
        args = dict(data_source=meta.get("data_source"), ground_truth=_ground_truth(meta),
                    extra_info=meta.get("extra_info"))
        if c.accepts is not None:
            args = {k: v for k, v in args.items() if k in c.accepts}
        if c.is_async:
            async def all_of() -> list[Any]:
                return list(await asyncio.gather(*(fn(solution_str=t, **args) for t in texts)))
            raw = asyncio.run(all_of())
        else:
            raw = [fn(solution_str=t, **args) for t in texts]
        return check_values([_verl_value(v, c.name) for v in raw], n, c.name)
    kwargs = component_inputs(prompt, texts, ids, prompt_field)
    if c.accepts is None or "trainer_state" in c.accepts:
        kwargs["trainer_state"] = progress or RunProgress()
    if c.accepts is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in c.accepts}
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return check_values(out, n, c.name)


async def _await(aw: Any) -> Any:
    return await aw
