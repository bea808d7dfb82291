"""Stateful multi-turn environments (``task.environment``): a user's class, one instance per trajectory, living in the
tool processes of the trainer's allocation (never on a rollout worker), rebuilt by replay wherever it is not live.

A user's environment is a class constructible without arguments, with two methods:

* ``reset(row) -> observation``: ``row`` is the prompt's row of ``task.data.path`` (a dict of its columns, the prompt
  column included, as JSON gives them); the observation (a string; anything else is written as JSON) is appended to
  the prompt's last user message — every trajectory of a GRPO group starts from it;
* ``step(assistant_turn) -> (observation, reward, done)``: ``assistant_turn`` is the text of the assistant turn
  that just finished (its stop token left out); ``reward`` a finite number, summed over the trajectory's steps;
  ``done`` ends the trajectory. While it is not done, the observation is appended as a ``user`` message after the
  turn (rendered once as token ids, never trained) and the next turn starts from it.

``async def`` methods are awaited; a ``close()`` method, if any, is called exactly once per instance, on every way
its trajectory ends: ``done``, the last turn, a failed step, no room left for the observation (the manager releases
it), an instance evicted or found stale, a replay that diverged, a step past its deadline (its tool process is
stopped: SIGTERM, and ``close()`` runs for every instance it held, within ``task.turns.timeout_s`` before SIGKILL), the
run's end and the manager's death (its tool processes close what they hold as they exit).

Invariants:
- **Deterministic.** ``reset`` must be a function of the row, and ``step`` of the row and the assistant turns so far
  (seed any randomness from the row). The instance of a trajectory lives in one tool process (calls of one trajectory
  go to one worker position); where it is not live — that worker was replaced after a deadline, the manager
  restarted and its tool processes with it, the instance was evicted — :class:`EnvironmentRunner` rebuilds it by
  replaying ``reset(row)`` and every earlier turn, and checks that each replayed observation, reward and ``done``
  equal what the trajectory holds: any difference is status ``diverged``, which fails the step with the first
  difference named rather than training on another history.
- **Deadlines.** Each call runs under ``task.turns.timeout_s`` per environment call it may make: a call whose
  instance is live makes one; one that rebuilds it makes ``2 + earlier turns`` (reset, the replayed steps, this
  step). A call past its deadline kills its worker (every instance it held is rebuilt on its next call) and is status
  ``timeout``.
- **Failures are data.** A class without ``reset(row)`` / ``step(assistant_turn)`` is a
  :class:`~rlboost_hpc.tasks.user_code.UserCodeError` (exit 2) naming ``task.environment``, before anything starts.
  A ``reset`` or ``step`` that raises, or a ``step`` that returns anything but ``(observation, finite number,
  bool)``, is status ``error`` with the cause; the trajectory ends (``environment_error``) and ``task.rewards.errors``
  decides (the trainer: the trajectory's GRPO group is left out of the step, or the run stops naming it).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import math
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlboost_hpc.errors import BadInput
from rlboost_hpc.tasks.tools import Observation, ToolCalls, TurnCalls, render_observation
from rlboost_hpc.tasks.user_code import UserCodeError, load_object

if TYPE_CHECKING:
    from rlboost_hpc.config_task import EnvironmentCfg, OpenEnvCfg

__all__ = ["EnvironmentCalls", "EnvironmentResetFailed", "EnvironmentRunner", "StepOutcome", "TurnCall",
           "TurnSpec", "load_environment", "observation_text", "row_json"]

KEY = "task.environment"


class EnvironmentResetFailed(BadInput, RuntimeError):
    """``reset(row)`` failed on a prompt's row (the trainer renders every prompt with it); the message names the key,
    the row and the cause."""


class _Diverged(Exception):
    """A replayed environment answered otherwise than the trajectory holds."""


def load_environment(ref: str, key: str = KEY) -> type:
    """The environment class ``ref`` names (``module:Class`` / ``file.py:Class``), checked.

    Raises:
        UserCodeError: an import error, not a class, a class that needs constructor arguments, or one without
            ``reset(row)`` and ``step(assistant_turn)`` methods taking one argument each.
    """
    cls = load_object(ref, key)
    if not isinstance(cls, type):
        raise UserCodeError(f"{key} = {ref!r}: {getattr(cls, '__name__', ref)} is a {type(cls).__name__}, not a class "
                            "with reset(row) and step(assistant_turn)")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise UserCodeError(f"{key} = {ref!r}: {cls.__name__}{inspect.signature(cls)} must be constructible without "
                            "arguments (one instance per trajectory; read what it needs from the row in reset)") from None
    except ValueError:  # (no signature to read: a builtin type)
        pass
    for meth, arg in (("reset", "row"), ("step", "assistant_turn")):
        fn = inspect.getattr_static(cls, meth, None)
        if fn is None or not callable(getattr(cls, meth)):
            raise UserCodeError(f"{key} = {ref!r}: {cls.__name__} has no {meth}({arg}) method")
        try:
            unbound = () if isinstance(fn, (staticmethod, classmethod)) else (None,)  # (self)
            inspect.signature(getattr(cls, meth)).bind(*unbound, arg)
        except TypeError:
            raise UserCodeError(f"{key} = {ref!r}: {cls.__name__}.{meth}{inspect.signature(getattr(cls, meth))} must "
                                f"take one argument ({arg})") from None
    return cls


def row_json(row: dict[str, Any]) -> str:
    """A prompt's row as the JSON text its environment's ``reset`` receives (values JSON cannot hold as strings)."""
    return json.dumps(row, default=str, ensure_ascii=False)


def observation_text(value: Any) -> str:
    """An observation as text: a string as it is, None as "", anything else as JSON."""
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value, default=str)


def _resolved(value: Any) -> Any:
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value
        return asyncio.run(wait())
    return value


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            _resolved(close())
        except Exception:  # noqa: BLE001 - a failing close of a dropped instance changes nothing
            pass


def _why(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass(frozen=True)
class TurnCall:
    """One environment step of trajectory ``trajectory`` (the identity of its instance): turn ``turn`` whose token
    ids are ``turn_ids`` (packed int32); ``row`` / ``first`` as ``GroupSpec.env_row`` / ``env_first``; ``history``:
    the earlier turns as ``(turn ids, observation ids, reward)`` (packed int32); ``last``: the trajectory ends after
    this step whatever ``done`` says (no observation is rendered, the instance is dropped)."""

    trajectory: str
    turn: int
    turn_ids: bytes
    row: str
    first: str
    history: tuple[tuple[bytes, bytes, float], ...] = ()
    last: bool = False

    @classmethod
    def from_msg(cls, msg: Any) -> "TurnCall":
        """The step a manager's ``EnvCall`` asks for."""
        return cls(msg.rid, msg.turn, bytes(msg.turn_ids), msg.row, msg.first,
                   tuple((bytes(t), bytes(o), float(r)) for t, o, r in msg.history), msg.last)


