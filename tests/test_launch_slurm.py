"""The trainer launched from Python with submitit on the real local Slurm cluster (issue 16 item 4)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from _slurm_local import ensure_local_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parent.parent


def _job_output(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((out / "submitit").glob("*.out")) + sorted((out / "submitit").glob("*.err")))


def test_a_run_submitted_from_python_harvests_rollout_jobs_and_survives_a_requeue_of_its_trainer(tmp_path,
                                                                                                  monkeypatch):
    """:func:`rlboost_hpc.launch.submit_run` gives what ``sbatch/launch`` gives (issue 28: it ran the embedded local
    cluster inside the Slurm job, with no scavenger): the trainer job as a Slurm run and the scavenger, whose rollout
    jobs on the scavenger partition serve the run. Once the trainer has checkpointed step 3 and a rollout job has
    registered, ``scontrol requeuehold`` the trainer (Slurm kills it; it waits, held, same id): with no manager to
    serve, its rollout jobs are cancelled once it has waited ``--trainer-pending-release-s`` (issue 57 item 8,
    prime-rl #2961: they kept cycling on harvested GPUs) and none is submitted while it waits; ``scontrol release``
    starts it again: the second start resumes from the checkpoint, new rollout jobs serve it, and the run finishes:
    ``resumes ≥ 1``, nothing lost or duplicated, every prompt trained exactly once, two manager epochs in the
    journal; the scavenger exits by itself once the run is over."""
    from rlboost_hpc.launch import submit_run
    from rlboost_hpc.manager.journal import read
    from rlboost_hpc.rundir import RunDir, read_jsonl
    from rlboost_hpc.trainer.checkpoint import latest_step

    import os

    for k, v in ensure_local_slurm().items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    run = submit_run(REPO / "configs/local.toml", out, partition="train", timeout_min=30, cpus_per_task=1,
                     overrides=["trainer.steps=40", "trainer.export_model=false"],
                     scavenger=["--partition", "scavenger", "--max-jobs", "2", "--poll-s", "1",
                                "--trainer-pending-release-s", "2"])
    events = RunDir(out).events

    def served() -> bool:  # a rollout job registered with the run's manager
        return any(e.get("event") == "worker_started" for e in read_jsonl(events))

    def rollout_jobs() -> list[str]:
        p = subprocess.run(["squeue", "-h", "-o", "%i", "--name", f"rlboost-rollout-{RunDir(out).run_id()}"],
                           capture_output=True, text=True, timeout=30)
        return p.stdout.split()

    def state() -> str:
        return _job_output(out) + "\n" + (RunDir(out).scavenger_log.read_text()[-3000:]
                                          if RunDir(out).scavenger_log.exists() else "no scavenger log")

    try:
        deadline = time.monotonic() + 300
        while latest_step(out) < 3 or not served():
            assert time.monotonic() < deadline and not run.done(), f"no checkpoint of step 3 and rollout job:\n" \
                                                                    f"{state()}"
            time.sleep(0.5)
        p = subprocess.run(["scontrol", "requeuehold", run.job_id], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + 120
        while not (any(e.get("reason") == "trainer_pending" for e in read_jsonl(events)) and not rollout_jobs()):
            assert time.monotonic() < deadline, f"the held trainer's rollout jobs were not released:\n{state()}"
            time.sleep(0.5)
        released_at = len(read_jsonl(events))
        time.sleep(5)  # (held: nothing is submitted meanwhile)
        assert not rollout_jobs() and not any(e.get("event") == "submitted" for e in read_jsonl(events)[released_at:])
        p = subprocess.run(["scontrol", "release", run.job_id], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + 600
        while not run.done():
            assert time.monotonic() < deadline, f"the requeued run did not finish:\n{state()}"
            time.sleep(2.0)
        rep = run.result()
        # the result file is written just before the job's processes exit: wait for Slurm to see it end
        _wait_gone(run.job_id, dict(os.environ), 120, state)
        assert run.wait_scavenger(180) == 0, state()
    finally:
        if run.scavenger.poll() is None:
            run.cancel()
            run.scavenger.kill()
        subprocess.run(["scancel", run.job_id], capture_output=True, timeout=30)
        subprocess.run(["scancel", "--name", f"rlboost-rollout-{out.name}"], capture_output=True, timeout=30)
    assert rep == json.loads(RunDir(out).report.read_text())
    assert rep["steps"] == 40 and rep["resumes"] >= 1 and rep["resumed_from_step"] >= 3, state()
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["tokens_trained_off_version"] == 0
    assert sum(1 for r in read(RunDir(out).journal) if r.get("event") == "start") >= 2
    ev = read_jsonl(events)
    assert any(e.get("event") == "submitted" for e in ev[released_at:])  # the trainer ran again: served again
    started = [e for e in ev if e.get("event") == "started" and e.get("source") == "scavenger"]
    assert started and all(e.get("partition", "scavenger") == "scavenger" for e in started), started
    assert json.loads((out / "config.json").read_text())["cluster"]["kind"] == "slurm"


def _wait_gone(job: str, env: dict, timeout_s: float, what) -> None:
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env,
                         timeout=30).stdout.strip():
        assert time.monotonic() < deadline, what()
        time.sleep(1.0)


@pytest.mark.megatron
def test_train_sbatch_runs_the_megatron_trainer_as_two_tasks_at_tp2(tmp_path):
    """``sbatch/train.sbatch`` with 2 Slurm tasks, ``trainer.megatron.tp = 2`` (gloo, fake GPUs): each task runs the
    Megatron launcher with its task rank as node rank; rank 0 runs the RL program, rank 1 follows; 3 steps."""
    import os
    import sys

    env = dict(os.environ, **ensure_local_slurm())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env.update(RLBOOST_PYTHON=sys.executable, RLBOOST_RUN_DIR=str(run_dir), RLBOOST_CONFIG=str(REPO / "configs/local.toml"),
               RLBOOST_LAUNCHER="megatron", RLBOOST_MASTER_ADDR="127.0.0.1", RLBOOST_TRAIN_ARGS=(
                   "--set trainer.backend=megatron --set trainer.megatron.tp=2 --set trainer.steps=3 --set task.heldout_prompts=8 "
                   "--set trainer.eval_samples=1 --set trainer.export_model=false"))
    p = subprocess.run(["sbatch", "--parsable", "--partition", "train", "--nodes", "1", "--ntasks-per-node", "2",
                        "--cpus-per-task", "1", "--gres", "gpu:2", "--output", str(run_dir / "train-%j.out"),
                        "--export", "ALL", str(REPO / "sbatch/train.sbatch")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    log = run_dir / f"train-{job}.out"

    def output() -> str:
        return log.read_text(errors="replace")[-6000:] if log.exists() else "(no output yet)"

    try:
        _wait_gone(job, env, 600, output)
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["steps"] == 3 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, output()
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["backend"] == "megatron"
    layouts = [json.loads(x)["msg"] for x in (run_dir / "logs" / "trainer.jsonl").read_text().splitlines()
               if "Megatron backend" in x]
    assert layouts and all("world 2 = TP 2 x PP 1 x DP 1 (this is rank 0)" in m for m in layouts), (layouts, output())


@pytest.mark.parametrize("door, bad, says", [
    ("sbatch/launch", ["trainer.nope=1"], "trainer.nope"),
    ("sbatch/launch", ["--max-jobs", "-1"], "--max-jobs"),
    ("submit_run", ["trainer.nope=1"], "trainer.nope"),
    ("submit_run", ["--max-jobs", "-1"], "--max-jobs"),
])
def test_a_bad_key_or_scavenger_flag_through_either_door_is_refused_and_submits_nothing(tmp_path, monkeypatch,
                                                                                        door, bad, says):
    """Issue 57 (the second list): the launchers' checks before submitting, proven on the real local Slurm — a bad
    config key (the trainer's overrides) or a bad scavenger flag through ``sbatch/launch`` (exit 2) or
    ``submit_run`` (BadInput): named, and not one job reaches Slurm (the queue holds none of the run's jobs, the
    accounting none submitted since)."""
    import os
    import sys

    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.launch import submit_run

    import uuid

    for k, v in ensure_local_slurm().items():
        monkeypatch.setenv(k, v)
    out = tmp_path / f"refused-{uuid.uuid4().hex[:8]}"  # the run id in its jobs' names: other tests' jobs are not it
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    key = bad[0].endswith("=1")
    if door == "sbatch/launch":
        env = dict(os.environ, RLBOOST_PYTHON=sys.executable, RLBOOST_TRAIN_ARGS=f"--set {bad[0]}" if key else "")
        p = subprocess.run(["bash", str(REPO / "sbatch/launch"), str(out), str(REPO / "configs/local.toml"),
                            *([] if key else ["--", "--partition", "scavenger", *bad])],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    else:
        with pytest.raises(BadInput, match=says):
            submit_run(REPO / "configs/local.toml", out, partition="train", overrides=bad if key else [],
                       scavenger=[] if key else ["--partition", "scavenger", *bad])
    queued = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, timeout=30).stdout.split()
    assert not [j for j in queued if j.endswith(out.name)], queued
    acct = subprocess.run(["sacct", "-n", "-X", "-S", since, "-o", "JobName%80"], capture_output=True, text=True,
                          timeout=30)
    assert acct.returncode == 0 and not [j for j in acct.stdout.split() if j.endswith(out.name)], acct.stdout
