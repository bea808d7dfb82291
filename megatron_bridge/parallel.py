"""Process-group and model-parallel set-up for the bridge (torchrun or a single in-process rank).

Invariants:
- One layout per process: :func:`initialize` sets ``torch.distributed`` and Megatron's ``parallel_state``
  once; calling it again with the same ``tp``/``pp`` is a no-op, with different ones raises (tearing down
  Megatron's global groups under live models is never done implicitly).
- Without ``WORLD_SIZE`` in the environment (no torchrun) the process is a world of one, initialised on an
  in-memory store (no port), so ``trainer.backend = "megatron"`` runs inside the ordinary single-process run.
- Backend: NCCL when CUDA is present, gloo otherwise (then the CPU compatibility layer is installed first).
- :func:`control_group` is a gloo group over all ranks used for small Python objects (commands, metrics);
  it never carries weights.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bridge import compat

__all__ = ["Layout", "initialize", "layout", "control_group", "is_initialized"]

_LAYOUT: "Layout | None" = None
_CONTROL = None


@dataclass(frozen=True)
class Layout:
    """This rank's place in the ``tp × pp × dp`` grid (Megatron order tp-cp-ep-dp-pp)."""

    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def is_initialized() -> bool:
    return _LAYOUT is not None


def layout() -> Layout:
    """The layout set by :func:`initialize`. Raises RuntimeError before."""
    if _LAYOUT is None:
        raise RuntimeError("megatron_bridge.parallel.initialize() has not been called")
    return _LAYOUT


def control_group():
    """A gloo group over all ranks for Python-object collectives (or None in a world of one)."""
    return _CONTROL


#: Collective timeout of the process groups, seconds (``MEGATRON_BRIDGE_TIMEOUT_S`` overrides the default).
DEFAULT_TIMEOUT_S = 1800.0
_TIMEOUT_S: float | None = None


def collective_timeout_s() -> float:
    """The collective timeout the groups were (or will be) created with, seconds."""
    if _TIMEOUT_S is not None:
        return _TIMEOUT_S
    return float(os.environ.get("MEGATRON_BRIDGE_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def initialize(tp: int = 1, pp: int = 1, *, seed: int = 1234, timeout_s: float | None = None) -> Layout:
    """Initialise ``torch.distributed`` (if needed), Megatron's model-parallel groups and RNG tracker.

    Args:
        tp, pp: tensor- and pipeline-parallel sizes; ``dp = world / (tp·pp)``.
        seed: Megatron's ``model_parallel_cuda_manual_seed`` seed (also seeds torch's CPU generator).
        timeout_s: collective timeout of the process groups (default :func:`collective_timeout_s`); a follower
            waiting for the leader's next call is kept alive within it (``driver`` keepalive).

    Raises:
        ValueError: the world size is not a multiple of ``tp·pp``, or a different layout is already set.
    """
    global _LAYOUT, _CONTROL, _TIMEOUT_S
    if _LAYOUT is not None:
        if (_LAYOUT.tp, _LAYOUT.pp) != (tp, pp):
            raise ValueError(f"this process is already initialised with tp={_LAYOUT.tp}, pp={_LAYOUT.pp}; "
                             f"cannot switch to tp={tp}, pp={pp}")
        return _LAYOUT
    compat.install()
    timeout_s = _TIMEOUT_S = collective_timeout_s() if timeout_s is None else float(timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp·pp = {tp}·{pp}")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    with compat.scope():
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         distributed_timeout_minutes=max(1, int(timeout_s // 60)))
        elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise ValueError("Megatron parallel_state is already initialised with another layout")
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _CONTROL = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None
    _LAYOUT = Layout(rank=rank, world=world, tp=tp, pp=pp, dp=world // (tp * pp),
                     tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                     dp_rank=ps.get_data_parallel_rank())
    return _LAYOUT
