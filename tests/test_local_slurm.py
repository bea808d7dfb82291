"""The project's local Slurm cluster (sbatch/local-cluster/up) behaves as the rest of the project assumes.

Real Slurm 22.05 daemons, real jobs: fake GPUs are scheduled and exported as CUDA_VISIBLE_DEVICES, 8 one-GPU
scavenger jobs share the 4 nodes, a ``train`` job preempts scavenger jobs (requeued, restart_cnt, sacct -D
records), the batch shell gets USR2 at the moment of preemption, and ``up`` is idempotent. These tests never
skip: :func:`ensure_local_slurm` brings the cluster up (root). Every job is cancelled at the end of its test.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from _util import wait_for

from _slurm_local import LOCAL_CLUSTER_DIR, ensure_local_slurm, local_slurm_env

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

TERMINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return {**os.environ, **ensure_local_slurm()}


def sl(env: dict[str, str], *args: str, timeout: float = 30) -> str:
    out = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)} -> {out.returncode}: {out.stderr}"
    return out.stdout



class Jobs:
    """Submits jobs under one unique name and cancels all of them at the end of the test."""

    def __init__(self, env: dict[str, str], tag: str):
        self.env, self.name, self.ids = env, f"rlbtest-{tag}-{uuid.uuid4().hex[:6]}", []

    def sbatch(self, *args: str) -> int:
        jid = int(sl(self.env, "sbatch", "--parsable", f"--job-name={self.name}", *args).strip().split(";")[0])
        self.ids.append(jid)
        return jid

    def states(self) -> dict[int, dict]:
        data = json.loads(sl(self.env, "squeue", "--json"))
        return {j["job_id"]: j for j in data["jobs"] if j["job_id"] in self.ids}

    def in_state(self, state: str, ids=None) -> list[int]:
        st = self.states()
        return [i for i in (ids or self.ids) if i in st and st[i]["job_state"] == state]

    def cancel_all(self) -> None:
        if not self.ids:
            return
        subprocess.run(["scancel", *map(str, self.ids)], env=self.env, capture_output=True, timeout=30)
        wait_for(lambda: all(j["job_state"] in TERMINAL for j in self.states().values()), 30,
                 f"jobs {self.ids} to end after scancel")


@pytest.fixture
def jobs(env, request):
    j = Jobs(env, request.node.name.replace("test_", "")[:20])
    wait_for(lambda: set(sl(env, "sinfo", "-h", "-N", "-o", "%T").split()) == {"idle"}, 30,
             "all nodes idle before the test (leftover jobs from another test?)")
    yield j
    j.cancel_all()


def sacct_records(env, jid: int) -> list[str]:
    out = sl(env, "sacct", "-D", "-X", "-n", "-P", "-j", str(jid), "-o", "JobID,State")
    return [ln.split("|")[1] for ln in out.splitlines() if ln.strip()]


def test_cluster_shape(env):
    """4 nodes × gpu:2; train (tier 100, no preemption) and scavenger (tier 1, requeue, grace)."""
    nodes = sl(env, "sinfo", "-h", "-N", "-p", "scavenger", "-o", "%N %G %c").split("\n")
    assert sorted(ln.split()[0] for ln in nodes if ln) == ["n1", "n2", "n3", "n4"]
    assert all(ln.split()[1] == "gpu:2" for ln in nodes if ln)
    parts = sl(env, "scontrol", "show", "partition", "-o")
    train = next(ln for ln in parts.splitlines() if ln.startswith("PartitionName=train "))
    scav = next(ln for ln in parts.splitlines() if ln.startswith("PartitionName=scavenger "))
    assert "PriorityTier=100" in train and "PreemptMode=OFF" in train
    assert "PriorityTier=1 " in scav and "PreemptMode=REQUEUE" in scav
    assert f"GraceTime={int(env['RLBOOST_SLURM_GRACE'])}" in scav or "GraceTime=00:00:" in scav
    assert env["SLURM_CONF"] == local_slurm_env()["SLURM_CONF"]


def test_gpu_job_gets_cuda_visible_devices(env, jobs, tmp_path):
    out = tmp_path / "cvd.out"
    jid = jobs.sbatch("-p", "scavenger", "--gres=gpu:1", "-o", str(out),
                      "--wrap", 'echo "CVD=${CUDA_VISIBLE_DEVICES:-unset} NODE=$SLURMD_NODENAME"')
    wait_for(lambda: jobs.in_state("COMPLETED", [jid]), 30, "the GPU job to complete")
    text = wait_for(lambda: out.exists() and out.read_text(), 5, "the job's output file")
    assert text.startswith("CVD="), text
    cvd = text.split()[0].removeprefix("CVD=")
    assert cvd in {"0", "1"}, text


def test_eight_one_gpu_jobs_run_concurrently(env, jobs):
    ids = [jobs.sbatch("-p", "scavenger", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 120")
           for _ in range(8)]
    wait_for(lambda: len(jobs.in_state("RUNNING", ids)) == 8, 30, "8 one-GPU jobs RUNNING at once")
    st = jobs.states()
    per_node: dict[str, int] = {}
    for i in ids:
        per_node[st[i]["nodes"]] = per_node.get(st[i]["nodes"], 0) + 1
    assert per_node == {"n1": 2, "n2": 2, "n3": 2, "n4": 2}, per_node
    ninth = jobs.sbatch("-p", "scavenger", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 120")
    time.sleep(2.5)  # > 2 scheduler passes (sched_interval=1, bf_interval=1)
    assert jobs.states()[ninth]["job_state"] == "PENDING"
    assert jobs.states()[ninth]["state_reason"] in {"Resources", "Priority"}


def _fill_scavenger(jobs, script: Path, out_dir: Path, *extra: str) -> list[int]:
    ids = [jobs.sbatch("-p", "scavenger", "--gres=gpu:1", "--requeue", *extra,
                       "-o", str(out_dir / "%j.out"), str(script)) for _ in range(8)]
    wait_for(lambda: len(jobs.in_state("RUNNING", ids)) == 8, 30, "8 scavenger jobs RUNNING")
    return ids


def test_train_job_preempts_scavenger_which_is_requeued(env, jobs, tmp_path):
    """Kill-at-end-of-grace path: no warning signal asked for; killed after GraceTime and requeued.

    (Asking for ``--signal=B:USR2`` without trapping it is worse: USR2 kills the batch shell at preemption and
    22.05 records the job FAILED (0:12), not requeued — workers must trap the signal first thing.)
    """
    script = tmp_path / "plain.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    ids = _fill_scavenger(jobs, script, tmp_path)
    t0 = time.monotonic()
    train = jobs.sbatch("-p", "train", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 120")
    grace = int(env["RLBOOST_SLURM_GRACE"])
    wait_for(lambda: jobs.in_state("RUNNING", [train]), grace + 20, "the train job to start by preemption")
    took = time.monotonic() - t0
    assert took >= grace - 1, f"train job started after {took:.1f} s, before the {grace} s grace ended"
    st = jobs.states()
    requeued = [i for i in ids if st[i]["restart_cnt"] >= 1]
    assert requeued, {i: (st[i]["job_state"], st[i]["restart_cnt"]) for i in ids}
    for i in requeued:
        assert st[i]["job_state"] in {"PENDING", "REQUEUED", "RUNNING", "CONFIGURING"}, st[i]["job_state"]
        assert st[i]["requeue"] is True
        # The killed attempt is recorded (22.05 says PREEMPTED for a job killed at the end of the grace time,
        # REQUEUED when the job requeued itself, see the USR2 test); the new attempt follows it.
        recs = wait_for(lambda: len(sacct_records(env, i)) >= 2 and sacct_records(env, i), 10,
                        f"sacct -D records of job {i}")
        assert recs[0] in {"PREEMPTED", "REQUEUED"}, recs
    # the other scavenger jobs are untouched
    assert all(st[i]["job_state"] == "RUNNING" for i in ids if i not in requeued)


def test_batch_shell_gets_usr2_at_preemption_and_requeues_itself(env, jobs, tmp_path):
    """What rollout workers do: trap USR2 (--signal=B:USR2@N), flush, `scontrol requeue` themselves."""
    script = tmp_path / "worker.sh"
    script.write_text(f"""#!/bin/bash