@dataclass(frozen=True)
class StepOutcome:
    """What a worker answers for a :class:`TurnCall`: the observation ids (empty when the trajectory ends or the step
    failed) and text, the reward and ``done``, ``status`` (``ok``, ``error``, ``diverged``), the ``error`` text and the
    calls it replayed to rebuild the trajectory's instance (reset included; 0 when it was live, or this is the
    trajectory's first turn)."""

    obs_ids: list[int] = field(default_factory=list)
    text: str = ""
    reward: float = 0.0
    done: bool = False
    status: str = "ok"
    error: str = ""
    replayed: int = 0


def _digest(row: str, first: str, history: tuple[tuple[bytes, bytes, float], ...]) -> bytes:
    """Fingerprint of a trajectory's row, first observation and turns (a live instance serves only its own)."""
    h = hashlib.blake2b(row.encode(), digest_size=16)
    h.update(b"\0" + first.encode())
    for t, o, r in history:
        h.update(struct.pack("<II", len(t), len(o)) + t + o + struct.pack("<d", r))
    return h.digest()


@dataclass
class EnvironmentRunner:
    """The environments of trajectories in one tool process: a picklable handler of a
    :class:`~rlboost_hpc.tasks.pool.DeadlinePool` (``setup()`` imports the class and loads the tokenizer).

    Args:
        ref: ``task.environment.class_path`` (for an OpenEnv server: its URL, named in messages).
        openenv: ``task.environment.openenv``: instances are :class:`~rlboost_hpc.tasks.openenv.OpenEnvEpisode`
            sessions of that server instead of a class's.
        timeout_s: an OpenEnv server's answer deadline, seconds (``task.turns.timeout_s``).
        reward_range: ``task.environment.reward_range``: a step's reward outside ``[low, high]`` is an error.
        tokenizer_dir: the policy's model directory (turn ids are decoded, observations rendered, with its tokenizer);
            "" for a runner that only resets (the trainer's first observations).
        use_chat: render observations through the chat template (as ``user`` messages), as the prompts were.
        stop_ids: the policy's stop ids (a turn's trailing stop token is not part of its text).
        plain_format: the observation's text without a chat template (``{result}`` is replaced).
        max_observation_tokens: an observation longer than this many tokens is cut.
        max_live: instances kept at most (the least recently used is dropped, and rebuilt if it is needed again).

    Items: ``("reset", row)`` → the observation text of a fresh instance's ``reset`` (the instance is closed;
    exceptions propagate); ``("turn", TurnCall)`` → a :class:`StepOutcome` (never raises on the user's code);
    ``("release", trajectory)`` → whether the trajectory's live instance was closed (False: none was live here).
    ``teardown()`` (the worker stops) closes every instance held, the one mid-step included.
    """

    ref: str
    openenv: OpenEnvCfg | None = None
    timeout_s: float = 30.0
    reward_range: tuple[float, float] | None = None
    tokenizer_dir: str = ""
    use_chat: bool = False
    stop_ids: tuple[int, ...] = ()
    plain_format: str = "\n{result}\n"
    max_observation_tokens: int = 64
    max_live: int = 4096
    _cls: Any = field(default=None, init=False, repr=False, compare=False)
    _hf: Any = field(default=None, init=False, repr=False, compare=False)
    _live: Any = field(default=None, init=False, repr=False, compare=False)
    _current: Any = field(default=None, init=False, repr=False, compare=False)  # the instance a call works on

    @property
    def key(self) -> str:
        """The configuration key messages name: ``task.environment`` or ``task.environment.openenv.url``."""
        return KEY if self.openenv is None else "task.environment.openenv.url"

    @classmethod
    def of(cls, environment: EnvironmentCfg, *, timeout_s: float, **kw: Any) -> "EnvironmentRunner":
        """The runner of ``task.environment`` (a class of one's own or an OpenEnv server); ``kw`` as the fields."""
        return cls(environment.ref, openenv=environment.openenv, timeout_s=timeout_s,
                   reward_range=environment.reward_range, **kw)

    def setup(self) -> None:
        """Import the class and load the tokenizer (once per worker)."""
        if self._cls is None:
            if self.openenv is not None:
                from rlboost_hpc.tasks.openenv import OpenEnvEpisode

                self._cls = functools.partial(OpenEnvEpisode, self.openenv, self.timeout_s)
            else:
                self._cls = load_environment(self.ref)
        if self._hf is None and self.tokenizer_dir:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
        if self._live is None:
            self._live = OrderedDict()  # trajectory -> (instance, next turn, digest of what it has seen)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cls": None, "_hf": None, "_live": None, "_current": None}  # workers load their own

    def __call__(self, item: tuple[str, Any]) -> Any:
        self.setup()
        kind, payload = item
        if kind == "reset":
            self._current = self._cls()
            try:
                return observation_text(_resolved(self._current.reset(json.loads(payload))))
            finally:
                self._close_current()
        if kind == "release":
            entry = self._live.pop(payload, None)
            if entry is not None:
                _close(entry[0])
            return entry is not None
        return self._turn(payload)

    def teardown(self) -> None:
        """Close every instance this worker holds, the one a call works on included (the worker stops)."""
        if self._current is not None:
            self._close_current()
        while self._live:
            _close(self._live.popitem(last=False)[1][0])

    def _close_current(self) -> None:
        env, self._current = self._current, None  # forgotten first: a stop during its close() does not close it again
        _close(env)

    def _turn(self, call: TurnCall) -> StepOutcome:
        rebuild = 1 + len(call.history) if call.turn else 0  # (turn 0's reset makes the instance: no replay)
        try:
            env, replayed = self._instance(call)
        except _Diverged as e:
            return StepOutcome(status="diverged", error=str(e), replayed=rebuild)
        except Exception as e:  # noqa: BLE001 - the user's reset or step: an environment error
            return StepOutcome(status="error", error=_why(e), replayed=rebuild)
        try:
            obs, reward, done = self._step(env, call.turn_ids)
        except Exception as e:  # noqa: BLE001
            self._close_current()
            return StepOutcome(status="error", error=_why(e), replayed=replayed)
        if done or call.last:
            self._close_current()
            return StepOutcome([], obs, reward, done, replayed=replayed)
        try:
            ids = self._render(obs, call.turn_ids)
        except BaseException:
            self._close_current()
            raise
        self._current = None
        self._keep(call.trajectory, env, call.turn + 1,
                   _digest(call.row, call.first, call.history + ((call.turn_ids, _packed(ids), reward),)))
        return StepOutcome(ids, obs, reward, done, replayed=replayed)

    def _instance(self, call: TurnCall) -> tuple[Any, int]:
        """The trajectory's live instance (0 replayed), or a new one — its first turn's, or one rebuilt by replay
        (``1 + earlier turns`` replayed; raises _Diverged) — held as the current instance (closed if it fails)."""
        entry = self._live.pop(call.trajectory, None)
        if entry is not None:
            env, turn, digest = entry
            if turn == call.turn and digest == _digest(call.row, call.first, call.history):
                self._current = env
                return env, 0
            _close(env)
        env = self._current = self._cls()
        try:
            first = observation_text(_resolved(env.reset(json.loads(call.row))))
            if first != call.first:
                raise _Diverged(self._diverged(call, "reset(row)", f"observation {first!r}",
                                               f"observation {call.first!r} (the prompt holds it)"))
            for k, (t_ids, o_ids, r) in enumerate(call.history):
                obs, reward, done = self._step(env, t_ids)
                ids = self._render(obs, t_ids)
                if _packed(ids) != o_ids or reward != r or done:
                    got, held = (self._hf.decode(list(x), skip_special_tokens=True).strip()
                                 for x in (ids, np.frombuffer(o_ids, dtype="<i4")))
                    raise _Diverged(self._diverged(call, f"the step of turn {k}",
                                                   f"observation {got!r}, reward {reward!r}, done {done}",
                                                   f"observation {held!r}, reward {r!r}, done False"))
        except Exception:
            self._close_current()
            raise
        return env, (1 + len(call.history) if call.turn else 0)

    def _diverged(self, call: TurnCall, what: str, got: str, held: str) -> str:
        return (f"{self.key} = {self.ref!r} is not deterministic: rebuilding trajectory {call.trajectory} by replay, "
                f"{what} gave {got}; the trajectory holds {held}. An environment must be a function of its row and "
                "the assistant turns (seed any randomness from the row)")

    def _step(self, env: Any, turn_ids: bytes) -> tuple[str, float, bool]:
        """``env.step`` of the turn's text, its result checked: ``(observation text, reward, done)``."""
        ids = np.frombuffer(turn_ids, dtype="<i4").tolist()
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        out = _resolved(env.step(self._hf.decode(ids, skip_special_tokens=True)))
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
            raise TypeError(f"step returned {got}; it returns (observation, reward, done)")
        obs, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float, np.number)) or not math.isfinite(reward):
            raise TypeError(f"step's reward is {reward!r}; it must be a finite number")
        if self.reward_range is not None and not self.reward_range[0] <= reward <= self.reward_range[1]:
            lo, hi = self.reward_range
            raise ValueError(f"step's reward {reward!r} is outside task.environment.reward_range [{lo:g}, {hi:g}]")
        if not isinstance(done, (bool, np.bool_)):
            raise TypeError(f"step's done is {done!r}; it must be a bool")
        return observation_text(obs), float(reward), bool(done)

    def _render(self, obs: str, turn_ids: bytes) -> list[int]:
        """Observation ids of ``obs`` as a ``user`` message after the turn; a turn that ended with the stop token the
        rendering opens with (the template's end of the assistant message) does not get it twice."""
        ids = render_observation(self._hf, obs, use_chat=self.use_chat, plain_format=self.plain_format,
                                 max_tokens=self.max_observation_tokens, role="user")
        end = np.frombuffer(turn_ids[-4:], dtype="<i4").tolist() if turn_ids else []
        if end and end[0] in self.stop_ids and len(ids) > 1 and ids[0] == end[0]:
            ids = ids[1:]
        return ids

    def _keep(self, trajectory: str, env: Any, turn: int, digest: bytes) -> None:
        self._live[trajectory] = (env, turn, digest)
        while len(self._live) > self.max_live:
            _close(self._live.popitem(last=False)[1][0])


