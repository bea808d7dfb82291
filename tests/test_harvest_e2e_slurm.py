"""Issue 45, the harvest loop end to end through the doors its users open, on the real local Slurm cluster.

The admin starts the service with its CLI (``rlboost-hpc harvest serve --policy site.toml``: the shipped example
policy with its spool and poll adjusted, as docs/admins.md's walk-through says); users launch runs with ``sbatch/launch``
and ``submit_run``, joined with ``--harvest-dir``. Nothing here writes a file the system writes itself (no target,
capacity, demand or share by hand) — except the attacker of the two-user test, whose forged demand is the attack.
"""
from __future__ import annotations

import ast
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _util import tail, wait_for, wait_progressing
from test_slurm_run import events, node_of, sh, steps_done

from _slurm_local import ensure_local_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def slurm_env(monkeypatch) -> dict[str, str]:
    """The cluster's client environment, also in this process's (``submit_run`` calls sbatch from here)."""
    env = ensure_local_slurm()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RLBOOST_RUN_ID", raising=False)
    return {**os.environ, **env}


class Service:
    """``rlboost-hpc harvest serve`` started by its CLI on the shipped example policy (spool, poll and the given
    keys adjusted; ``tables``: TOML appended, e.g. per-run weights)."""

    def __init__(self, tmp: Path, env: dict[str, str], tables: str = "", spool: Path | None = None,
                 **keys: object) -> None:
        from rlboost_hpc.paths import shipped

        self.spool, self.log, self.status = spool or tmp / "spool", tmp / "harvest.log", tmp / "st.json"
        keys = {"spool_dir": str(self.spool), "poll_s": 1.0, **keys}
        lines = []
        for ln in shipped("sbatch/harvest/harvest.toml").read_text().splitlines():
            k = ln.split("=", 1)[0].strip()
            lines.append(f"{k} = {json.dumps(keys.pop(k))}" if k in keys else ln)
        text = "\n".join(lines).replace("[harvest]", "[harvest]\n" + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in keys.items()), 1)
        self.policy = tmp / "site.toml"
        self.policy.write_text(text + "\n" + tables)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Service":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "serve", "--policy",
                                          str(self.policy), "--status", str(self.status)], stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env)
        wait_for(lambda: (self.spool / "service.json").exists() or self.proc.poll() is not None, 60,
                 "the harvest service's spool", state=lambda: tail(self.log))
        assert self.proc.poll() is None, tail(self.log)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def cycles(self) -> list[dict]:
        """Every cycle the service logged: ``shares`` by run id."""
        out = []
        for ln in self.log.read_text(errors="replace").splitlines():
            if ln.startswith('{"ts"') and "shares {" in ln:
                msg = json.loads(ln)["msg"]
                out.append({"shares": ast.literal_eval(msg[msg.index("shares {") + 7:])})
        return out

    def lines(self) -> str:
        return self.log.read_text(errors="replace")


def run_config(tmp: Path, name: str, steps: int, max_workers: int = 2, cap: bool = True) -> Path:
    """The demo's config (configs/local.toml) with ``steps``, ``cluster.max_workers`` and ``policy.cap``."""
    text = (REPO / "configs/local.toml").read_text()
    text = text.replace("steps = 60", f"steps = {steps}").replace("max_workers = 2", f"max_workers = {max_workers}")
    text = text.replace("[policy]\n", f"[policy]\ncap = {'true' if cap else 'false'}\n")
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def launch(tmp: Path, env: dict[str, str], run_dir: Path, config: Path, *scavenger: str, train: tuple = ()) -> str:
    """``sbatch/launch RUN_DIR CONFIG [TRAIN…] --detach -- SCAVENGER…``; returns the trainer's job id."""
    p = subprocess.run(["bash", str(REPO / "sbatch/launch"), str(run_dir), str(config), *train, "--detach", "--",
                        *scavenger], capture_output=True, text=True, env=env, timeout=120, cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    return (run_dir / "train.jobid").read_text().strip()


def job_names(env: dict[str, str]) -> dict[str, str]:
    return {str(j["job_id"]): j["name"] for j in json.loads(sh(["squeue", "--json", "-t", "all"], env))["jobs"]}


def rollout_ids(run_dir: Path) -> set[str]:
    return {str(e["job_id"]) for e in events(run_dir) if e.get("event") == "submitted"}


def scavenger_gone(run_dir: Path) -> bool:
    return not Path(f"/proc/{(run_dir / 'scavenger.pid').read_text().strip()}").exists()


def cancel_all(env: dict[str, str], run_dirs: list[Path], extra: list[str] = ()) -> None:
    ids = [*extra]
    for rd in run_dirs:
        if (rd / "train.jobid").exists():
            ids.append((rd / "train.jobid").read_text().strip())
        ids += rollout_ids(rd)
    if ids:
        subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=30)
    for rd in run_dirs:
        if (rd / "scavenger.pid").exists():
            subprocess.run(["kill", (rd / "scavenger.pid").read_text().strip()], capture_output=True)


