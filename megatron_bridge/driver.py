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
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import traceback
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["mode", "collective", "follow", "shutdown_followers", "MODE_ENV"]

MODE_ENV = "MEGATRON_BRIDGE_DRIVER"
_IDS = itertools.count()
_FOLLOWING = False


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
    from megatron_bridge.parallel import control_group

    dist.broadcast_object_list([msg], src=0, group=control_group())


def new_id() -> int:
    return next(_IDS)


def announce_new(cls_path: str, bid: int, args: tuple, kwargs: dict) -> None:
    """Leader: tell followers to construct ``cls_path(*args, **kwargs)`` under id ``bid``."""
    if _broadcasting():
        _send(("new", bid, cls_path, args, kwargs))


def collective(fn: Callable) -> Callable:
    """Decorator for a backend method that all ranks must call: the leader broadcasts the call first."""

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any):
        if _broadcasting() and getattr(self, "_bid", None) is not None:
            _send(("call", self._bid, fn.__name__, args, kwargs))
        return fn(self, *args, **kwargs)

    return wrapper


def shutdown_followers() -> None:
    """Leader: release the followers (they return from :func:`follow`). Idempotent, no-op elsewhere."""
    global _SHUT
    if _broadcasting() and not _SHUT:
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
