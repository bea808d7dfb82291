"""The scavenger's pyslurm path: choosing it (release match with ``sinfo --version``), mapping pyslurm objects to
the scavenger's NodeInfo/JobInfo, and — against a STAND-IN for pyslurm over the real local Slurm cluster (pyslurm
cannot be built for its 22.05) — the same nodes and jobs as the CLI client, signals to the batch shell, cancels.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest
from _util import wait_for

from scavenger import pyslurm_api
from scavenger.pyslurm_api import PyslurmClient, PyslurmUnavailable, job_info, node_info, release_of, slurm_api
from scavenger.slurm import SlurmClient
from scavenger.slurm_records import JobClass


def test_release_of_versions_as_slurm_and_pyslurm_print_them():
    assert release_of("25.11.2") == "25.11"
    assert release_of("slurm 22.05.8") == "22.05"
    assert release_of("slurm-wlm 23.02.7\n") == "23.02"
    assert release_of("pyslurm") is None and release_of("") is None


def test_pyslurm_objects_map_to_node_and_job_info():
    n = SimpleNamespace(name="g1", state="MIXED+DRAIN", partitions=["scavenger"], total_cpus=64, allocated_cpus=8,
                        configured_gres={"gpu:a100": 8, "shard": 16},
                        allocated_gres={"gpu": {"count": 3, "indexes": "0-2"}})
    ni = node_info(n)
    assert (ni.name, ni.state, ni.state_flags, ni.partitions) == ("g1", "MIXED", ("DRAIN",), ("scavenger",))
    assert (ni.cpus, ni.alloc_cpus, ni.gres_total_gpus, ni.gres_used_gpus) == (64, 8, 8, 3)
    assert not ni.usable and ni.free_gpus == 0  # draining: no new work
    j = SimpleNamespace(id=17, name="rlboost-rollout-x", comment="rlboost:x", state="PENDING", state_reason="None",
                        partition="scavenger", requeue_count=2, allocated_nodes=None, submit_time=1700000000,
                        start_time=0, end_time=0, allocated_tres={}, requested_tres={"cpu": "1", "gres/gpu": "2"},
                        exit_code=0, exit_code_signal=0, is_requeueable=True, user_id=0)
    ji = job_info(j)
    assert (ji.job_id, ji.state, ji.state_reason, ji.restart_cnt, ji.nodes) == ("17", "PENDING", "", 2, "")
    assert ji.submit_time == 1700000000 and ji.start_time is None and ji.gpus == 2 and ji.requeue is True
    assert ji.job_class is JobClass.PENDING and ji.tres == "cpu=1,gres/gpu=2"


class _Versions:
    """Patch ``SlurmClient.run`` so ``sinfo --version`` answers ``cluster`` without a cluster."""

    def __init__(self, monkeypatch, cluster: str):
        monkeypatch.setattr(SlurmClient, "run", lambda self, argv, *a, **k: cluster)


def _fake_pyslurm(version: str, new_api: bool = True):
    m = SimpleNamespace(__version__=version)
    if new_api:
        m.Nodes = m.Jobs = m.Job = object
    return m


def test_slurm_api_chooses_pyslurm_only_when_its_release_matches(monkeypatch, caplog):
    _Versions(monkeypatch, "slurm 25.11.0")
    assert type(slurm_api("auto", module=_fake_pyslurm("25.11.2"))) is PyslurmClient
    assert type(slurm_api("pyslurm", module=_fake_pyslurm("25.11.2"))) is PyslurmClient
    assert type(slurm_api("cli", module=_fake_pyslurm("25.11.2"))) is SlurmClient
    caplog.set_level("INFO", logger="scavenger.pyslurm_api")
    assert type(slurm_api("auto", module=_fake_pyslurm("24.05.4"))) is SlurmClient
    assert "built for Slurm 24.05, the cluster runs 25.11" in caplog.text
    with pytest.raises(PyslurmUnavailable, match="built for Slurm 24.05"):
        slurm_api("pyslurm", module=_fake_pyslurm("24.05.4"))
    with pytest.raises(PyslurmUnavailable, match="no Nodes/Jobs API"):
        slurm_api("pyslurm", module=_fake_pyslurm("22.5.0", new_api=False))

    def no_pyslurm():
        raise ImportError("No module named 'pyslurm'")

    monkeypatch.setattr(pyslurm_api, "_import_pyslurm", no_pyslurm)
    assert type(slurm_api("auto")) is SlurmClient
    with pytest.raises(PyslurmUnavailable, match="import pyslurm failed"):
        slurm_api("pyslurm")
    with pytest.raises(ValueError, match="slurm_api must be one of"):
        slurm_api("rest")


def test_scavenger_refuses_slurm_api_pyslurm_without_pyslurm(tmp_path):
    """Exit 2 naming the setting, not a traceback (no pyslurm can be installed on this machine)."""
    cfg = tmp_path / "scav.toml"
    cfg.write_text('[scavenger]\nslurm_api = "pyslurm"\n')
    (tmp_path / "run").mkdir()
    p = subprocess.run([sys.executable, "-m", "scavenger.cli", str(tmp_path / "run"), "--config", str(cfg), "--once"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "slurm_api = 'pyslurm' cannot be used" in p.stderr and "Traceback" not in p.stderr
    bad = subprocess.run([sys.executable, "-m", "scavenger.cli", str(tmp_path / "run"), "--slurm-api", "rest"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--slurm-api" in bad.stderr


TRAP = """#!/bin/bash
trap 'echo usr2 >> "$MARK"' USR2
echo start >> "$MARK"
while :; do sleep 300 & wait $!; done
"""


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_pyslurm_client_over_the_standin_sees_what_the_cli_sees_and_signals_the_batch_shell(tmp_path):
    from _slurm_local import ensure_local_slurm
    from pyslurm_standin import PyslurmStandIn

    env = ensure_local_slurm()
    cli = SlurmClient(env=env, timeout_s=15)
    standin = PyslurmStandIn(env, version="22.05.0")
    client = slurm_api("auto", env=env, module=standin)
    assert type(client) is PyslurmClient  # the stand-in claims the cluster's release
    assert type(slurm_api("auto", env=env, module=PyslurmStandIn(env, version="25.11.2"))) is SlurmClient

    def by_name(nodes):
        return sorted(nodes, key=lambda n: n.name)

    wait_for(lambda: by_name(client.sinfo_nodes()) == by_name(cli.sinfo_nodes()), 20, "the same nodes", interval=0.5)
    assert by_name(client.sinfo_nodes("scavenger")) == by_name(cli.sinfo_nodes("scavenger"))
    assert ["sinfo", "-N", "--json"] in standin.calls

    tag = f"rlboost:standin-{uuid.uuid4().hex[:8]}"
    mark = tmp_path / "mark"
    script = tmp_path / "job.sh"
    script.write_text(TRAP)
    jid = client.sbatch(script, [f"--comment={tag}", "--job-name=rlboost-standin", "--partition=scavenger",
                                 "--gres=gpu:1", "--requeue", f"--output={tmp_path}/out.txt"],
                        env={"MARK": str(mark)})
    try:
        wait_for(lambda: mark.exists() and "start" in mark.read_text(), 60, "the job to start", interval=0.5)

        def same_view() -> bool:
            a, b = client.squeue_jobs(comment_tag=tag), cli.squeue_jobs(comment_tag=tag)
            keys = lambda j: (j.job_id, j.name, j.comment, j.state, j.partition, j.gpus, j.restart_cnt, j.nodes,
                              j.requeue, j.submit_time, j.start_time)
            return len(a) == 1 and [keys(j) for j in a] == [keys(j) for j in b] and a[0].state == "RUNNING"

        wait_for(same_view, 20, "the pyslurm and CLI views of the job to agree", interval=0.5)
        [job] = client.squeue_jobs(comment_tag=tag)
        assert job.job_id == jid and job.gpus == 1 and job.requeue is True
        assert [j.job_id for j in client.squeue_jobs(name_prefix="rlboost-standin")] == [jid]
        assert client.squeue_jobs(comment_tag="rlboost:nobody") == []

        client.scancel([jid], signal="USR2", batch=True)  # the warning: to the batch shell only
        wait_for(lambda: "usr2" in mark.read_text(), 20, "USR2 to reach the batch shell", interval=0.3)
        assert ["scancel", "--signal=12", "--batch", jid] in standin.calls
        assert client.squeue_jobs(comment_tag=tag)[0].state == "RUNNING"  # a signal, not a cancel

        client.scancel([jid])
        wait_for(lambda: not client.squeue_jobs(comment_tag=tag), 30, "the cancelled job to leave", interval=0.5)
        [done] = client.squeue_jobs(comment_tag=tag, all_states=True)
        assert done.terminal and done.state == "CANCELLED"
    finally:
        subprocess.run(["scancel", jid], env={**os.environ, **env}, capture_output=True)
        t0 = time.monotonic()
        while cli.squeue_jobs(comment_tag=tag) and time.monotonic() - t0 < 30:
            time.sleep(0.5)
