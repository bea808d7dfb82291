"""Acceptance of issue 3 on the real local Slurm cluster (started by the tests themselves).

A trainer job holds a `train` allocation; the scavenger daemon fills idle GPUs with requeueable rollout jobs;
high-priority jobs preempt rollout jobs mid-step (twice); the scavenger is SIGKILLed and restarted; slurmctld
is restarted. The run must finish with nothing lost, duplicated or trained off-version, requeued jobs must
come back and serve, and `rlboost-hpc stats --sacct` must agree with Slurm's accounting.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _util import tail, wait_for, wait_progressing

from _slurm_local import ensure_local_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parent.parent


def sh(args, env, timeout=30, check=True):
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}: {p.stderr}")
    return p.stdout


def our_jobs(env, tag):
    out = json.loads(sh(["squeue", "--json"], env))
    return [j for j in out["jobs"] if tag in (j.get("comment") or "")]



def node_of(job):
    n = job.get("nodes") or ""
    return n if isinstance(n, str) else ",".join(n)


def settled_running(env, tag, min_age_s=8.0):
    """Rollout jobs running for at least ``min_age_s`` (their batch shell has installed its USR2 trap)."""
    now = time.time()
    out = []
    for j in our_jobs(env, tag):
        st = j.get("start_time")
        st = st.get("number", 0) if isinstance(st, dict) else (st or 0)
        if "RUNNING" in str(j["job_state"]) and 0 < st <= now - min_age_s:
            out.append(j)
    return out


def requeues(run_dir):
    """Preempted attempts that came back: the worker's own requeue or a restart seen by the scavenger."""
    ev = events(run_dir)
    return max(sum(1 for e in ev if e.get("event") == "requeue_requested"),
               sum(1 for e in ev if e.get("event") == "requeued"))


def preempt_rollout_nodes(env, tag, trainer_job):
    """Submit a high-priority exclusive job onto the nodes of running rollout jobs (not the trainer's node)."""
    jobs = json.loads(sh(["squeue", "--json"], env))["jobs"]
    trainer_node = next(node_of(j) for j in jobs if str(j["job_id"]) == trainer_job)
    nodes = sorted({node_of(j) for j in settled_running(env, tag)} - {trainer_node, ""})
    assert nodes, "no rollout job outside the trainer's node"
    return sh(["sbatch", "--parsable", "-p", "train", "-N", str(len(nodes)), "--nodelist", ",".join(nodes),
               "--exclusive", "--gres", "gpu:2", "--wrap", "sleep 6"], env).strip()


def events(run_dir):
    p = run_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def steps_done(run_dir):
    p = run_dir / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def diagnosis(env, tag, run_dir) -> str:
    """What a failed wait needs to be diagnosed: steps done, the run's Slurm jobs, last events and log lines."""
    try:
        jobs = [(j["job_id"], str(j["job_state"]), node_of(j), j.get("restart_cnt")) for j in our_jobs(env, tag)]
    except Exception as e:  # noqa: BLE001 - the controller may be the problem
        jobs = f"squeue failed: {e}"
    trainer = sorted(run_dir.glob("train-*.out"))
    return "\n".join([f"steps done: {steps_done(run_dir)}; rollout jobs (id, state, node, restarts): {jobs}",
                      f"last events: {events(run_dir)[-8:]}",
                      tail(trainer[-1] if trainer else run_dir / "train.out"), tail(run_dir / "scavenger.log")])