# ------------------------------------------------------------------------------------------------------------
def test_two_runs_launched_as_readme_says_harvest_through_the_service_and_the_owners_report_counts_a_preemption(
        tmp_path, slurm_env):
    """The issue's reproduction, now harvesting: the admin's service (its CLI, the example policy) and two runs —
    one by ``sbatch/launch``, one by ``submit_run`` — joined with ``--harvest-dir``. Before the fix both finished
    with 0 rollout jobs (demand = capped target = share = 0 for ever). Now: both are granted shares, their rollout
    jobs register and stream tokens (``tokens_from_preemptible`` > 0), nothing is lost; the trainer jobs carry
    the run ids; a priority job that preempts a rollout job is in ``harvest report`` with its delay; both
    scavengers exit by themselves at the end."""
    from rlboost_hpc.launch import submit_run

    env = slurm_env
    run_a, run_b = tmp_path / "h1", tmp_path / "h2"
    cfg = run_config(tmp_path, "short", steps=80)
    t0 = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    preemptor = ""
    with Service(tmp_path, env) as svc:
        flags = ["--partition", "scavenger", "--max-jobs", "2", "--harvest-dir", str(svc.spool), "--poll-s", "1"]
        job_a = launch(tmp_path, env, run_a, cfg, *flags)
        run = submit_run(cfg, run_b, partition="train", timeout_min=30, cpus_per_task=1, scavenger=flags)

        def state() -> str:
            return "\n".join(f"{rd.name}: {steps_done(rd)} steps; events {events(rd)[-4:]}\n"
                             f"{tail(rd / 'logs' / 'scavenger.log', 6)}" for rd in (run_a, run_b)) + tail(svc.log, 4)

        try:
            names = job_names(env)
            assert names[job_a] == "rlboost-train-h1" and names[run.job_id] == "rlboost-train-h2", names
            registered = lambda rd: any(e.get("event") == "worker_started" for e in events(rd))  # noqa: E731
            wait_progressing(lambda: registered(run_a) and registered(run_b),
                             lambda: (steps_done(run_a), steps_done(run_b)), 180, "a rollout job of each run",
                             state=state)
            # a priority job takes a node a rollout job runs on (not a trainer's): the owners' report counts it
            def rollout_node() -> str:
                jobs = json.loads(sh(["squeue", "--json"], env))["jobs"]
                trainers = {node_of(j) for j in jobs if str(j["job_id"]) in (job_a, run.job_id)}
                ours = rollout_ids(run_a) | rollout_ids(run_b)
                return next((node_of(j) for j in jobs if str(j["job_id"]) in ours and "RUNNING" in
                             str(j["job_state"]) and node_of(j) not in trainers), "")

            node = wait_for(rollout_node, 120, "a rollout job off the trainers' nodes", state=state)
            preemptor = sh(["sbatch", "--parsable", "-p", "train", "-w", node, "--exclusive", "--gres", "gpu:2",
                            "--job-name", "owner-job", "--wrap", "sleep 3"], env).strip()
            for rd in (run_a, run_b):
                wait_progressing(lambda: (rd / "report.json").exists(), lambda: steps_done(rd), 240,
                                 f"{rd.name}'s report", state=state)
            wait_for(lambda: scavenger_gone(run_a) and run.scavenger.poll() is not None, 120,
                     "both scavengers to exit by themselves", state=state)
        finally:
            cancel_all(env, [run_a, run_b], [run.job_id, preemptor] if preemptor else [run.job_id])
    for rd in (run_a, run_b):
        rep = json.loads((rd / "report.json").read_text())
        assert rep["tokens_from_preemptible"] > 0 and rep["worker_starts"] >= 1, (rd.name, rep)
        assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
        assert rep["tokens_trained_off_version"] == 0
        assert rollout_ids(rd), f"{rd.name}: its scavenger submitted no rollout job"
    granted = [c["shares"] for c in svc.cycles()]
    assert any(s.get("h1", 0) > 0 and s.get("h2", 0) > 0 for s in granted), granted[-5:]
    report = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "report", "--since", t0, "--json",
                             "--run-dir", str(run_a), "--run-dir", str(run_b)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert report.returncode == 0, report.stderr
    rep = json.loads(report.stdout)
    delays = {d["job_id"]: d for d in rep["delays"]}
    assert preemptor in delays and delays[preemptor]["preempted"], rep["delays"]
    assert rep["by_run"]["h1"]["tokens"] > 0 and rep["by_run"]["h2"]["tokens"] > 0, rep["by_run"]


