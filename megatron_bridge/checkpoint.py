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

Saving is synchronous. ``dist_checkpointing``'s writer forks one process per write bucket and collects their
results through a queue it creates with a *spawn*-context ``multiprocessing.Manager`` — which re-imports the
``__main__`` module, so a script without an ``if __name__ == "__main__":`` guard dies with ``EOFError``. For a
synchronous save that queue is only used inside the saving process, so :func:`save` installs a plain
thread-safe ``queue.Queue`` first (:func:`_in_process_results_queue`): no spawned process, no guard needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.arch import arch_dict

__all__ = ["save", "load", "FORMAT"]

FORMAT = "megatron_bridge.ckpt/1"


def _sharded(backend, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_bridge.rng import rng_state

    L = backend.layout
    model_sd = backend.gpt.sharded_state_dict()
    if backend.lora is not None:  # the base is the initial weights (loaded again by the constructor): adapter only
        model_sd = {k: v for k, v in model_sd.items() if k.startswith("lora.")}
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
    lo = backend.lora_settings
    return {"format": FORMAT, "arch": arch_dict(backend.arch), "tp": L.tp, "pp": L.pp, "dp": L.dp,
            "bf16": backend.bf16,
            "lora": None if lo is None else {"rank": lo.rank, "alpha": lo.alpha, "targets": list(lo.targets)}}


def _in_process_results_queue() -> None:
    """See the module docstring: a synchronous save needs no cross-process results queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def _barrier(backend) -> None:
    if dist.is_initialized() and backend.layout.world > 1:
        dist.barrier()


def save(backend, path: Path, extra_state: dict[str, Any]) -> None:
    """Write the checkpoint of ``backend`` into the directory ``path`` (all ranks call).

    Atomic: written into ``<path>.partial`` and renamed by rank 0 once every rank has finished, so ``path`` is
    either a complete checkpoint or absent (an existing one is replaced only after the new one is complete) —
    a job preempted mid-save resumes from the previous checkpoint.
    """
    import shutil

    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if backend.layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(backend)
    sd = _sharded(backend, is_loading=False)
    sd["extra"] = dict(extra_state)
    sd["bridge"] = _meta(backend)
    dist_checkpointing.save(sd, str(partial))
    _barrier(backend)
    if backend.layout.rank == 0:
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(backend)


def _restore_adam_steps(opt) -> None:
    """Copy the step count the distributed optimizer restores into ``param_groups[i]["step"]`` (the
    TransformerEngine/Apex FusedAdam convention) into the per-parameter ``state[p]["step"]`` that
    ``torch.optim.AdamW`` — Megatron's fallback without TE/Apex, as on CPU — actually reads. Without this
    the bias correction restarts from the pre-load count and the first step after resume differs."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for g in inner.param_groups:
            if "step" not in g:
                continue
            for p in g["params"]:
                st = inner.state.get(p)
                if st and "step" in st:
                    old = st["step"]
                    st["step"] = (torch.full_like(old, float(g["step"])) if torch.is_tensor(old) else g["step"])


def load(backend, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and RNG states into ``backend``; returns the saved ``extra_state``.

    Raises:
        ValueError: the checkpoint was written for another architecture or layout.
        FileNotFoundError: ``path`` is not a checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    from megatron_bridge.rng import set_rng_state

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint directory (no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    meta = common.get("bridge", {})
    want = _meta(backend)
    if meta != want:
        raise ValueError(f"{path}: checkpoint is for {meta}, this backend is {want}")
    loaded = dist_checkpointing.load(_sharded(backend, is_loading=True), str(path))
    with torch.no_grad():  # the distributed optimizer copies into views of parameters
        backend.gpt.load_state_dict(loaded["model"], strict=False)
        backend.opt.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(backend.opt)
    set_rng_state(loaded["rng_state"])
    return dict(loaded.get("extra", {}))
