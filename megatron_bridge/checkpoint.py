"""Checkpoint/resume of a :class:`~megatron_bridge.backend.MegatronBackend` with ``dist_checkpointing``.

A checkpoint directory holds (Megatron's sharded format, written by every rank in parallel):

- ``model``: the policy ``GPTModel``'s sharded state dict (ShardedTensors, TP/PP-aware);
- ``optimizer``: the Megatron optimizer's sharded state (Adam moments, fp32 main params with bf16, the
  distributed optimizer's shards);
- ``rng_state``: one ShardedObject per rank — Python, NumPy, torch CPU, CUDA and Megatron's RNG-tracker states;
- common (rank 0): ``extra`` (the caller's data position, e.g. step, version, data-iterator state) and
  ``bridge`` (format, architecture, layout) for validation.

Invariant (tested): saving after step k, constructing a fresh backend with the same initial weights and
options, loading, and running step k+1 gives exactly (fp32) the same loss and weights as the uninterrupted run.
The reference policy is not saved (it is the initial weights, which the constructor loads again).

``dist_checkpointing``'s writer may start worker processes: scripts that save must have an
``if __name__ == "__main__":`` guard (torchrun entry points and ``python -m`` modules do).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["save", "load", "FORMAT"]

FORMAT = "megatron_bridge.ckpt/1"


def _sharded(backend, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_bridge.backend import rng_state

    L = backend.layout
    model_sd = backend.gpt.sharded_state_dict()
    return {
        "model": model_sd,
        # 'dp_reshardable': fully parallel save/load of the distributed optimizer's buffers (0.16.1's default,
        # 'fully_sharded_model_space', builds flattened-range ShardedTensors that its own validation rejects).
        "optimizer": backend.opt.sharded_state_dict(model_sd, is_loading=is_loading,
                                                    metadata={"distrib_optim_sharding_type": "dp_reshardable"}),
        "rng_state": ShardedObject("rng_state", rng_state(), (L.pp, L.tp, L.dp), (L.pp_rank, L.tp_rank, L.dp_rank),
                                   replica_id=0),
    }


def _meta(backend) -> dict[str, Any]:
    L = backend.layout
    return {"format": FORMAT, "arch": backend.arch.to_dict(), "tp": L.tp, "pp": L.pp, "dp": L.dp,
            "bf16": backend.bf16}


def save(backend, path: Path, extra_state: dict[str, Any]) -> None:
    """Write the checkpoint of ``backend`` into ``path`` (all ranks call; the directory is created)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if backend.layout.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized() and backend.layout.world > 1:
        dist.barrier()
    sd = _sharded(backend, is_loading=False)
    sd["extra"] = dict(extra_state)
    sd["bridge"] = _meta(backend)
    dist_checkpointing.save(sd, str(path))


def load(backend, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and RNG states into ``backend``; returns the saved ``extra_state``.

    Raises:
        ValueError: the checkpoint was written for another architecture or layout.
        FileNotFoundError: ``path`` is not a checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    from megatron_bridge.backend import set_rng_state

    path = Path(path)
    if not (path / "metadata.json").exists() and not any(path.glob("*.distcp")) and not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint directory")
    common = dist_checkpointing.load_common_state_dict(str(path))
    meta = common.get("bridge", {})
    want = _meta(backend)
    if meta != want:
        raise ValueError(f"{path}: checkpoint is for {meta}, this backend is {want}")
    loaded = dist_checkpointing.load(_sharded(backend, is_loading=True), str(path))
    backend.gpt.load_state_dict(loaded["model"], strict=False)
    backend.opt.load_state_dict(loaded["optimizer"])
    set_rng_state(loaded["rng_state"])
    return dict(loaded.get("extra", {}))
