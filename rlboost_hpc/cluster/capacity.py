"""What the controller knows about the cluster: the reserved side's size (N_resv) and the preemptible capacity
that could be held now (the cap's upper clamp).

* **N_resv** (:func:`reserved_instances`): the GPUs of the trainer allocation, in rollout-instance equivalents
  (GPUs ÷ ``rollout.gpus_per_instance``). The GPUs come from the trainer job's Slurm environment
  (:func:`allocation_gpus`), else ``trainer.gpus``; outside Slurm with neither, the reserved side counts as one
  instance (the CPU demo's reserved engine).
* **Available capacity** (:func:`available_from_scavenger`): under Slurm the scavenger writes its view at every
  reconciliation (``RUN_DIR/capacity.json``, :meth:`rlboost_hpc.rundir.RunDir.write_capacity`): rollout jobs of the run
  that are live and not leaving, plus the idle slots of its partition for the instance's GPU count. The trainer
  reads it at step boundaries; a view older than ``max_age_s`` (a dead scavenger) is "unknown" (``None``: no
  upper clamp beyond ``cluster.max_workers``). With the embedded local cluster the replayed trace's offered
  slots are the capacity.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

from rlboost_hpc.rundir import RunDir, RunDirError


def allocation_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """GPUs of the current Slurm job: (``SLURM_GPUS_ON_NODE``, else the count of ``SLURM_JOB_GPUS`` /
    ``SLURM_STEP_GPUS`` indices) × ``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES``, 1 when unset); ``None`` outside a
    Slurm job or when Slurm gave it no GPU. (Slurm 22.05 sets all of these for ``-N 2 --gres=gpu:2``: 2, "0,1", 2.)"""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    n_nodes = int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1
    per_node = env.get("SLURM_GPUS_ON_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node) * n_nodes
    for key in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):  # the batch node's GPU indices (nodes are alike)
        ids = [x for x in env.get(key, "").split(",") if x.strip()]
        if ids:
            return len(ids) * n_nodes
    return None


def reserved_instances(gpus_per_instance: int, configured_gpus: int | None = None,
                       env: Mapping[str, str] | None = None) -> tuple[float, str]:
    """N_resv in preemptible-instance equivalents and where the GPU count came from (``"slurm"``,
    ``"config"`` or ``"default"``). Raises ValueError for ``gpus_per_instance < 1``."""
    if gpus_per_instance < 1:
        raise ValueError(f"gpus_per_instance must be >= 1, got {gpus_per_instance}")
    gpus = allocation_gpus(env)
    if gpus is not None:
        return gpus / gpus_per_instance, "slurm"
    if configured_gpus is not None:
        return configured_gpus / gpus_per_instance, "config"
    return 1.0, "default"


def available_from_scavenger(run_dir: str | os.PathLike[str], max_age_s: float = 120.0,
                             now: float | None = None) -> int | None:
    """Instances the run could hold now according to the scavenger's last view (live + idle slots), or
    ``None`` when there is no view, it is unreadable, or older than ``max_age_s`` seconds."""
    try:
        view = RunDir(run_dir).read_capacity()
    except RunDirError:
        return None
    if view is None or (time.time() if now is None else now) - view.ts > max_age_s:
        return None
    return view.live_jobs + view.idle_slots