class SlurmRun:
    """A run on the local Slurm cluster as ``sbatch/launch`` starts one: the trainer job (``sbatch/train.sbatch``
    with ``overrides``) and the scavenger daemon in its run directory. A context manager: on exit the scavenger
    is stopped and every job of the run cancelled."""

    def __init__(self, tmp_path, name: str, overrides: str, *, train=("--gres", "gpu:1"), scav=(), poll_s=1.0):
        self.env = dict(os.environ, **ensure_local_slurm())
        self.env["RLBOOST_PYTHON"] = sys.executable
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.run_id = f"{name}-{os.getpid()}-{int(time.time())}"
        self.tag = f"rlboost:{self.run_id}"
        self.overrides, self.poll_s = overrides, poll_s
        self.preemptors: list[str] = []  # high-priority jobs this test submitted (preempt)
        self.job = sh(["sbatch", "--parsable", "--partition", "train", *train, "--output",
                       str(self.run_dir / "train-%j.out"),
                       f"--export=ALL,RLBOOST_RUN_DIR={self.run_dir},RLBOOST_RUN_ID={self.run_id},"
                       f"RLBOOST_CONFIG={REPO / 'configs/local.toml'},RLBOOST_TRAIN_ARGS={overrides}",
                       str(REPO / "sbatch/train.sbatch")], self.env).strip().split(";")[0]
        self.scav_cmd = [sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(self.run_dir), "--partition",
                         "scavenger", "--max-jobs", "3", "--grace-s", "10", "--poll-s", str(poll_s), "--script",
                         str(REPO / "sbatch/rollout.sbatch"), "--log-dir", str(self.run_dir / "logs"),
                         "--exit-when-done", "--run-id", self.run_id, *scav]
        self.scav_log = open(self.run_dir / "scavenger.log", "a")
        self.scav = subprocess.Popen(self.scav_cmd, env=self.env, stdout=self.scav_log, stderr=subprocess.STDOUT)

    def state(self) -> str:
        return diagnosis(self.env, self.tag, self.run_dir)

    def preempt(self) -> str:
        """:func:`preempt_rollout_nodes` for this run; the high-priority job is the run's to cancel on exit (a short
        run can end while it still sleeps)."""
        job = preempt_rollout_nodes(self.env, self.tag, self.job)
        self.preemptors.append(job)
        return job

    def preemptor_started(self, job: str) -> bool:
        """The high-priority job ``job`` has started (or already ended): every rollout job on its nodes is gone —
        also one that started just before the preemption and, its warning signal sent before its batch shell
        could trap it, is requeued by Slurm only when the grace time ends."""
        state = sh(["squeue", "-h", "-j", job, "-o", "%T"], self.env, check=False).strip()
        return state in ("", "RUNNING", "COMPLETING", "COMPLETED")

    def restart_scavenger(self) -> None:
        """SIGKILL the scavenger (no warning) and start it again."""
        self.scav.send_signal(signal.SIGKILL)
        self.scav.wait(10)
        self.scav = subprocess.Popen(self.scav_cmd, env=self.env, stdout=self.scav_log, stderr=subprocess.STDOUT)

    def finish(self) -> dict:
        """Wait (bounded by progress) for the report and the scavenger's exit; returns the report."""
        wait_progressing(lambda: (self.run_dir / "report.json").exists(), lambda: steps_done(self.run_dir), 180,
                         "report.json", state=self.state)
        self.scav.wait(120)
        return json.loads((self.run_dir / "report.json").read_text())

    def __enter__(self) -> "SlurmRun":
        return self

    def __exit__(self, *exc) -> None:
        if self.scav.poll() is None:
            self.scav.kill()
        self.scav_log.close()
        ids = [self.job, *self.preemptors, *[str(j["job_id"]) for j in our_jobs(self.env, self.tag)]]
        subprocess.run(["scancel", *ids], env=self.env, capture_output=True)
        deadline = time.monotonic() + 30  # gone from the queue (cancelling takes the jobs' steps a moment)
        while time.monotonic() < deadline and sh(["squeue", "-h", "-t", "PD,R,S", "-j", ",".join(ids), "-o", "%i"],
                                                  self.env, check=False).strip():
            time.sleep(0.5)


