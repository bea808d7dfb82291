"""Trainer backends: the built-in torch backend, and backends other packages provide through the entry-point group
``rlboost_hpc.trainer_backends`` (name → ``f(cfg, policy, common) -> TrainerBackend``; ``megatron_bridge`` registers
``megatron``), so this package never imports them."""
from __future__ import annotations

from typing import Any, Callable

#: Entry-point group of trainer backends provided by other packages.
ENTRY_POINT_GROUP = "rlboost_hpc.trainer_backends"


def plugin_backend(name: str) -> Callable[..., Any]:
    """The factory registered as ``name`` in :data:`ENTRY_POINT_GROUP`: called as ``factory(cfg, policy, common)``
    with the run config, the loaded policy (``hf_config``, ``state_dict``) and the algorithm's keyword arguments.

    Raises:
        LookupError: no installed package registers ``name`` (the message says which group was searched).
        ImportError: the providing package is installed but its dependencies are not (e.g. megatron-core).
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise LookupError(f"trainer.backend = {name!r}: no installed package provides it (entry points "
                      f"{ENTRY_POINT_GROUP!r}); reinstall this package (pip install -e .)")
