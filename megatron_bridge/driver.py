"""Leader/follower execution of collective backend calls.

The RL loop (manager client, rewards, weight server) runs on global rank 0 only, but every Megatron call is a
collective over all ranks. In *leader* mode (set by ``python -m megatron_bridge.launch``), rank 0 runs the
program and each public call of a :class:`~megatron_bridge.backend.MegatronBackend` is first broadcast — name
and picklable arguments (token ids, advantages; never weights on the hot path) — over a gloo control group;
the other ranks sit in :func:`follow` and execute the same calls on their own instance. In *spmd* mode every
rank runs the program itself and makes the same calls (Megatron-LM style); nothing is broadcast.

Invariants:
- Calls execute in the same order on every rank (one broadcast per call, from rank 0).
- A follower that fails prints its traceback and exits non-zero at once, so the leader's next collective
  fails instead of hanging (torchrun then stops the whole job).
- Results are returned on rank 0; followers' return values are discarded.
- Waiting for the next call never runs into the control group's collective timeout: while the leader is idle
  between calls (e.g. a step's rollout, minutes long) a keepalive thread broadcasts a no-op every
  :func:`keepalive_interval_s` (a quarter of the timeout), under the same lock as every other broadcast and
  never while a call runs, so the order of calls is unchanged.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["mode", "collective", "follow", "shutdown_followers", "MODE_ENV"]

MODE_ENV = "MEGATRON_BRIDGE_DRIVER"
_IDS = itertools.count()
_FOLLOWING = False
_LOCK = threading.Lock()  # every broadcast on the control group, and the in-call flag
_IN_CALL = 0  # calls in progress on the leader (the followers are busy in them)
_LAST_SEND = 0.0
_KEEPALIVE: threading.Thread | None = None


def keepalive_interval_s() -> float:
    """Seconds between no-ops while the leader is idle: a quarter of the control group's timeout."""
    from megatron_bridge.parallel import collective_timeout_s

    return max(0.5, collective_timeout_s() / 4.0)


def mode() -> str:
    """``"leader"`` (rank 0 drives, others follow) or ``"spmd"`` (every rank runs the program)."""
    m = os.environ.get(MODE_ENV, "spmd")
    if m not in ("leader", "spmd"):
        raise ValueError(f"{MODE_ENV}={m!r} must be 'leader' or 'spmd'")
    return m


def _broadcasting() -> bool:
    return (not _FOLLOWING and mode() == "leader" and dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_rank() == 0)


def _send(msg: tuple) -> None:
    """Broadcast ``msg`` to the followers (caller holds ``_LOCK``)."""
    global _LAST_SEND
    from megatron_bridge.parallel import control_group

    dist.broadcast_object_list([msg], src=0, group=control_group())
    _LAST_SEND = time.monotonic()


def _keepalive() -> None:
    interval = keepalive_interval_s()
    while not _SHUT:
        time.sleep(min(1.0, interval / 4))
        with _LOCK:
            if not _SHUT and _IN_CALL == 0 and time.monotonic() - _LAST_SEND >= interval:
                _send(("noop", None, None, (), {}))


def _ensure_keepalive() -> None:
    global _KEEPALIVE
    if _KEEPALIVE is None and _broadcasting():
        _KEEPALIVE = threading.Thread(target=_keepalive, name="megatron-bridge-keepalive", daemon=True)
        _KEEPALIVE.start()


def new_id() -> int:
    return next(_IDS)


def announce_new(cls_path: str, bid: int, args: tuple, kwargs: dict) -> None:
    """Leader: tell followers to construct ``cls_path(*args, **kwargs)`` under id ``bid``."""
    if _broadcasting():
        with _LOCK:
            _send(("new", bid, cls_path, args, kwargs))
        _ensure_keepalive()


def collective(fn: Callable) -> Callable:
    """Decorator for a backend method that all ranks must call: the leader broadcasts the call first."""

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any):
        global _IN_CALL
        if not (_broadcasting() and getattr(self, "_bid", None) is not None):
            return fn(self, *args, **kwargs)
        with _LOCK:
            _send(("call", self._bid, fn.__name__, args, kwargs))
            _IN_CALL += 1  # the followers are busy in this call: no keepalive until it returns
        try:
            return fn(self, *args, **kwargs)
        finally:
            with _LOCK:
                _IN_CALL -= 1

    return wrapper


def shutdown_followers() -> None:
    """Leader: release the followers (they return from :func:`follow`). Idempotent, no-op elsewhere."""
    global _SHUT
    if _broadcasting() and not _SHUT:
        with _LOCK:
            _SHUT = True
            _send(("exit", None, None, (), {}))


_SHUT = False


def follow() -> None:
    """Follower main loop: execute the leader's calls until it shuts down. Exits the process on failure."""
    global _FOLLOWING
    _FOLLOWING = True
    objects: dict[int, Any] = {}
    while True:
        box: list[Any] = [None]
        from megatron_bridge.parallel import control_group

        dist.broadcast_object_list(box, src=0, group=control_group())
        op, bid, name, args, kwargs = box[0]
        try:
            if op == "exit":
                return
            if op == "noop":  # the leader's keepalive while it is idle
                continue
            if op == "new":
                mod, _, cls = name.rpartition(".")
                import importlib

                objects[bid] = getattr(importlib.import_module(mod), cls)(*args, _bid=bid, **kwargs)
            elif op == "call":
                getattr(objects[bid], name)(*args, **kwargs)
                if name == "close":
                    objects.pop(bid, None)
            else:  # pragma: no cover - protocol guard
                raise RuntimeError(f"unknown driver op {op!r}")
        except BaseException:  # noqa: BLE001 - a follower must never hang the job
            rank = dist.get_rank()
            sys.stderr.write(f"[megatron_bridge follower rank {rank}] {op} {name} failed:\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