def test_three_runs_get_weighted_shares_and_a_trainer_that_ends_takes_its_rollout_jobs_with_it(tmp_path, slurm_env):
    """Weights 1:1:2 (the site policy's per-run table) with every run asking for more than the pool: the service
    grants 1, 1 and 2 rollout jobs and each scavenger keeps that many live. Then the trainer jobs are cancelled
    while their target.json still says active (a failed trainer): each scavenger cancels its rollout jobs and exits
    by itself within a few polls instead of waiting for ever."""
    env = slurm_env
    runs = [tmp_path / n for n in ("w1", "w2", "w4")]
    cfg = run_config(tmp_path, "long", steps=400, max_workers=4, cap=False)  # every run asks for 4
    tables = "[harvest.runs.w4]\nweight = 2.0\n"
    with Service(tmp_path, env, tables=tables, idle_share_free=0.2) as svc:  # pool ⌊0.8 · 5⌋ = 4 GPUs
        flags = ["--partition", "scavenger", "--max-jobs", "4", "--harvest-dir", str(svc.spool), "--poll-s", "1"]
        # (trainers of one CPU: with train.sbatch's 4, a trainer's node has no CPU left for a rollout job)
        jobs = [launch(tmp_path, env, rd, cfg, *flags, train=("--train-cpus", "1")) for rd in runs]

        def state() -> str:
            return "\n".join(f"{rd.name}: {steps_done(rd)} steps; {tail(rd / 'logs' / 'scavenger.log', 4)}"
                             for rd in runs) + "\n" + tail(svc.log, 4)

        def live() -> dict[str, int]:
            tags = {f"rlboost:{rd.name}@": rd.name for rd in runs}
            out = {rd.name: 0 for rd in runs}
            for j in json.loads(sh(["squeue", "--json"], env))["jobs"]:
                for prefix, name in tags.items():
                    if (j.get("comment") or "").startswith(prefix) and "RUNNING" in str(j["job_state"]):
                        out[name] += 1
            return out

        try:
            wait_for(lambda: live() == {"w1": 1, "w2": 1, "w4": 2}, 300, "rollout jobs 1:1:2",
                     state=lambda: f"{live()}\n{state()}")
            assert {"w1": 1, "w2": 1, "w4": 2} in [c["shares"] for c in svc.cycles()]
            for j in jobs:  # the trainers die (SIGKILL: no clean-up) while their targets still say active
                sh(["scancel", "--signal=KILL", "--full", j], env)
            wait_for(lambda: all(scavenger_gone(rd) for rd in runs), 90, "every scavenger to exit by itself",
                     state=state)
            wait_for(lambda: sum(live().values()) == 0, 60, "no rollout job left", state=state)
        finally:
            cancel_all(env, runs)
    for rd in runs:
        log = (rd / "logs" / "scavenger.log").read_text()
        assert "trainer job" in log and "ended" in log and "run inactive and no rollout job left" in log, tail(
            rd / "logs" / "scavenger.log")
        assert json.loads((rd / "target.json").read_text())["active"], "the trainer never ended its run itself"


