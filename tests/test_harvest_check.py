"""scavenger/check.py (``rlboost-hpc harvest check``): the pure judgement on slurmctld's own output (captured from
the local Slurm 22.05 cluster), and the command against the live local cluster."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scavenger.check import check_cluster, expand_hostlist, parse_config, parse_partitions

CONFIG = """Configuration data as of 2026-12-05T08:30:00
AccountingStorageType   = accounting_storage/slurmdbd
ClusterName             = rlboost
GresTypes               = gpu
JobRequeue              = 1
KillWait                = 5 sec
PreemptMode             = REQUEUE
PreemptType             = preempt/partition_prio
SlurmctldParameters     = preempt_send_user_signal
"""
PARTITIONS = (
    "PartitionName=train AllowGroups=ALL Default=NO GraceTime=0 Hidden=NO Nodes=n[1-4] PriorityTier=100 "
    "PreemptMode=OFF State=UP TotalCPUs=16 TRES=cpu=16,mem=4G,node=4,billing=16,gres/gpu=8\n"
    "PartitionName=scavenger AllowGroups=ALL Default=YES GraceTime=10 Hidden=NO Nodes=n[1-4] PriorityTier=1 "
    "PreemptMode=REQUEUE State=UP TotalCPUs=16 TRES=cpu=16,mem=4G,node=4,billing=16,gres/gpu=8\n")


def judge(config=CONFIG, partitions=PARTITIONS):
    cluster, checks = check_cluster(parse_config(config), parse_partitions(partitions))
    return cluster, {c.partition: c for c in checks}


def test_the_local_cluster_harvests_its_scavenger_partition_and_not_the_owners_one():
    cluster, p = judge()
    assert all(f.level == "ok" for f in cluster)
    assert p["scavenger"].harvestable and p["scavenger"].preempted_by == ["train"] and p["scavenger"].gpus == 8
    assert not p["train"].harvestable
    # the owners' partition: never the advice to make it preemptible (a new user's finding, issue 45)
    [f] = p["train"].findings
    assert "owners' partition" in f.seen and "harvest scavenger" in f.change and "REQUEUE" not in f.change


def test_without_the_user_signal_it_warns_of_the_lost_grace_time_and_names_killwait():
    cluster, p = judge(CONFIG.replace("SlurmctldParameters     = preempt_send_user_signal\n", ""))
    warn = [f for f in cluster if f.level == "warn"]
    assert len(warn) == 1 and "KillWait = 5 s" in warn[0].seen and "preempt_send_user_signal" in warn[0].change
    assert p["scavenger"].harvestable  # it works, later than it could


@pytest.mark.parametrize("mode,harvestable,says", [("SUSPEND", False, "GPU memory"), ("CANCEL", True, "cancelled"),
                                                    ("REQUEUE,GANG", True, "comes back")])
def test_the_preempt_mode_decides(mode, harvestable, says):
    _, p = judge(partitions=PARTITIONS.replace("PreemptMode=REQUEUE", f"PreemptMode={mode}"))
    assert p["scavenger"].harvestable is harvestable
    assert any(says in f.seen for f in p["scavenger"].findings)


def test_nothing_to_preempt_it_no_grace_no_gpus_and_no_preemption_at_all():
    lone = PARTITIONS.replace("Nodes=n[1-4] PriorityTier=100", "Nodes=n[5-8] PriorityTier=100")
    _, p = judge(partitions=lone)
    assert not p["scavenger"].harvestable and p["scavenger"].preempted_by == []
    bare = PARTITIONS.replace("GraceTime=10", "GraceTime=0").replace(",gres/gpu=8", "")
    _, p = judge(partitions=bare)
    levels = {f.seen.split(":")[0]: f.level for f in p["scavenger"].findings}
    assert p["scavenger"].harvestable and levels["GraceTime=0"] == "warn" and p["scavenger"].gpus == 0
    cluster, p = judge(CONFIG.replace("preempt/partition_prio", "preempt/none"))
    assert cluster[0].level == "fail" and not any(c.harvestable for c in p.values())


def test_preemption_by_qos_is_said_and_not_guessed():
    cluster, p = judge(CONFIG.replace("preempt/partition_prio", "preempt/qos"))
    assert any("preempt/qos" in f.seen and "sacctmgr" in f.change for f in cluster)
    assert p["scavenger"].preempted_by == []  # partitions' tiers say nothing under QoS preemption


def test_hostlists_expand_as_slurm_writes_them():
    assert expand_hostlist("n[1-3,7],gpu01") == {"n1", "n2", "n3", "n7", "gpu01"}
    assert expand_hostlist("node[08-10]") == {"node08", "node09", "node10"}


@pytest.mark.slurm
def test_harvest_check_against_the_local_cluster():
    from _slurm_local import ensure_local_slurm
    import os

    env = {**os.environ, **ensure_local_slurm()}
    run = [sys.executable, "-m", "rlboost_hpc.cli", "harvest", "check"]
    p = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "partition scavenger: harvestable" in p.stdout, p.stdout + p.stderr
    p = subprocess.run(run + ["--partition", "train", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert [c["partition"] for c in doc["partitions"]] == ["train"] and not doc["partitions"][0]["harvestable"]
    p = subprocess.run(run + ["--partition", "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no such partition" in p.stderr and "scavenger" in p.stderr