def test_rlboost_run_on_slurm_survives_preemption_scavenger_and_controller_restarts(tmp_path):
    # 30 steps: both preemptions, the scavenger's and controller's restarts and the trainer's requeue are over by step
    # ~10 (≈ 45 s; the rollout jobs reconnect to the resumed trainer then). With 100 steps the run went on for 500 s
    # more and the test took 582 s of pytest's 600 s limit on an idle machine; 50 steps took 180–215 s.
    overrides = ("--set trainer.steps=30 --set rollout.max_new_tokens=128 --set rollout.prompts_per_step=16 "
                 "--set cluster.max_workers=3 --set policy.t_seed_initial_s=0.3 --set network.bind_host=127.0.0.1 "
                 "--set policy.cap=false "  # a steady target: every rollout job ends by preemption or at the end
                 # rollout settings off their defaults: each Slurm rollout job must run with them (worker spec)
                 "--set rollout.max_batch=24 --set weights.streams=2 --set weights.window=3 "
                 "--set weights.pull_timeout_s=45 --set trainer.checkpoint_every=4")
    with SlurmRun(tmp_path, "accept", overrides, scav=("--gpus-per-job", "1")) as r:
        env, tag, run_dir, state, run_id = r.env, r.tag, r.run_dir, r.state, r.run_id
        # rollout jobs start, register and serve
        wait_for(lambda: steps_done(run_dir) >= 3 and any(e.get("event") in ("tokens", "worker_started")
                                                         for e in events(run_dir)), 180, "rollout jobs serving",
                 state=state)
        # 1st preemption: a high-priority job takes the rollout jobs' nodes
        wait_for(lambda: len(settled_running(env, tag)) >= 2, 120, "2 settled running rollout jobs", state=state)
        r.preempt()
        wait_for(lambda: requeues(run_dir) >= 1, 60, "first requeue", state=state)
        # kill the scavenger without warning, restart it: no duplicate submissions
        n_before = len(our_jobs(env, tag))
        r.restart_scavenger()
        time.sleep(4)
        assert len(our_jobs(env, tag)) <= max(3, n_before)
        # restart slurmctld mid-run
        sh([str(REPO / "sbatch/local-cluster/restart-slurmctld"), "2"], env, timeout=120)
        # 2nd preemption after the controller is back
        n1 = requeues(run_dir)
        wait_for(lambda: len(settled_running(env, tag)) >= 2, 150, "settled rollout jobs running again", state=state)
        assert not (run_dir / "report.json").exists(), "the run ended before its second preemption:\n" + state()
        r.preempt()
        wait_for(lambda: requeues(run_dir) > n1, 90, "second requeue", state=state)
        # the trainer job requeued two steps past a checkpoint (Slurm kills it; it runs again and resumes from that
        # checkpoint, older than the versions the rollout jobs hold): the surviving rollout jobs reconnect and serve
        # the resumed trainer's lower version (issue 57, second list: version lineage shown with a scripted trainer
        # only)
        wait_for(lambda: steps_done(run_dir) % 4 == 2, 120, "a step two past a checkpoint", state=state)
        at_requeue, n_events = steps_done(run_dir), len(events(run_dir))
        sh(["scontrol", "requeue", r.job], env)
        # the run finishes: waited for as long as steps keep completing (a loaded machine is slow, not stuck)
        rep = r.finish()
    assert "failed" not in rep, rep
    # the trainer's log lines and endpoints.json carry this run's id (an earlier in-process run of the same
    # pytest process once leaked its own through the environment)
    assert json.loads((run_dir / "endpoints.json").read_text())["run_id"] == run_id
    runs = {json.loads(line)["run"] for f in run_dir.glob("train-*.out") for line in f.read_text().splitlines()
            if line.startswith('{"ts"')}
    assert runs == {run_id}, runs
    assert rep["steps"] == 30
    assert rep["preemptions"] >= 2
    assert rep["resumes"] == 1 and rep["resumed_from_step"] < at_requeue, (rep["resumed_from_step"], at_requeue)
    reconnected = {(e["job_id"], e["attempt"]) for e in events(run_dir)[n_events:] if e.get("event") == "reconnect"}
    served = {(e["job_id"], e["attempt"]) for e in events(run_dir)[n_events:]
              if e.get("event") == "tokens" and e.get("produced", 0) > 0}
    assert reconnected & served, (reconnected, served)  # a rollout job of the first trainer served the resumed one
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0
    # requeued jobs came back and served again: a started event with attempt ≥ 1 followed by tokens produced
    ev = events(run_dir)
    again = [e for e in ev if e.get("event") == "tokens" and int(e.get("attempt", 0)) >= 1 and e.get("produced", 0) > 0]
    assert again, "no requeued attempt produced tokens"
    # every rollout job ran with the run's rollout settings (endpoints.json's worker spec; issue 13: they read
    # only the engine spec, and weights.* / rollout.max_batch / rollout.torch_threads were silently ignored)
    from rlboost_hpc.config import load_config
    from rlboost_hpc.rollout.spec import WorkerSpec

    want = WorkerSpec.from_config(load_config(REPO / "configs/local.toml", overrides.split()[1::2]),
                                  json.loads((run_dir / "endpoints.json").read_text())["worker"]["engine"]["max_len"]
                                  ).to_json()
    assert want["max_batch"] == 24 and want["weight_streams"] == 2 and want["pull_timeout_s"] == 45
    assert json.loads((run_dir / "endpoints.json").read_text())["worker"] == want
    effective = [e["settings"] for e in ev if e.get("event") == "worker_started"]
    assert effective and all(x == want for x in effective), effective
    st = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "stats", str(run_dir), "--sacct", "--json"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert st.returncode == 0, st.stderr
    data = json.loads(st.stdout)
    assert data["preemptions"] >= 2
    assert data.get("sacct", {}).get("agree", False), data