def test_another_user_cannot_have_the_service_cancel_a_runs_jobs(tmp_path, slurm_env, request):
    """Two Unix users (root, the run's owner, and ``nobody``). Before the fix, a user who posted a demand under
    another user's run id and tag, then went silent, had the service scancel that user's jobs once the demand timed
    out. Now the forged demand is refused (its tag is held by another user's jobs), the service never counts or
    cancels them, and the real owner's scavenger is told the run id is taken (exit 1 naming the user)."""
    env = slurm_env
    other = pwd.getpwnam("nobody")
    run_dir = tmp_path / "victim"
    run_dir.mkdir()
    spool = Path(tempfile.mkdtemp(prefix="rlboost-spool-", dir="/tmp"))  # (pytest's tmp is root's alone)
    os.chmod(spool, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(spool, ignore_errors=True))
    with Service(tmp_path, env, spool=spool, demand_timeout_s=4.0, cancel_every_s=1.0) as svc:
        from scavenger.config import ScavengerConfig

        tag = ScavengerConfig().resolved_tag(run_dir)
        # the victim's rollout jobs (root's), under its run's tag
        victims = [sh(["sbatch", "--parsable", "-p", "scavenger", "--gres", "gpu:1", f"--comment={tag}",
                       "--job-name", "rlboost-rollout-victim", "--output", "/dev/null", "--wrap", "sleep 120"],
                      env).strip() for _ in range(2)]
        forged = json.dumps({"run_id": "victim", "tag": tag, "instances": 8, "seq": 1, "ts": 1.0})
        mine = [sh(["runuser", "-u", other.pw_name, "--", "sbatch", "--parsable", "-p", "scavenger",
                    f"--comment={tag}", "--output", "/dev/null", "--chdir", "/tmp", "--wrap", "sleep 120"], env).strip()]
        try:
            p = subprocess.run(["runuser", "-u", other.pw_name, "--", "sh", "-c",
                                f"cat > {svc.spool}/demands/victim.json"], input=forged, text=True, env=env,
                               capture_output=True, timeout=30)
            assert p.returncode == 0, p.stderr
            wait_for(lambda: "the demand is refused" in svc.lines(), 60, "the service to refuse the forged demand",
                     state=lambda: tail(svc.log))
            share = json.loads((svc.spool / "shares" / "victim.json").read_text())
            assert share["instances"] == 0 and "held by the jobs of user(s) root" in share["reason"], share
            assert {j["job_id"] for j in share["jobs"]} <= set(mine), share["jobs"]
            # the forger goes silent: its demand times out, and only the forger's own jobs may be cancelled
            wait_for(lambda: not (svc.spool / "demands" / "victim.json").exists(), 60,
                     "the vanished forged demand to be forgotten", state=lambda: tail(svc.log))
            listed = {str(j["job_id"]): str(j["job_state"]) for j in
                      json.loads(sh(["squeue", "--json", "-t", "all"], env))["jobs"]}
            assert all("CANCELLED" not in listed[v] for v in victims), (listed, tail(svc.log, 10))
            # and the owner, whose run id another user took, is told so
            forged_again = subprocess.run(["runuser", "-u", other.pw_name, "--", "sh", "-c",
                                           f"cat > {svc.spool}/demands/victim.json"], input=forged, text=True,
                                          env=env, capture_output=True, timeout=30)
            assert forged_again.returncode == 0
            once = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(run_dir), "--once",
                                   "--harvest-dir", str(svc.spool), "--script", str(REPO / "sbatch/rollout.sbatch")],
                                  capture_output=True, text=True, env=env, timeout=120)
            assert once.returncode == 1 and f"held by user {other.pw_name}" in once.stderr, once.stderr
        finally:
            subprocess.run(["scancel", *victims, *mine], env=env, capture_output=True, timeout=30)
