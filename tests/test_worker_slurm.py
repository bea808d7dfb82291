"""The rollout worker's warning handler inside real Slurm jobs: on a cluster without ``SlurmctldParameters=
preempt_send_user_signal`` (as many sites run) a preempted job gets SIGTERM alone, which the handler used to take for
a ``scancel`` — counted as a cancellation, and not requeued by the worker. It now asks Slurm, and tells the two apart
by what Slurm says about the job (PreemptTime during the grace time, Restarts past the attempt once Slurm kills it
to requeue it), not by the signal (issue 30 item 3). Measured on Slurm 22.05 without the parameter: no signal at all
when the grace time starts; SIGTERM when it ends, Restarts already 1.

The test brings up its own 2-node local cluster without that parameter (``RLBOOST_SLURM_USER_SIGNAL=0``, its own
directory and ports, beside the 4-node one the other tests use) and removes it afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _util import wait_for

from _slurm_local import local_slurm_env
from rlboost_hpc.paths import PROJECT_ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

#: The job: install the worker's WarningHandler as the worker does, say so, and write what it decided once settled.
PROGRAM = """
import json, os, signal, sys, time
from rlboost_hpc.rollout.worker import WarningHandler
job, attempt = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
h = WarningHandler(signal.SIGUSR2, run_dir=None, job_id=job, in_slurm=True, attempt=attempt)
h.install()
out = sys.argv[1]
open(f"{out}/ready-{job}-{attempt}", "w").close()
while not (h.warned and h.settled):
    time.sleep(0.02)
with open(f"{out}/result-{job}-{attempt}.json", "w") as f:
    json.dump({"cause": h.cause, "signal": h.signal, "at": time.time()}, f)
"""


@pytest.fixture(scope="module")
def no_user_signal_cluster():
    """A 2-node local cluster without preempt_send_user_signal: its client environment; stopped and purged after."""
    import tempfile

    # munge needs every parent of its socket searchable by all: not under pytest's owner-only tmp_path
    directory = Path(tempfile.mkdtemp(prefix="rlboost-slurm-nosig-", dir="/tmp"))
    directory.chmod(0o755)
    env = {**os.environ, "RLBOOST_SLURM_DIR": str(directory), "RLBOOST_SLURM_PORT_BASE": "19800",
           "RLBOOST_SLURM_NODE_COUNT": "2", "RLBOOST_SLURM_USER_SIGNAL": "0", "RLBOOST_SLURM_UP_TIMEOUT": "180"}
    up = PROJECT_ROOT / "sbatch/local-cluster/up"
    p = subprocess.run([str(up), "--quiet"], env=env, capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    try:
        assert "preempt_send_user_signal" not in (directory / "etc/slurm.conf").read_text().split("# no ")[0]
        yield {**os.environ, **local_slurm_env(directory), "PYTHONPATH": str(PROJECT_ROOT)}
    finally:
        subprocess.run([str(PROJECT_ROOT / "sbatch/local-cluster/down"), "--purge"], env=env, capture_output=True,
                       timeout=180)


def _sbatch(env: dict, *args: str) -> str:
    p = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def _start(env: dict, out: Path, node: str) -> str:
    """A scavenger-partition job on ``node`` running :data:`PROGRAM`; its id once its handler is installed."""
    (out / "program.py").write_text(PROGRAM)
    script = out / "job.sh"
    script.write_text(f"#!/bin/bash\nexec {sys.executable} {out / 'program.py'} {out}\n")
    job = _sbatch(env, "-p", "scavenger", "-w", node, "--gres=gpu:1", "-c", "1", "--requeue",
                  "-o", str(out / "job-%j.out"), str(script))
    wait_for(lambda: (out / f"ready-{job}-0").exists(), 90, f"job {job}'s handler", interval=0.2)
    return job


def _result(out: Path, job: str) -> dict:
    path = out / f"result-{job}-0.json"
    wait_for(path.exists, 60, f"job {job}'s classification", interval=0.2,
             state=lambda: "; ".join(p.read_text()[-500:] for p in out.glob("job-*.out")))
    return json.loads(path.read_text())


def test_a_sigterm_only_preemption_is_a_preemption_and_a_scancel_is_not(no_user_signal_cluster, tmp_path):
    env = no_user_signal_cluster
    jobs: list[str] = []
    try:
        victim = _start(env, tmp_path, "n2")
        jobs.append(victim)
        t0 = time.time()
        jobs.append(_sbatch(env, "-p", "train", "-w", "n2", "--gres=gpu:2", "-c", "1", "-o", os.devnull,
                            "--wrap", "sleep 2"))  # needs both of n2's GPUs: preempts the victim
        got = _result(tmp_path, victim)
        assert (got["cause"], got["signal"]) == ("preempted", "SIGTERM+PreemptTime"), got
        # Slurm 22.05 without the parameter sends nothing when the grace time (10 s) starts: SIGTERM comes when it
        # ends, as Slurm kills the job to requeue it (the hand-off has KillWait); the job comes back as attempt 1
        assert got["at"] - t0 >= 10, got
        wait_for(lambda: (tmp_path / f"ready-{victim}-1").exists(), 90, f"job {victim} requeued", interval=0.5)

        cancelled = _start(env, tmp_path, "n1")
        jobs.append(cancelled)
        subprocess.run(["scancel", cancelled], env=env, timeout=30, check=True)
        got = _result(tmp_path, cancelled)
        assert (got["cause"], got["signal"]) == ("stopped", "SIGTERM"), got
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], env=env, timeout=30)


def test_harvest_check_says_what_such_a_cluster_costs(no_user_signal_cluster):
    """``rlboost-hpc harvest check`` on it: harvestable, with the warning and what to add."""
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "check", "--partition", "scavenger"],
                       env=no_user_signal_cluster, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warn no SlurmctldParameters=preempt_send_user_signal" in p.stdout and "KillWait = 5 s" in p.stdout
