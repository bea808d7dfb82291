"""An OpenEnv environment served by ``openenv-core`` (``task.environment.openenv``): the counter of
``examples/env_counter`` written as an OpenEnv ``Environment`` — a team's environment in the standard's own shape,
reached over its WebSocket sessions, not a class of rlboost-hpc's.

Run it (its own process; the run's manager opens one session per trajectory on ``<url>/ws``)::

    python examples/openenv_counter/server.py --port 8011

``reset(seed, start, target)`` says where the counter is; each ``step(CounterAction(message=...))`` moves it by the
words "up" and "down" in the message: reaching the target ends the episode with reward 1, a step closer earns 0.1
(one away loses 0.1). It is deterministic (a function of reset's arguments and the messages), as an environment
rebuilt by replay must be.

``--max-sessions`` caps the concurrent sessions (OpenEnv's ``max_concurrent_envs``); ``/sessions`` (GET) reports
how many sessions this server opened and closed and how many are open now — what the tests read.
"""
from __future__ import annotations

import argparse
import re
import threading
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field

_counts = {"opened": 0, "closed": 0}
_lock = threading.Lock()


class CounterAction(Action):
    message: str = Field(..., description="the assistant's turn: 'up' and 'down' move the counter")


class CounterObservation(Observation):
    text: str = Field("", description="where the counter is, in words")
    value: int = 0
    target: int = 0


class Counter(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.value = self.target = 0
        self._state = State(step_count=0)
        with _lock:
            _counts["opened"] += 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, start: int = 0, target: int = 3,
              **kwargs: Any) -> CounterObservation:
        self.value, self.target = int(start), int(target)
        self._state = State(episode_id=episode_id, step_count=0)
        return self._where(0.0, False)

    def step(self, action: CounterAction, timeout_s: float | None = None, **kwargs: Any) -> CounterObservation:
        self._state.step_count += 1
        words = re.findall(r"[a-z]+", action.message.lower())
        before = abs(self.target - self.value)
        self.value += words.count("up") - words.count("down")
        if self.value == self.target:
            return CounterObservation(text=f"Counter {self.value}: target reached!", value=self.value,
                                      target=self.target, reward=1.0, done=True)
        return self._where(round(0.1 * (before - abs(self.target - self.value)), 6), False)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with _lock:
            _counts["closed"] += 1

    def _where(self, reward: float, done: bool) -> CounterObservation:
        return CounterObservation(text=f"Counter {self.value}, target {self.target}: up or down?", value=self.value,
                                  target=self.target, reward=reward, done=done)


def make_app(max_sessions: int = 1024):
    app = create_fastapi_app(Counter, CounterAction, CounterObservation, max_concurrent_envs=max_sessions)

    @app.get("/sessions")
    def sessions() -> dict:
        with _lock:
            return {**_counts, "open": _counts["opened"] - _counts["closed"]}

    return app


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--max-sessions", type=int, default=1024)
    a = ap.parse_args()
    uvicorn.run(make_app(a.max_sessions), host=a.host, port=a.port, log_level="warning")
