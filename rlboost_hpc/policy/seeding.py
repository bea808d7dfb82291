"""Adaptive seeding window ``T_seed`` with per-instance-count memory (RLBoost §adaptive offload).

At the start of each step the reserved (training) GPUs act as rollout engines for ``T_seed`` seconds, then
switch to training; what they have not finished becomes *seeds* that continue on the preemptible instances.
After each step the window is adapted from two idle times the step exhibited::

    T_seed ← max(floor, T_seed + (t_wait_train − t_wait_remote) / η)          (RLBoost: η = 3, floor 5 s)

* ``t_wait_train``: seconds the trainer sat idle, after it switched to training, waiting for completed groups.
  Rollout was the bottleneck, so the reserved GPUs should generate longer (larger window).
* ``t_wait_remote``: seconds the remote (preemptible) pool sat idle, after its last response of the step,
  waiting for the trainer to publish the next version. Training was the bottleneck, so the reserved GPUs
  should switch to training earlier (smaller window).

Memory ``M[n]``: the best window depends on how many preemptible instances share the rollout,
and availability changes abruptly, so the controller remembers one window per instance count ``n``:

* **store**: at the end of a step during which the count did not change (``n_instances_start ==
  n_instances_end``), ``M[n] ← T_seed`` where ``T_seed`` is the value *after* this step's adaptation (the
  best estimate for ``n``, since the step's waits were measured with that count). A later store overwrites.
* **recall**: when the count changes — within a step (``n_instances_start != n_instances_end`` in
  :meth:`SeedingWindow.update`) or between steps (:meth:`SeedingWindow.begin_step` with a count different
  from the last ``n_instances_end``) — and ``M`` holds the new count, ``T_seed ← M[new count]``.
* **first sight** of a count (no entry in ``M``): nothing is recalled; the window keeps its current,
  already adapted value and adaptation continues from there. The entry for that count is created at the end
  of the first step during which the count held constant.

Ablations: ``adapt=False`` freezes ``T_seed`` at ``initial_s`` (the update is skipped, so nothing new is ever
stored; the memory is then moot); ``memory=False`` disables store and recall (plain adaptation).

Pure and deterministic: no clock, no I/O; the state is the current window, the memory and the last count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SeedingWindow:
    """The seeding-window controller. See the module docstring for the exact rules.

    Args:
        initial_s: starting window (the reference code starts at about 150 s).
        eta: damping η of the update (3 in the paper).
        floor_s: smallest window (5 s in the paper).
        adapt: apply the wait-difference update (False: fixed-window ablation).
        memory: keep and recall ``M[n]`` (False: no-memory ablation).
        ceil_s: optional largest window (``None``: unbounded above).
    """

    initial_s: float = 150.0
    eta: float = 3.0
    floor_s: float = 5.0
    adapt: bool = True
    memory: bool = True
    ceil_s: float | None = None
    t_seed_s: float = field(init=False)
    mem: dict[int, float] = field(init=False, default_factory=dict)
    last_n: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not (self.eta > 0 and math.isfinite(self.eta)):
            raise ValueError(f"eta must be a positive finite number, got {self.eta!r}")
        if not (self.floor_s >= 0 and math.isfinite(self.floor_s)):
            raise ValueError(f"floor_s must be a finite number >= 0, got {self.floor_s!r}")
        if self.ceil_s is not None and self.ceil_s < self.floor_s:
            raise ValueError(f"ceil_s {self.ceil_s} < floor_s {self.floor_s}")
        if not math.isfinite(self.initial_s):
            raise ValueError(f"initial_s must be finite, got {self.initial_s!r}")
        self.t_seed_s = self._clamp(float(self.initial_s))

    def _clamp(self, t: float) -> float:
        t = max(self.floor_s, t)
        return min(self.ceil_s, t) if self.ceil_s is not None else t

    @property
    def value(self) -> float:
        """The window to use for the next step, seconds."""
        return self.t_seed_s

    def to_floor(self) -> float:
        """Set the window to its floor and return it (seconds): bounded staleness, where a step is mostly generated
        before it starts and a longer window would only hold training back."""
        self.t_seed_s = self._clamp(self.floor_s)
        return self.t_seed_s

    def begin_step(self, n_instances: int) -> float:
        """Call at the start of a step with the current preemptible-instance count; returns ``T_seed``.

        If the count differs from the last step's end count and ``M`` holds it, the remembered window is
        recalled; otherwise the window is unchanged (first sight: keep the current value).
        """
        if n_instances < 0:
            raise ValueError(f"n_instances must be >= 0, got {n_instances}")
        if self.memory and self.last_n is not None and n_instances != self.last_n and n_instances in self.mem:
            self.t_seed_s = self.mem[n_instances]
        self.last_n = n_instances
        return self.t_seed_s

    def update(self, t_wait_train_s: float, t_wait_remote_s: float,
               n_instances_start: int, n_instances_end: int) -> float:
        """Adapt after a step; returns the new ``T_seed`` (seconds).

        ``T_seed += (t_wait_train − t_wait_remote)/η`` clamped to ``[floor, ceil]``; then store ``M[n]`` if the
        count held through the step, or recall ``M[n_end]`` if it changed and is remembered.
        """
        for name, v in (("t_wait_train_s", t_wait_train_s), ("t_wait_remote_s", t_wait_remote_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if n_instances_start < 0 or n_instances_end < 0:
            raise ValueError("instance counts must be >= 0")
        if self.adapt:
            self.t_seed_s = self._clamp(self.t_seed_s + (t_wait_train_s - t_wait_remote_s) / self.eta)
        if self.memory and self.adapt:
            if n_instances_start == n_instances_end:
                self.mem[n_instances_end] = self.t_seed_s
            elif n_instances_end in self.mem:
                self.t_seed_s = self.mem[n_instances_end]
        self.last_n = n_instances_end
        return self.t_seed_s

    def snapshot(self) -> dict:
        """JSON-serialisable state (for reports and for restoring a restarted manager)."""
        return {"t_seed_s": self.t_seed_s, "memory": {str(k): v for k, v in sorted(self.mem.items())},
                "last_n": self.last_n}

    def restore(self, state: dict) -> None:
        """Inverse of :meth:`snapshot`."""
        self.t_seed_s = self._clamp(float(state["t_seed_s"]))
        self.mem = {int(k): float(v) for k, v in state.get("memory", {}).items()}
        self.last_n = state.get("last_n")