def test_n_resv_and_the_rollout_job_size_come_from_the_trainer_allocation(tmp_path):
    """Issue 13: the trainer job holds 4 GPUs (-N 2 --gres=gpu:2), rollout instances take 2 GPUs each
    (rollout.gpus_per_instance = 2): N_resv = 4 / 2 = 2 reaches the controller from Slurm's environment (it was
    hard-coded to 1), the scavenger — started with its own default of 1 GPU per job — submits --gres=gpu:2 because
    the run asks for it, and the cap is clamped to the capacity the scavenger reported (at most the 2 idle nodes)."""
    overrides = ("--set trainer.steps=6 --set rollout.gpus_per_instance=2 --set cluster.max_workers=3 "
                 "--set policy.t_seed_initial_s=0.3 --set network.bind_host=127.0.0.1")
    with SlurmRun(tmp_path, "nresv", overrides, train=("--nodes", "2", "--gres", "gpu:2")) as r:
        rep = r.finish()
    run_dir = r.run_dir
    assert "failed" not in rep, rep
    assert (rep["n_resv"], rep["n_resv_source"]) == (2.0, "slurm"), rep
    submitted = [e for e in events(run_dir) if e.get("event") == "submitted"]
    assert submitted and {e["gpus"] for e in submitted} == {2}, submitted
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    avail = [m["n_available"] for m in steps]
    # 4 nodes × 2 GPUs, the trainer holds 2 nodes: the scavenger sees at most 2 instances of 2 GPUs (a step that
    # ends before the scavenger's first view falls back to cluster.max_workers = 3)
    seen = [a for a in avail if a != 3]
    assert seen and all(a <= 2 for a in seen) and avail[-1] <= 2, avail
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0


def surplus_drains(run_dir) -> list:
    """Running rollout jobs the scavenger drained (USR2 + drain marker) because the target dropped below them."""
    return [e for e in events(run_dir)
            if e.get("event") == "cancelled" and e.get("mode") == "signal" and e.get("reason") == "surplus"]


def stall_trainer_until_a_drain(r: SlurmRun, last_step: int, attempts: int = 8, stall_s: float = 6.0) -> int:
    """Make the controller lower N_prem below the running jobs — its own decision, not a scripted target — and
    return how many trainer stalls that took (0: it dropped on its own).

    The cap is ``ceil((t_remote·n_prem + T_seed·N_resv) / t_train)``; with this tiny model it settles at 2 (≈ 1.6
    raw) and whether it ever drops while two jobs run is up to timing (it once stayed at 2 for all 50 steps). A
    trainer stopped for ``stall_s`` inside its training phase (high CPU: the backward passes; the waits for
    rollouts are idle) is a straggling step: its ``t_train`` grows by ``stall_s``, the raw cap falls under 1 and the
    scavenger must drain one of the two running jobs. A stall that lands elsewhere changes nothing; try again — until
    step ``last_step`` (a later drain leaves no window of 3 reconciliation periods to judge it in)."""
    import psutil

    run_dir, env, tag = r.run_dir, r.env, r.tag
    lines = [json.loads(x) for f in run_dir.glob("train-*.out") for x in f.read_text().splitlines()
             if x.startswith('{"ts"')]
    trainer = psutil.Process(next(x["pid"] for x in lines if x["role"] == "trainer"))
    for attempt in range(attempts + 1):
        wait_for(lambda: surplus_drains(run_dir) or steps_done(run_dir) >= last_step
                 or len(settled_running(env, tag)) >= 2, 120, "two running rollout jobs", state=r.state)
        if attempt and not surplus_drains(run_dir):  # the last stall's decision reaches the scavenger in a poll
            time.sleep(3 * r.poll_s + 1.0)
        if surplus_drains(run_dir) or steps_done(run_dir) >= last_step:
            return attempt
        deadline = time.monotonic() + 30
        while trainer.cpu_percent(interval=0.2) < 50 and time.monotonic() < deadline:
            pass  # waiting for the training phase
        trainer.suspend()
        try:
            time.sleep(stall_s)
        finally:
            trainer.resume()
        n = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= n + 1, 120, "the stalled step's end", state=r.state)
    return attempts


