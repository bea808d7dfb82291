"""N_resv and available capacity from the cluster (rlboost_hpc/cluster/capacity.py)."""
from __future__ import annotations

import pytest

from rlboost_hpc.cluster.capacity import allocation_gpus, reserved_instances


@pytest.mark.parametrize("env,gpus", [
    ({}, None),                                                                       # not a Slurm job
    ({"SLURM_JOB_ID": "7"}, None),                                                    # a job without GPUs
    ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4"}, 4),
    ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_NUM_NODES": "2"}, 4),  # -N 2 --gres=gpu:2
    ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "8", "SLURM_NNODES": "4"}, 32),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0,1,2"}, 3),
])
def test_allocation_gpus_from_slurms_environment(env, gpus):
    assert allocation_gpus(env) == gpus


def test_n_resv_is_allocation_gpus_over_instance_gpus_then_config_then_one_instance():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_NUM_NODES": "2"}
    assert reserved_instances(2, 8, slurm) == (2.0, "slurm")   # Slurm's word wins over the config
    assert reserved_instances(2, 8, {}) == (4.0, "config")
    assert reserved_instances(1, None, {}) == (1.0, "default")  # the CPU demo's reserved engine
    with pytest.raises(ValueError):
        reserved_instances(0, None, {})
