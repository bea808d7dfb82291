"""OpenEnv environments (``task.environment.openenv``): a task whose stateful environment is an `OpenEnv
<https://github.com/meta-pytorch/OpenEnv>`_ server, reached through ``openenv-core``'s own client.

An OpenEnv server (``openenv.core.env_server.create_fastapi_app`` / ``create_app`` over an ``Environment``) keeps an
episode's state in a **WebSocket session** (``<url>/ws``): its HTTP ``/reset`` and ``/step`` make a fresh
environment per request and cannot hold an episode. :class:`OpenEnvEpisode` is therefore one session per trajectory:

* ``reset(row)`` opens the session and sends ``reset`` with ``seed`` (a stable function of the row, so a replay
  meets the same episode) and the row's columns named by ``reset_columns`` as keyword arguments (the server passes
  those its ``reset`` signature takes); the observation's text is the ``observation_field`` of the answer (unset:
  the observation as JSON);
* ``step(assistant_turn)`` sends the action ``{action_field: assistant_turn}``; the answer's ``reward`` (None: 0)
  and ``done`` are the step's;
* ``close()`` sends ``close`` and ends the session (the server drops its environment).

It is a stateful environment like a user's class (:mod:`rlboost_hpc.tasks.environment`): one instance per trajectory
in the manager's tool processes in the trainer's allocation — never on a rollout worker, so a preempted rollout
instance migrates the next turn, not the session —, closed exactly once on every way a trajectory ends, rebuilt by
replay (a new session: reset, the earlier turns) where it is not live, under ``task.turns.timeout_s`` per call.

**Flaky links.** A session the server or the network dropped mid-episode (the connection closed or refused) is
reopened by the same replay inside the call — up to ``retries`` times, ``backoff_s`` apart — and each replayed answer
must equal what the episode gave before (otherwise the call fails: an environment that answers otherwise on replay
cannot be trained on). An answer the server marks an error, or one that is not an observation (no ``done``, a
reward that is not a finite number), fails the call (status ``error``: ``task.rewards.errors`` decides).

All sessions of a process share one event loop in one thread (a thousand open episodes are a thousand sockets,
not a thousand threads).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from openenv.core.generic_client import GenericEnvClient  # (≈ 5 s: imported by the tool process's setup)
from websockets.exceptions import ConnectionClosed

if TYPE_CHECKING:
    from rlboost_hpc.config_task import OpenEnvCfg

__all__ = ["OpenEnvEpisode", "OpenEnvError", "row_seed"]

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


class OpenEnvError(RuntimeError):
    """The OpenEnv server answered with an error or something that is not an observation; the message names the
    server and what came back."""


def row_seed(row: dict[str, Any]) -> int:
    """The ``seed`` a row's episode is reset with: the first 4 bytes of SHA-256 over the row's canonical JSON (sorted
    keys), as an int in [0, 2³²). The same row gives the same seed in every process and every run."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _shared_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop of OpenEnv sessions, started on first use in a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openenv-sessions", daemon=True).start()
            _loop = loop
        return _loop


def _run(coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, _shared_loop()).result()


def _dropped(e: BaseException) -> bool:
    """A dropped or refused connection (reopened by replay) — not an answer of the server, nor one that did not
    come in time (a stalled server fails the call)."""
    return isinstance(e, (OSError, ConnectionClosed)) and not isinstance(e, TimeoutError)