def test_the_controller_steers_the_scavenger_on_slurm(tmp_path):
    """Issue 13, the RLBoost loop on Slurm with the cap on: every N_prem the scavenger obeys comes from the
    controller (no scripted target). The target takes at least two values; after each change the scavenger's live
    jobs (not leaving) match it within 3 reconciliation periods wherever capacity allows; a drop drains a running
    surplus job (USR2 + drain marker) that then leaves without requeueing — if the cap does not drop on its own, a
    trainer stalled for 6 s in its training phase (a straggling step) makes the controller drop it; high-priority
    jobs preempt rollout jobs twice; nothing is lost, duplicated or trained off-version; `stats --plot` draws it."""
    from scavenger.stats import read_reconcile_log

    # 30 steps: the two preemptions and the drain are over by step ≈ 15 (50 steps took 144–213 s in CI)
    STEPS = 30
    overrides = (f"--set trainer.steps={STEPS} --set rollout.max_new_tokens=128 --set rollout.prompts_per_step=16 "
                 "--set cluster.max_workers=3 --set policy.t_seed_initial_s=0.3 --set network.bind_host=127.0.0.1 "
                 "--set policy.cap=true")
    preemptions = 0
    with SlurmRun(tmp_path, "loop", overrides) as r:
        env, tag, run_dir, state, poll_s = r.env, r.tag, r.run_dir, r.state, r.poll_s

        def off_trainer() -> list:
            jobs = json.loads(sh(["squeue", "--json"], env))["jobs"]
            trainer_node = next((node_of(j) for j in jobs if str(j["job_id"]) == r.job), "")
            return [j for j in settled_running(env, tag) if node_of(j) not in ("", trainer_node)]

        for _ in range(2):  # high-priority jobs take the nodes of running rollout jobs, twice
            wait_progressing(lambda: off_trainer() or (run_dir / "report.json").exists(),
                             lambda: steps_done(run_dir), 180, "a settled rollout job off the trainer's node",
                             state=state)
            if (run_dir / "report.json").exists():
                break
            n = requeues(run_dir)
            job = r.preempt()
            wait_for(lambda: requeues(run_dir) > n, 90, "the preempted job's requeue", state=state)
            # every job this preemption takes is gone before the next one counts (a job started just before it
            # loses its warning and leaves only at the end of the grace time: its requeue once passed for the
            # second preemption's)
            wait_for(lambda: r.preemptor_started(job), 90, "the high-priority job started", state=state)
            preemptions += 1
        stalls = stall_trainer_until_a_drain(r, last_step=STEPS - 5)
        rep = r.finish()
    why = state()
    assert "failed" not in rep, rep
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0 and rep["tokens_trained_off_version"] == 0
    assert preemptions == 2, why
    print(f"trainer stalls before a drain: {stalls}")
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    caps = [m["n_prem_cap"] for m in steps]
    assert all(c is not None for c in caps[1:]), caps  # the controller decided every target after the first step
    targets = [m["n_prem_target"] for m in steps]
    assert len(set(targets)) >= 2, targets
    views = [v for v in read_reconcile_log(run_dir) if v.get("active")]
    # after each target change, live jobs (not leaving) = min(target, capacity) within 3 reconciliation periods
    changes = [(v["ts"], v["target"]) for a, v in zip(views, views[1:]) if v["target"] != a["target"]]
    # a change is judged when the target held for the whole window and the run was still active at its end (a
    # change in the run's last seconds, or one overtaken by the next, has no window to be met in)
    judged = [(t, n) for t, n in changes
              if all(v["target"] == n for v in views if t <= v["ts"] <= t + 3 * poll_s + 1.0)
              and any(v["ts"] >= t + 3 * poll_s for v in views)]
    assert len(judged) >= 1, (changes, views)
    for t, n in judged:
        later = [v for v in views if t <= v["ts"] <= t + 3 * poll_s + 1.0]
        assert any(v["live"] - v["draining"] == min(n, v["live"] - v["draining"] + (v["idle_slots"] or 0))
                   for v in later), (t, n, later)
    ev = events(run_dir)
    drained = surplus_drains(run_dir)
    assert drained, "no running surplus job was drained when the target dropped\n" + why
    causes = {(e["job_id"], e["attempt"]): e.get("cause") for e in ev if e.get("event") == "warned"}
    for d in drained:  # (a job signalled before its batch shell started the worker has no warned event)
        assert causes.get((d["job_id"], d["restart_cnt"]), "drained") == "drained", (d, causes)
    assert not [e for e in ev if e.get("event") == "requeue_requested"
                and causes.get((e["job_id"], e["attempt"])) == "drained"]
    assert rep["instances_drained"] >= 1 and rep["instances_preempted_with_warning"] >= 2, rep
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "stats", str(run_dir), "--plot",
                        str(run_dir / "capacity.png")], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (run_dir / "capacity.png").stat().st_size > 10_000
    assert "N_prem live vs simulated" in p.stdout, p.stderr  # the simulator's N_prem for the same capacity
    print([ln for ln in p.stdout.splitlines() if ln.startswith("N_prem live vs simulated")])