def _packed(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


@dataclass(frozen=True)
class _Release:
    """The pool key of a trajectory's release (never a key of the caller's)."""

    trajectory: str


class EnvironmentCalls(TurnCalls):
    """Steps of trajectories' environments in a :class:`~rlboost_hpc.tasks.pool.DeadlinePool` of ``env`` workers
    (a :class:`~rlboost_hpc.tasks.tools.TurnCalls`, as the tools' pool is: ``submit``/``call``, ``poll``,
    ``observe_all``). A trajectory's calls go to one worker position (a hash of its id); its deadline is
    ``timeout_s`` when its instance is live there (the last step of it answered there, by the worker that serves
    now), else ``timeout_s × (2 + earlier turns)`` (a rebuild by replay; module docstring).

    Every submitted call completes once as an :class:`~rlboost_hpc.tasks.tools.Observation` with the step's
    ``reward``, ``done``, ``replayed`` and, on failure, ``error``; its ``obs_ids`` are empty when the trajectory ends.
    A trajectory that ends while its instance lives (no room for the observation, the trajectory dropped) is
    :meth:`release` d; a worker stopped at a deadline or by :meth:`close` closes what it holds (``timeout_s`` of
    grace before SIGKILL).

    Raises:
        ValueError: ``workers < 1`` or ``timeout_s <= 0``.
    """

    def __init__(self, env: EnvironmentRunner, *, workers: int = 1, timeout_s: float = 5.0) -> None:
        from rlboost_hpc.tasks.pool import DeadlinePool

        self.pool = DeadlinePool(env, workers=workers, timeout_s=timeout_s, grace_s=timeout_s)
        self.timeout_s = timeout_s
        self._live: dict[str, tuple[int, int]] = {}  # trajectory -> (its worker's generation, next turn)
        self._calls: dict[Any, tuple[TurnCall, int, float]] = {}  # pending key -> (call, worker position, cold s)
        self._releasing: set[str] = set()  # trajectories whose release is queued

    @property
    def turns_pending(self) -> int:
        return len(self._calls)

    def release(self, trajectories: list[str]) -> None:
        """Close the instances of ``trajectories`` that ended (those live in a worker, or with a step pending:
        after it); the others are closed already."""
        pending = {c.trajectory for c, _, _ in self._calls.values()}
        for t in trajectories:
            if t in self._releasing or not (t in self._live or t in pending):
                continue
            self._live.pop(t, None)
            self._releasing.add(t)
            self.pool.submit(_Release(t), ("release", t), slot=self._slot(t))

    def _slot(self, trajectory: str) -> int:
        return zlib.crc32(trajectory.encode()) % self.pool.workers

    def submit(self, key: Any, call: TurnCall) -> None:
        """Run one step (its result comes back under ``key``)."""
        slot = self._slot(call.trajectory)
        warm = self._live.get(call.trajectory) == (self.pool.generation(slot), call.turn)
        cold = self.timeout_s * (2 + len(call.history))
        self._calls[key] = (call, slot, cold)
        self.pool.submit(key, ("turn", call), timeout_s=self.timeout_s if warm else cold, slot=slot)

    def call(self, msg: Any) -> None:
        """Run the manager's ``EnvCall`` ``msg`` (its result comes back under ``(rid, turn)``)."""
        self.submit((msg.rid, msg.turn), TurnCall.from_msg(msg))

    def poll(self, timeout_s: float = 0.0) -> list[Observation]:
        """The steps that completed (waiting up to ``timeout_s`` seconds for the first)."""
        from rlboost_hpc.tasks.pool import CallStatus

        out = []
        for c in self.pool.poll(timeout_s):
            if isinstance(c.key, _Release):  # (a release past its deadline stopped its worker: closed in its teardown)
                self._releasing.discard(c.key.trajectory)
                continue
            call, slot, _ = self._calls.pop(c.key)
            if c.status == CallStatus.OK:
                o: StepOutcome = c.value
                if o.status == "ok" and not (o.done or call.last) and call.trajectory not in self._releasing:
                    self._live[call.trajectory] = (self.pool.generation(slot), call.turn + 1)
                else:
                    self._live.pop(call.trajectory, None)
                out.append(Observation(c.key, list(o.obs_ids), o.status, c.seconds, o.reward, o.done, o.error,
                                       o.replayed))
                continue
            self._live.pop(call.trajectory, None)
            status = "timeout" if c.status == CallStatus.TIMEOUT else "error"
            why = (f"the step ran past its {c.error.removeprefix('ran past ')} deadline" if status == "timeout"
                   else f"its worker failed ({c.error})")
            out.append(Observation(c.key, [], status, c.seconds, error=why))
            for key, (_, s, cold) in self._calls.items():  # its worker was replaced: the calls waiting for that
                if s == slot:  # position rebuild their instances
                    self.pool.set_timeout(key, cold)
        return out

    def reset_all(self, rows: list[str], names: list[str]) -> list[str]:
        """The first observation of each row (JSON text) from a fresh instance's ``reset``, under the deadline.

        Raises:
            EnvironmentResetFailed: a reset raised or ran past the deadline (the first such row named by ``names``).
            RuntimeError: other calls are pending.
        """
        from rlboost_hpc.tasks.pool import CallStatus

        done = self.pool.run_all([("reset", r) for r in rows])
        for c, name in zip(done, names):
            if c.status != CallStatus.OK:
                why = f"ran past the {self.timeout_s:g} s deadline (task.turns.timeout_s)" if (
                    c.status == CallStatus.TIMEOUT) else c.error
                h = self.pool.handler
                raise EnvironmentResetFailed(f"{h.key} = {h.ref!r}: reset(row) of {name} failed: {why}")
        return [c.value for c in done]


@dataclass(frozen=True)
class TurnSpec:
    """What answers a multi-turn task's turns, as the run hands it to the manager's process (picklable): ``env`` —
    a stateful environment (:class:`EnvironmentRunner`, ``task.environment``) or the tools
    (:class:`~rlboost_hpc.tasks.tools.ToolEnvironment`) —, its processes (``task.turns.workers``) and the deadline
    of one call, seconds (``task.turns.timeout_s``)."""

    env: Any  # EnvironmentRunner | ToolEnvironment
    workers: int
    timeout_s: float

    def calls(self) -> TurnCalls:
        """A new pool of ``workers`` processes that answers the turns (the caller closes it):
        :class:`EnvironmentCalls` for an environment, :class:`~rlboost_hpc.tasks.tools.ToolCalls` for tools."""
        cls = EnvironmentCalls if isinstance(self.env, EnvironmentRunner) else ToolCalls
        return cls(env=self.env, workers=self.workers, timeout_s=self.timeout_s)