class OpenEnvEpisode:
    """One OpenEnv episode (a WebSocket session) of one trajectory; see the module docstring.

    Args:
        cfg: ``task.environment.openenv``.
        timeout_s: deadline of one answer of the server, seconds (``task.turns.timeout_s``).

    Raises (from ``reset`` / ``step``):
        OpenEnvError: the server answered with an error, or not with an observation; or a replay after a dropped
            session answered otherwise than before.
        ConnectionError: the server could not be reached ``1 + retries`` times.
    """

    def __init__(self, cfg: OpenEnvCfg, timeout_s: float = 30.0) -> None:
        self.cfg, self.timeout_s = cfg, timeout_s
        self._client: Any = None
        self._reset_args: dict[str, Any] = {}
        self._answers: list[tuple[str, float, bool]] = []  # (observation, reward, done): reset's, then each step's
        self._actions: list[str] = []

    # ---------------------------------------------------------------- the environment contract
    def reset(self, row: dict[str, Any]) -> str:
        missing = [c for c in self.cfg.reset_columns if c not in row]
        if missing:
            raise KeyError(f"task.environment.openenv.reset_columns: the row has no column {missing[0]!r} "
                           f"(it has {sorted(row)})")
        self._reset_args = {"seed": row_seed(row), **{c: row[c] for c in self.cfg.reset_columns}}
        self._answers, self._actions = [], []
        answer = self._call(lambda client: self._reset(client))
        self._answers.append(answer)
        return answer[0]

    def step(self, assistant_turn: str) -> tuple[str, float, bool]:
        if not self._answers:
            raise OpenEnvError("step before reset")
        answer = self._call(lambda client: self._step(client, assistant_turn))
        self._actions.append(assistant_turn)
        self._answers.append(answer)
        return answer

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            self._disconnect(client)

    def _disconnect(self, client: Any) -> None:
        try:
            _run(asyncio.wait_for(client.disconnect(), self.cfg.connect_timeout_s))
        except Exception:  # noqa: BLE001 - a session already gone is closed
            pass

    # ---------------------------------------------------------------- sessions
    def _call(self, what: Any) -> tuple[str, float, bool]:
        """``what(client)`` on the episode's session; a dropped session is reopened by replay and ``what`` tried
        again, up to ``cfg.retries`` times."""
        for attempt in range(self.cfg.retries + 1):
            try:
                if self._client is None:
                    self._client = self._open()
                return _run(what(self._client))
            except Exception as e:  # noqa: BLE001
                if not _dropped(e) or attempt == self.cfg.retries:
                    if _dropped(e):
                        raise ConnectionError(f"OpenEnv server {self.cfg.url}: {type(e).__name__}: {e} "
                                              f"({attempt + 1} tries)") from e
                    raise
                self.close()
                time.sleep(self.cfg.backoff_s * (attempt + 1))
        raise AssertionError("unreachable")

    def _open(self) -> Any:
        """A new session, brought to where this episode is: reset, then every earlier action (each answer checked
        against the one the episode gave)."""
        client = GenericEnvClient(base_url=self.cfg.url, connect_timeout_s=self.cfg.connect_timeout_s,
                                  message_timeout_s=self.timeout_s)
        try:
            _run(client.connect())
            if self._answers:  # an episode under way: replay it
                again = [_run(self._reset(client))]
                again += [_run(self._step(client, a)) for a in self._actions]
                if again != self._answers:
                    k = next(i for i, (x, y) in enumerate(zip(again, self._answers)) if x != y)
                    raise OpenEnvError(f"OpenEnv server {self.cfg.url}: the session was dropped and its replay "
                                       f"answered {again[k]!r} where the episode had {self._answers[k]!r} "
                                       f"({'reset' if k == 0 else f'step {k - 1}'}): the environment is not a "
                                       "function of its seed and actions")
        except BaseException:
            self._disconnect(client)
            raise
        return client

    async def _reset(self, client: Any) -> tuple[str, float, bool]:
        r = await client.reset(**self._reset_args)
        return self._answer(r, "reset")

    async def _step(self, client: Any, turn: str) -> tuple[str, float, bool]:
        r = await client.step({self.cfg.action_field: turn})
        return self._answer(r, "step")

    def _answer(self, result: Any, what: str) -> tuple[str, float, bool]:
        """``(observation text, reward, done)`` of a client's ``StepResult``, checked."""
        obs, reward, done = result.observation, result.reward, result.done
        if not isinstance(obs, dict):
            raise OpenEnvError(f"OpenEnv server {self.cfg.url}: {what} answered observation {obs!r}, not an object")
        if reward is None:
            reward = 0.0
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise OpenEnvError(f"OpenEnv server {self.cfg.url}: {what} answered reward {reward!r}; a reward is a "
                               "finite number")
        if not isinstance(done, bool):
            raise OpenEnvError(f"OpenEnv server {self.cfg.url}: {what} answered done {done!r}, not a bool")
        field = self.cfg.observation_field
        if field is None:
            text = json.dumps({k: v for k, v in obs.items() if k not in ("reward", "done", "metadata")},
                              sort_keys=True, default=str)
        elif field not in obs:
            raise OpenEnvError(f"task.environment.openenv.observation_field = {field!r}: the {what} observation of "
                               f"{self.cfg.url} has no such field (it has {sorted(obs)})")
        else:
            value = obs[field]
            text = value if isinstance(value, str) else json.dumps(value, default=str)
        return text, float(reward), done