def test_a_tool_using_run_on_slurm_loses_no_trajectory_to_preemption(tmp_path):
    """Issue 17's acceptance run: multi-turn trajectories with tool calls (the tool runs in the trainer job, in the
    manager's tool workers; "." closes a call) while a high-priority job preempts the rollout jobs: nothing lost,
    duplicated or off-version; tool calls made. (Whether the preempted jobs held partial trajectories at that moment
    is up to Slurm's timing; per-turn migration itself is tested with real engines and local preemptions in
    tests/test_trajectories.py.)"""
    overrides = ("--set trainer.steps=12 --set task.turns.max=3 --set task.turns.tool_call_open='' "
                 "--set task.turns.tool_call_close='.' --set rollout.max_new_tokens=32 --set cluster.max_workers=3 "
                 "--set policy.t_seed_initial_s=0.3 --set network.bind_host=127.0.0.1 --set policy.cap=false")
    with SlurmRun(tmp_path, "tools", overrides, scav=("--gpus-per-job", "1")) as r:
        env, tag, run_dir, state = r.env, r.tag, r.run_dir, r.state
        wait_for(lambda: steps_done(run_dir) >= 2 and len(settled_running(env, tag)) >= 2, 180,
                 "2 settled rollout jobs serving", state=state)
        r.preempt()
        wait_for(lambda: requeues(run_dir) >= 1, 60, "a requeue", state=state)
        rep = r.finish()
    assert "failed" not in rep, rep
    assert rep["steps"] == 12 and rep["preemptions"] >= 1, rep
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, rep
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0, rep
    assert rep["environment_calls"] > 0 and rep["turns_per_trajectory_mean"] > 1.0, rep