M={tmp_path}/marker.$SLURM_JOB_ID
trap 'echo "usr2 restart=${{SLURM_RESTART_COUNT:-0}}" >> $M; scontrol requeue $SLURM_JOB_ID' USR2
echo "start restart=${{SLURM_RESTART_COUNT:-0}}" >> $M
while :; do sleep 300 & wait $!; done
""")
    ids = _fill_scavenger(jobs, script, tmp_path, "--signal=B:USR2@10")
    marker = {i: tmp_path / f"marker.{i}" for i in ids}
    # RUNNING in squeue does not mean the batch shell has installed its trap yet (a job preempted before that
    # once left no marker at all): preempt only shells that wrote "start", which follows the trap.
    wait_for(lambda: all(m.exists() and "start" in m.read_text() for m in marker.values()), 30,
             "every batch shell to install its USR2 trap")
    t0 = time.monotonic()
    train = jobs.sbatch("-p", "train", "--gres=gpu:2", "-N1", "-o", "/dev/null", "--wrap", "sleep 120")

    def warned() -> list[int]:
        return [i for i in ids if "usr2" in marker[i].read_text()]

    got = wait_for(warned, 10, "a USR2 marker from a preempted batch shell", interval=0.05)
    grace = int(env["RLBOOST_SLURM_GRACE"])
    assert time.monotonic() - t0 < grace, "USR2 did not arrive at preemption (only at the end of the grace time)"
    # self-requeue frees the GPUs long before the grace time ends
    wait_for(lambda: jobs.in_state("RUNNING", [train]), 8, "the train job to start after the self-requeue")
    got = warned()
    assert len(got) == 2, got  # a 2-GPU job on one node preempts exactly that node's two jobs
    st = jobs.states()
    for i in got:
        assert st[i]["restart_cnt"] >= 1
        assert wait_for(lambda: "REQUEUED" in sacct_records(env, i), 10, f"a REQUEUED record for {i}")
    for i in ids:
        if i not in got:
            assert "usr2" not in (tmp_path / f"marker.{i}").read_text()
            assert st[i]["job_state"] == "RUNNING"
    # capacity comes back: the requeued attempts run again (after cred_expire + 1 s) once train ends
    sl(env, "scancel", str(train))
    wait_for(lambda: all("start restart=1" in (tmp_path / f"marker.{i}").read_text() for i in got), 40,
             "the requeued jobs to run again with SLURM_RESTART_COUNT=1")


def _daemon_pids(directory: str) -> dict[str, int]:
    pids = {}
    for f in sorted(Path(directory, "run").glob("*.pid")):
        pid = int(f.read_text().strip())
        assert Path(f"/proc/{pid}").exists(), f"{f.name} names dead pid {pid}"
        pids[f.stem] = pid
    return pids


def _cluster_processes(directory: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            comm = (p / "comm").read_text().strip()
            if comm not in {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"}:
                continue
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            blob = (p / "cmdline").read_bytes() + (p / "environ").read_bytes()
        except OSError:
            continue
        if directory.encode() in blob:
            found.append(int(p.name))
    return sorted(found)


def test_up_is_idempotent(env):
    directory = env["RLBOOST_SLURM_DIR"]
    before, procs_before = _daemon_pids(directory), _cluster_processes(directory)
    assert set(before) == {"munged", "mysqld", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2", "slurmd-n3",
                           "slurmd-n4"}
    assert len(procs_before) == 8, procs_before
    t0 = time.monotonic()
    out = subprocess.run([str(LOCAL_CLUSTER_DIR / "up")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 20
    assert "source " in out.stdout and "env.sh" in out.stdout
    assert _daemon_pids(directory) == before
    assert _cluster_processes(directory) == procs_before


def test_a_cluster_killed_without_down_comes_back_with_an_empty_queue(env, jobs):
    """A session killed mid-test leaves its jobs in slurmctld's saved state; the next ``up`` restored them as
    RUNNING with no process behind them (ghosts holding GPUs — a CI run once failed on the jobs a killed session
    left). ``up`` from a cold start (no controller, no slurmd running) cancels them."""
    directory = env["RLBOOST_SLURM_DIR"]
    ghosts = [jobs.sbatch("-p", "scavenger", "--output", "/dev/null", "--wrap", "sleep 600") for _ in range(2)]
    submitted, saved = time.time(), Path(directory, "state", "slurmctld", "job_state")
    wait_for(lambda: len(jobs.in_state("RUNNING")) == 2, 30, "both jobs running")
    # slurmctld saves job state a few seconds after a change (it batches saves): wait for a save that holds them
    wait_for(lambda: saved.exists() and saved.stat().st_mtime > submitted, 60, "slurmctld to save its job state")
    pids = _daemon_pids(directory)
    # the controller and every slurmd die without warning, their job processes with them (a killed session)
    for name in ("slurmctld", *[k for k in pids if k.startswith("slurmd-")]):
        os.kill(pids[name], 9)
    for p in Path("/proc").iterdir():
        try:
            comm = (p / "comm").read_text().strip() if p.name.isdigit() else ""
            mine = (comm == "slurmstepd" and any(f"[{j}.".encode() in (p / "cmdline").read_bytes() for j in ghosts)
                    or comm == "sleep" and any(f"SLURM_JOB_ID={j}\0".encode() in (p / "environ").read_bytes()
                                               for j in ghosts))
            if mine:
                os.kill(int(p.name), 9)
        except OSError:
            continue
    wait_for(lambda: not any(Path(f"/proc/{pids[k]}").exists() and
                             (Path(f"/proc/{pids[k]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")
                             for k in pids if k == "slurmctld" or k.startswith("slurmd-")), 15, "the daemons to die")
    out = subprocess.run([str(LOCAL_CLUSTER_DIR / "up")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cancelling jobs left from an earlier life" in out.stderr, out.stderr
    assert sl(env, "squeue", "-h", "-o", "%i %T").strip() == ""
    # no capacity is held by them (their accounting records are another matter: slurmdbd keeps the attempt that
    # was running when the controller died as a runaway job — `sacctmgr show runawayjobs` closes such records)
    wait_for(lambda: set(sl(env, "sinfo", "-h", "-N", "-o", "%T").split()) == {"idle"}, 30, "all nodes idle")
