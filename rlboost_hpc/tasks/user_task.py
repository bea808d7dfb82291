"""Your own task (``task.data.path``): prompts from your file, rewards from your functions, a judge, your tools.

:class:`UserTask` is a :class:`~rlboost_hpc.tasks.base.Task` built from the ``task.*`` keys. Invariants:
- Prompts: the ``task.data.prompt_field`` column is a string or a chat message list ``[{role, content}, ...]``; every
  other column of the row is the prompt's ``meta`` and travels to the reward. With a chat template the prompt is
  rendered as messages (``task.data.system_prompt`` first unless the list has a system message; the tools' JSON schemas
  through the template's ``tools=``); without one, as plain text: the system prompt, the tools' preamble and the
  messages' contents, separated by blank lines.
- Ids and splits: a prompt's id is its row's content hash (:mod:`rlboost_hpc.tasks.dataset`). The held-out prompts
  are ``task.data.heldout_path``'s rows (those also in ``task.data.path`` leave the training split), else the rows
  whose content hash, mixed with ``task.data.split_seed``, falls in ``task.data.heldout_fraction`` — so an appended
  or reshuffled file keeps each row's side. Both splits keep file order; training uses every row unless
  ``task.train_prompts`` is set explicitly (then its first rows), evaluation the first ``task.heldout_prompts``
  held-out rows.
- A stateful environment (``task.environment``, :mod:`rlboost_hpc.tasks.environment`): its ``reset(row)`` runs once
  per prompt in a tool process of this one, under ``task.turns.timeout_s``, and its observation is appended to the
  prompt's last user message; :meth:`UserTask.environment_of` gives the row and that observation to each group (the
  manager's tool processes start every trajectory's instance from them). Its return is the reward component of kind
  ``environment`` (weight: ``task.rewards.weights``' last entry).
- The data set is memory-mapped: the training split is a lazy sequence (:class:`PromptRows`) whose prompts are read
  when the data frontier takes them; pickling the task (to the reward processes) carries no rows.
- Bad input — a missing or wrongly typed prompt column, an empty prompt, an unusable reward function, a judge
  template naming no column, an unset API-key variable, an unreachable endpoint — is a
  :class:`~rlboost_hpc.errors.BadInput` (exit 2) naming the key, column, function or row.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import string
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rlboost_hpc.errors import BadInput
from rlboost_hpc.tasks.base import Prompt, Task
from rlboost_hpc.tasks.dataset import DatasetError, PromptTable, open_prepared
from rlboost_hpc.tasks.user_code import load_object
from rlboost_hpc.tasks.user_rewards import RewardComponent, call_component, classify

log = logging.getLogger("rlboost.tasks")

__all__ = ["PromptRows", "UserTask", "heldout_draw", "make_task"]

_M64 = (1 << 64) - 1


def heldout_draw(hashes: np.ndarray, seed: int) -> np.ndarray:
    """A uniform draw in ``[0, 1)`` per row from its 64-bit content hash and ``seed`` (splitmix64's finaliser)."""
    x = hashes.astype(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class PromptRows(Sequence):
    """The prompts of ``rows`` (indices into ``task``'s table), read on access; slicing gives another view."""

    def __init__(self, task: "UserTask", table: PromptTable, rows: np.ndarray) -> None:
        self.task, self.table, self.rows = task, table, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # noqa: ANN001 - int or slice, as a Sequence takes
        if isinstance(i, slice):
            return PromptRows(self.task, self.table, self.rows[i])
        return self.task.prompt_at(self.table, int(self.rows[i]))


def _is_messages_type(t: str) -> bool:
    return t.startswith(("list<", "large_list<")) and "struct<" in t and "role" in t and "content" in t


class UserTask(Task):
    """A task from the ``task.*`` keys (see the module docstring). ``cfg``: the run's ``TaskCfg``; call
    :meth:`load` (in the trainer's allocation) before use.

    Raises (from :meth:`load`):
        DatasetError: an unreadable data set, a missing or wrongly typed prompt column, an empty prompt, no rows.
        UserCodeError: a reward function or tool that cannot be imported or has an unusable signature.
        BadInput: a judge template naming no column, an unset API-key variable.
    """

    name = "user"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.prompt_field = cfg.data.prompt_field
        self.components: list[RewardComponent] = []
        self.tool_schemas: list[dict] = []
        self.tool_preamble = ""
        self.environment_class = ""  # task.environment's class name ("" without one)
        self._resets = None  # the trainer's pool that runs reset(row) for the prompts (task.environment)
        self._first: dict[str, str] = {}  # prompt id -> reset's observation
        self.table: PromptTable | None = None
        self.heldout_table: PromptTable | None = None
        self._train = self._heldout = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ loading
    def load(self) -> "UserTask":
        """Read (or reuse the prepared copy of) the data sets, split them, import and check the reward functions."""
        c, d = self.cfg, self.cfg.data
        self.table = open_prepared(d.path, split=d.split, key="task.data.path", cache_dir=d.cache_dir)
        self._check_prompt_column(self.table, "task.data.path")
        everything = np.arange(len(self.table), dtype=np.int64)
        if d.heldout_path:
            self.heldout_table = open_prepared(d.heldout_path, split=d.heldout_split, key="task.data.heldout_path",
                                               cache_dir=d.cache_dir)
            self._check_prompt_column(self.heldout_table, "task.data.heldout_path")
            held = np.arange(len(self.heldout_table), dtype=np.int64)
            overlap = self.table.pid_in(self.heldout_table)
            if overlap.any():
                log.warning("%d rows of task.data.path are also in task.data.heldout_path: they are held out only",
                            int(overlap.sum()))
            train = everything[~overlap]
        else:
            mask = heldout_draw(self.table.hashes(), d.split_seed) < d.heldout_fraction
            train, held = everything[~mask], everything[mask]
        if len(held) == 0:
            raise DatasetError(f"no held-out prompts: task.data.heldout_fraction = {d.heldout_fraction} of "
                               f"{len(self.table)} rows; set task.data.heldout_path or a larger fraction")
        if len(train) == 0:
            raise DatasetError("task.data.path: no training prompts left after the held-out split")
        if "train_prompts" in c.model_fields_set:
            train = train[: c.train_prompts]
        self._train, self._heldout = train, held[: c.heldout_prompts]
        self.components = self._components()
        if c.turns.tools:
            from rlboost_hpc.tasks.tools import ToolSyntax
            from rlboost_hpc.tasks.user_tools import load_tools, tool_preamble

            t = c.turns
            self.tool_schemas = [schema for _, _, schema in load_tools(t.tools)]
            self.tool_preamble = tool_preamble(self.tool_schemas, ToolSyntax(t.tool_call_open, t.tool_call_close))
        return self

    def _environment_component(self, weight: float, names: set[str]) -> RewardComponent:
        from rlboost_hpc.tasks.environment import load_environment

        env = self.cfg.environment
        if env.openenv is not None and importlib.util.find_spec("openenv") is None:
            from rlboost_hpc.tasks.user_code import UserCodeError

            raise UserCodeError("task.environment.openenv needs openenv-core, which is not installed: "
                                "pip install 'openenv-core>=0.3'")
        name = self.environment_class = load_environment(env.class_path).__name__ if env.class_path else "openenv"
        while name in names:
            name += "_"
        return RewardComponent(name=name, weight=weight, kind="environment", key="task.environment")

    def _check_prompt_column(self, table: PromptTable, key: str) -> None:
        pf = self.prompt_field
        if pf not in table.columns:
            raise DatasetError(f"task.data.prompt_field = {pf!r}: {key} ({table.source}) has no column {pf!r} "
                               f"(columns: {', '.join(table.columns)})")
        st = table.stats.get(pf, {})
        t = st.get("type", "")
        if t not in ("string", "large_string") and not _is_messages_type(t):
            raise DatasetError(f"{key}: column {pf!r} is {t}; a prompt is a string or a chat message list "
                               "[{role, content}, ...]")
        bad = int(st.get("nulls", 0)) + int(st.get("empty", 0))
        if bad:
            raise DatasetError(f"{key}: column {pf!r} is empty or null in {bad} row(s), the first at row "
                               f"{st.get('first_bad_row')} of {table.source}")

    def _components(self) -> list[RewardComponent]:
        c, out, names = self.cfg.rewards, [], set()
        columns = [x for x in self.table.columns if x != self.prompt_field]
        weights = list(c.weights) if c.weights is not None else None
        for i, ref in enumerate(c.functions):
            key = f"task.rewards.functions[{i}]"
            fn = load_object(ref, key)
            kind, accepts = classify(fn, ref, key, columns)
            name = getattr(fn, "__name__", ref.rpartition(":")[2])
            while name in names:
                name += "_"
            names.add(name)
            out.append(RewardComponent(name=name, weight=weights[i] if weights else 1.0, kind=kind, ref=ref, key=key,
                                       accepts=accepts, is_async=inspect.iscoroutinefunction(fn),
                                       timeout_s=c.timeout_s))
        n = len(c.functions)
        if c.model is not None:
            out.append(self._model_component(columns, weights[n] if weights else c.model.weight, names))
            names.add(out[-1].name)
        if self.cfg.environment is not None:
            out.append(self._environment_component(weights[-1] if weights else 1.0, names))
        return out

    def _model_component(self, columns: list[str], weight: float, names: set[str]) -> RewardComponent:
        import os

        from rlboost_hpc.tasks.reward_model import RewardModelClient

        rm = self.cfg.rewards.model
        if rm.kind == "judge":
            known = {"prompt", "completion", *columns}
            for _, field, _, _ in string.Formatter().parse(rm.prompt_template):
                if field is not None and field.split(".")[0].split("[")[0] not in known:
                    raise BadInput(f"task.rewards.model.prompt_template names {{{field}}}, which is no column of "
                                   f"task.data.path (columns: {', '.join(columns)}) nor prompt/completion")
        if rm.api_key_env and not os.environ.get(rm.api_key_env):
            raise BadInput(f"task.rewards.model.api_key_env = {rm.api_key_env}: that environment variable is not set")
        client = RewardModelClient(rm)
        name = rm.name if rm.name not in names else rm.name + "_"
        return RewardComponent(name=name, weight=weight, kind="model", key="task.rewards.model",
                               timeout_s=client.call_budget_s(), model=client)

    def check_endpoint(self) -> float:
        """Score one empty completion of the first training prompt with the reward model; returns the seconds it
        took (0.0 without a reward model).

        Raises:
            BadInput: the endpoint is unreachable or answers wrongly (the URL and the cause named).
        """
        import time

        from rlboost_hpc.tasks.reward_model import RewardModelError

        comp = next((c for c in self.components if c.kind == "model"), None)
        if comp is None:
            return 0.0
        t0 = time.monotonic()
        try:
            comp.model.score(self.train_prompts()[0], [""])
        except RewardModelError as e:
            raise BadInput(f"task.rewards.model.url = {comp.model.url}: {e}") from None
        return time.monotonic() - t0

    def longest_prompt(self, tokenizer) -> tuple[int, Prompt]:
        """``(tokens, prompt)`` of the longest prompt of the data sets, every row rendered and tokenised — a short
        prompt of many tokens counts as much as a long one — once per (data set, tokenizer, rendering): the result
        is kept beside the prepared file, keyed by its fingerprint and a hash of what renders a prompt. With a
        stateful environment, whose first observation (a ``reset`` per row) is part of the prompt, the rows longest
        by characters are the ones rendered (:meth:`length_check_prompts`)."""
        if self.environment_class:
            return super().longest_prompt(tokenizer)
        import json
        import os

        import xxhash

        hf = tokenizer.hf
        render = [getattr(hf, "name_or_path", ""), len(hf), tokenizer.use_chat, getattr(hf, "chat_template", None),
                  self.prompt_field, self.cfg.data.system_prompt, self.tool_schemas, self.tool_preamble,
                  self.heldout_table.fingerprint if self.heldout_table is not None else ""]
        key = xxhash.xxh3_64_hexdigest(json.dumps(render, sort_keys=True, default=str).encode())
        note = self.table.path.with_name(f"{self.table.fingerprint}-prompt-tokens-{key}.json")
        try:
            got = json.loads(note.read_text())
            return int(got["tokens"]), self.row_prompt(got["table"], int(got["row"]))
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            pass  # not there yet (or unreadable): tokenise every row once
        n, table, row = max(self.token_lengths(tokenizer))
        tmp = note.with_name(f".{note.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"tokens": n, "table": table, "row": row}))
            os.replace(tmp, note)
        except OSError as e:  # a read-only cache: checked again next time
            log.warning("cannot keep the prompts' token lengths in %s: %s", note, e)
        return n, self.row_prompt(table, row)

    def token_lengths(self, tokenizer) -> Iterator[tuple[int, str, int]]:
        """``(tokens, table, row)`` of every row of the data sets (table ``"train"``: ``task.data.path``;
        ``"heldout"``: ``task.data.heldout_path``), rendered as :meth:`prompt_ids` renders a prompt, in file order."""
        for name, table in (("train", self.table), ("heldout", self.heldout_table)):
            for i in range(len(table) if table is not None else 0):
                yield len(self.prompt_ids(self.prompt_at(table, i), tokenizer)), name, i

    def row_prompt(self, table: str, row: int) -> Prompt:
        """The prompt of ``row`` of a table :meth:`token_lengths` names."""
        return self.prompt_at({"train": self.table, "heldout": self.heldout_table}[table], row)

    @property
    def reward_errors(self) -> str:  # type: ignore[override]  # Task's default, read from task.rewards.errors here
        return self.cfg.rewards.errors

    def data_source(self, key: str) -> str | None:
        return {"task.data.path": self.cfg.data.path, "task.data.heldout_path": self.cfg.data.heldout_path}.get(key)

    def fingerprints(self) -> dict[str, str]:
        """Config key → fingerprint of each data set (what a checkpoint records)."""
        out = {"task.data.path": self.table.fingerprint}
        if self.heldout_table is not None:
            out["task.data.heldout_path"] = self.heldout_table.fingerprint
        return out

    # ------------------------------------------------------------------ prompts
    def prompt_at(self, table: PromptTable, i: int) -> Prompt:
        """The :class:`Prompt` of row ``i`` of ``table``."""
        row = table.row(i)
        value = row.pop(self.prompt_field)
        if isinstance(value, str):
            return Prompt(pid=table.pid(i), text=value, meta=row)
        msgs = [{k: v for k, v in m.items() if v is not None} for m in value]
        last_user = next((m.get("content", "") for m in reversed(msgs) if m.get("role") == "user"), "")
        return Prompt(pid=table.pid(i), text=str(last_user), meta=row, messages=msgs)

    def train_prompts(self) -> PromptRows:
        return PromptRows(self, self.table, self._train)

    def heldout_prompts(self) -> list[Prompt]:
        table = self.heldout_table if self.heldout_table is not None else self.table
        return [self.prompt_at(table, int(i)) for i in self._heldout]

    def length_check_prompts(self) -> list[Prompt]:
        """The prompts with the most characters (per the prepared file's statistics) of both splits, and the held-out
        ones: what the run's context check tokenises (``rlboost-hpc task check`` tokenises every row)."""
        out = []
        for table in filter(None, (self.table, self.heldout_table)):
            rows = [r for _, r in table.stats.get(self.prompt_field, {}).get("longest", [])]
            out += [self.prompt_at(table, r) for r in rows]
        return out + self.heldout_prompts()

    def messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The chat of ``prompt``: its messages (or one user message), ``task.data.system_prompt`` first unless it has
        one; with ``task.environment``, its ``reset(row)`` observation appended to the last user message (after a blank
        line)."""
        msgs = list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        if self.cfg.data.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.cfg.data.system_prompt})
        first = self.first_observation(prompt) if self.environment_class else ""
        if first:
            i = max((j for j, m in enumerate(msgs) if m.get("role") == "user"), default=None)
            if i is None:
                msgs.append({"role": "user", "content": first})
            else:
                msgs[i] = {**msgs[i], "content": "\n\n".join(x for x in (str(msgs[i].get("content") or ""), first) if x)}
        return msgs

    # ------------------------------------------------------------------ a stateful environment
    def row_of(self, prompt: Prompt) -> dict[str, Any]:
        """The row ``prompt`` was read from: its prompt column (text or messages) and every other column."""
        return {self.prompt_field: prompt.messages if prompt.messages is not None else prompt.text, **prompt.meta}

    def first_observation(self, prompt: Prompt) -> str:
        """``reset(row)``'s observation for ``prompt`` (run once per prompt in a tool process of this one, under
        ``task.turns.timeout_s``; every trajectory of its groups starts from it).

        Raises:
            EnvironmentResetFailed: reset raised or ran past the deadline (exit 2 naming the row).
        """
        if prompt.pid not in self._first:
            from rlboost_hpc.tasks.environment import EnvironmentCalls, EnvironmentRunner, row_json

            if self._resets is None:
                self._resets = EnvironmentCalls(EnvironmentRunner.of(self.cfg.environment,
                                                                     timeout_s=self.cfg.turns.timeout_s),
                                                workers=1, timeout_s=self.cfg.turns.timeout_s)
            self._first[prompt.pid] = self._resets.reset_all([row_json(self.row_of(prompt))],
                                                             [f"row {prompt.pid} ({prompt.text[:60]!r})"])[0]
        return self._first[prompt.pid]

    def environment_of(self, prompt: Prompt) -> tuple[str, str] | None:
        from rlboost_hpc.tasks.environment import row_json

        if not self.environment_class:
            return None
        return row_json(self.row_of(prompt)), self.first_observation(prompt)

    def close(self) -> None:
        """Stop the process that runs ``reset`` for the prompts (idempotent)."""
        if self._resets is not None:
            self._resets.close()
            self._resets = None

    def format_prompt(self, prompt: Prompt) -> str:
        parts = [m.get("content", "") for m in self.messages(prompt) if m.get("role") == "system"]
        if self.tool_preamble:
            parts.append(self.tool_preamble)
        parts += [str(m.get("content", "")) for m in self.messages(prompt) if m.get("role") != "system"]
        return "\n\n".join(p for p in parts if p)

    def chat_content(self, prompt: Prompt) -> str:
        return self.format_prompt(prompt)

    def prompt_ids(self, prompt: Prompt, tokenizer) -> list[int]:
        if tokenizer.use_chat:
            return tokenizer.encode_messages(self.messages(prompt), tools=self.tool_schemas or None)
        return tokenizer.encode_text(self.format_prompt(prompt))

    # ------------------------------------------------------------------ rewards
    def reward(self, prompt: Prompt, response_text: str) -> float:
        """The weighted reward of one completion, computed in this process (the reward pool calls
        :func:`~rlboost_hpc.tasks.user_rewards.call_component` per component instead, each under its deadline); a
        stateful environment's term is left out (it comes with a trajectory)."""
        total = 0.0
        for comp in self.components:
            if comp.kind == "environment":  # its term comes with the trajectory (RewardPool.score)
                continue
            v = call_component(comp, prompt, [response_text], None, self.prompt_field)[0]
            total += comp.weight * (v or 0.0)
        return total

    def __getstate__(self) -> dict:
        return {**self.__dict__, "table": None, "heldout_table": None, "_train": None, "_heldout": None,
                "_resets": None}

    def __repr__(self) -> str:
        return f"UserTask(dataset={self.cfg.data.path!r}, rewards={[c.name for c in self.components]})"


def make_task(task_cfg: Any):
    """The run's task: a :class:`UserTask` (loaded) when ``task.data.path`` is set, a reasoning-gym
    :class:`~rlboost_hpc.tasks.procedural.ProceduralTask` when ``task.reasoning_gym`` is, else the built-in
    ``task.name`` with ``task.train_prompts`` / ``task.heldout_prompts`` (and the run's tool-call syntax, for a task
    that takes it).

    Raises:
        BadInput: see :meth:`UserTask.load`; ValueError: an unknown built-in name.
    """
    from rlboost_hpc.tasks.base import get_task
    from rlboost_hpc.tasks.tools import ToolSyntax

    if task_cfg.kind == "own":
        return UserTask(task_cfg).load()
    if task_cfg.kind == "reasoning_gym":
        from rlboost_hpc.tasks.procedural import ProceduralTask

        return ProceduralTask(task_cfg.reasoning_gym, task_cfg.heldout_prompts)
    return get_task(task_cfg.name, n_train=task_cfg.train_prompts, n_heldout=task_cfg.heldout_prompts,
                    tool_syntax=ToolSyntax(task_cfg.turns.tool_call_open, task_cfg.turns.tool_call_close))