def test_a_run_launched_as_readme_says_has_one_run_id_everywhere_and_the_dashboard_shows_it(tmp_path):
    """Issue 28: ``sbatch/launch RUN_DIR CONFIG -- --partition scavenger …`` exactly as docs/slurm.md gives
    it — no activated virtual environment (no venv on PATH, no RLBOOST_PYTHON), no ids passed by hand. The launcher
    finds the interpreter the project is installed in; the trainer, the manager, the scavenger and every rollout job
    label the run with one id (the run directory's name: the scavenger used ``<name>-<hash>``, and ``""`` in its
    logs); a real Prometheus scraping ``RUN_DIR/prometheus/*.json`` answers every query of the Grafana dashboard for
    that id, the ``run`` variable's included."""
    from _prometheus import Prometheus

    env = dict(os.environ, **ensure_local_slurm())
    for k in ("VIRTUAL_ENV", "RLBOOST_PYTHON", "RLBOOST_RUN_ID", "PYTHONPATH"):
        env.pop(k, None)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if p and p != venv_bin)
    run_dir = tmp_path / "readme-run"
    config = REPO / "configs/local.toml"  # README's: the demo's 60 steps
    dash = json.loads((REPO / "rlboost_hpc/observe/grafana/rlboost-manager.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    tag = f"rlboost:{run_dir.name}@"
    with Prometheus(tmp_path / "prometheus", str(run_dir / "prometheus" / "*.json")) as prom:
        p = subprocess.run(["bash", str(REPO / "sbatch/launch"), str(run_dir), str(config), "--detach", "--",
                            "--partition", "scavenger", "--max-jobs", "2", "--metrics-port", "0", "--poll-s", "1"],
                           capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr
        trainer_job = (run_dir / "train.jobid").read_text().strip().split(";")[0]

        def state() -> str:
            return diagnosis(env, tag, run_dir) + "\n" + tail(run_dir / "logs" / "scavenger.log")

        try:
            wait_for(lambda: prom.targets_up() == {"rlboost-manager": True, "rlboost-scavenger": True}, 180,
                     "both targets scraped", state=lambda: f"{prom.targets_up()}\n{state()}")
            wait_for(lambda: any(e.get("event") == "worker_started" for e in events(run_dir)), 240,
                     "a rollout job registered", state=state)
            time.sleep(5)  # several scrapes inside every [1m] range
            assert steps_done(run_dir) < 60, "the run ended before the dashboard was read:\n" + state()
            values = prom.query('count by (run) (rlboost_step)')
            assert [v["metric"]["run"] for v in values] == [run_dir.name], values  # Grafana's `run` variable
            # (the scavenger counts tokens from the events rollout jobs write as they leave: no cost per token before)
            live = [e for e in exprs if "cost_per_token" not in e]
            empty = [e for e in live if not prom.query(e.replace("$run", run_dir.name))]
            assert not empty, f"dashboard queries without a series for run {run_dir.name}: {empty}"
            # the scavenger's counters as scraped (issue 57: shown before with a fake Slurm only): the jobs it
            # submitted to the real Slurm, as its events say (the counter at a scrape ≤ the events now)
            # the held-out evaluation before training, as the trainer told the manager (issue 58 item 5)
            pass_k = {v["metric"]["k"]: float(v["value"][1]) for v in prom.query(
                f'rlboost_heldout_pass_at_k_ratio{{run="{run_dir.name}",when="before"}}')}
            scraped = prom.query(f'rlboost_scavenger_submitted_total{{run="{run_dir.name}"}}')
            submitted_now = sum(1 for e in events(run_dir) if e.get("event") == "submitted")
            assert scraped and 1 <= float(scraped[0]["value"][1]) <= submitted_now, (scraped, submitted_now)
            wait_progressing(lambda: (run_dir / "report.json").exists(), lambda: steps_done(run_dir), 180,
                             "report.json", state=state)
            pid = int((run_dir / "scavenger.pid").read_text())
            wait_for(lambda: not Path(f"/proc/{pid}").exists(), 120, "the scavenger's exit", state=state)
        finally:
            ids = [trainer_job, *[str(j["job_id"]) for j in our_jobs(env, tag)]]
            subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=30)
            if (run_dir / "scavenger.pid").exists():
                subprocess.run(["kill", (run_dir / "scavenger.pid").read_text().strip()], capture_output=True)
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["steps"] == 60 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, rep
    assert pass_k and pass_k == pytest.approx(rep["pass_at_k_heldout_before"]), (pass_k, rep)
    rid = run_dir.name
    assert json.loads((run_dir / "endpoints.json").read_text())["run_id"] == rid
    logged = {}
    for role, path in [("trainer", run_dir / "logs/trainer.jsonl"), ("manager", run_dir / "logs/manager.jsonl"),
                       ("scavenger", run_dir / "logs/scavenger.log")]:
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith('{"ts"')]
        logged[role] = {x["run"] for x in lines}
    workers = [json.loads(ln) for f in (run_dir / "logs").glob("rlboost-rollout-*.out") for ln in f.read_text(
        errors="replace").splitlines() if ln.startswith('{"ts"') and '"role": "worker' in ln]
    logged["rollout jobs"] = {x["run"] for x in workers if x["run"]}
    assert workers and all(v == {rid} for v in logged.values()), logged
    for sd in ("rlboost-manager", "rlboost-scavenger"):
        assert json.loads((run_dir / f"prometheus/{sd}.json").read_text())[0]["labels"]["run"] == rid
    submitted = [e for e in events(run_dir) if e.get("event") == "submitted"]
    assert submitted and all(e["tag"].startswith(tag) for e in submitted), submitted
