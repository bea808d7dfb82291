"""A stateful multi-turn environment of a user's own (``task.environment = { class_path = "envs.py:Counter" }``).

One ``Counter`` per trajectory lives in the manager's tool processes, in the trainer's allocation. ``reset(row)`` reads
the row's ``start`` and ``target`` columns and says where the counter is (appended to the prompt); every assistant
turn goes to ``step``: each word "up" adds one, each "down" takes one away; reaching the target ends the trajectory
with reward 1, and every step that gets closer earns 0.1 (one that moves away loses 0.1).

It is deterministic — a function of the row and the turns, nothing random, no clock — as an environment must be: a
restarted manager rebuilds it by replaying the trajectory's turns, and checks that it answers as before.
"""
from __future__ import annotations

import re


class Counter:
    def reset(self, row: dict) -> str:
        self.value, self.target = int(row["start"]), int(row["target"])
        return self._where()

    def step(self, assistant_turn: str) -> tuple[str, float, bool]:
        words = re.findall(r"[a-z]+", assistant_turn.lower())
        before = abs(self.target - self.value)
        self.value += words.count("up") - words.count("down")
        if self.value == self.target:
            return f"Counter {self.value}: target reached!", 1.0, True
        return self._where(), 0.1 * (before - abs(self.target - self.value)), False

    def _where(self) -> str:
        return f"Counter {self.value}, target {self.target}: up or down?"
