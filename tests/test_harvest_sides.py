"""Issue 45, the sides of the harvest loop one at a time (unit tests: each writes by hand what another side writes;
the whole loop, through the users' and the admin's doors, is in test_harvest_e2e_slurm.py).

- the controller: what a run could use (``n_prem_wanted``) is the N_prem law before its clamp to capacity;
- the scavenger: it asks the service for that, never for its clamped target (the bootstrap deadlock: a share of 0
  made a capped target of 0, a demand of 0 and a share of 0 again); it says why it holds back, once per change; it
  ends the run's harvesting when the trainer job ends while the target still says active;
- the service: a demand speaks only for its file owner's jobs; reservations are judged against each run's job time
  limit; names the policy gives that Slurm does not know are refused;
- the spool: a run joins only a directory a service created, and cannot post over another user's demand.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from test_harvest import Clock, RecordedSlurm, _service, job, node
from test_scavenger import FakeClock, FakeSlurm, env, live_ids  # noqa: F401 (env: a fixture)

from rlboost_hpc.policy.controller import RolloutController, StepObservation
from scavenger.config import ScavengerConfig, time_limit_seconds
from scavenger.daemon import Scavenger
from scavenger.harvest import DemandFile, HarvestSpool, NotASpool, RunIdTaken
from scavenger.harvest_policy import Blackout, SitePolicy, load_site_policy, unknown_names
from scavenger.shares import RunDemand, weighted_shares
from scavenger.slurm_records import JobInfo
from scavenger.slurm_reservations import Reservation

NOBODY = pwd.getpwnam("nobody")


def obs(n_available: int | None, **kw) -> StepObservation:
    base = dict(t_seed_s=2.0, t_wait_train_s=0.0, t_wait_remote_s=0.0, t_remote_s=0.0, n_remote=0, t_train_s=1.0,
                n_instances_start=0, n_instances_end=0, n_available=n_available)
    return StepObservation(**{**base, **kw})


# ---------------------------------------------------------------------------------------------- the controller
def test_what_a_run_could_use_is_the_law_before_the_clamp_to_capacity():
    ctl = RolloutController(n_resv=1.0)
    d = ctl.end_step(obs(n_available=0))  # T_seed·N_resv/t_train = 2: the run could use 2 with nothing offered
    assert (d.n_prem_cap, d.n_prem_wanted) == (0, 2)
    d = ctl.end_step(obs(n_available=5, t_remote_s=3.0, n_remote=2))  # (3·2 + 2·1)/1 = 8, 5 offered
    assert (d.n_prem_cap, d.n_prem_wanted) == (5, 8)
    d = ctl.end_step(obs(n_available=None, t_train_s=0.0))  # no measurement, nothing known: unbounded both
    assert (d.n_prem_cap, d.n_prem_wanted) == (None, None)
    off = RolloutController(n_resv=1.0, use_cap=False).end_step(obs(n_available=3))
    assert (off.n_prem_cap, off.n_prem_wanted) == (3, None)  # the cap off: use what is there, ask for the most


# ---------------------------------------------------------------------------------------------- the scavenger
@pytest.fixture
def served(tmp_path: Path):
    """A scavenger joined to a harvest service over the fake Slurm (both in this process, cycle by cycle)."""
    clock = FakeClock()
    fake = FakeSlurm(clock)
    spool = HarvestSpool(tmp_path / "spool").create()
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    script = tmp_path / "rollout.sbatch"
    script.write_text("#!/bin/bash\nsleep 1000\n")
    cfg = ScavengerConfig(max_jobs=3, grace_s=15, poll_s=5, harvest_dir=str(spool.root), run_id="r1",
                          time_limit="30")
    sc = Scavenger(cfg, run_dir, slurm=fake, clock=clock, script=script)

    class Listing(RecordedSlurm):  # the service's view of the same fake cluster
        def __init__(self):
            super().__init__([], [])

        def sinfo_nodes(self, partition=None):
            self.listings += 1
            return fake.sinfo_nodes()

        def squeue_jobs(self, **kw):
            self.listings += 1
            return [JobInfo(**{**j.__dict__, "user": "root"}) for j in fake.squeue_jobs(all_states=True)]

    svc = _service(tmp_path, Listing(), lambda: clock.t)
    return clock, fake, run_dir, sc, svc


def write_target(run_dir: Path, n_prem: int, wanted: int | None = None, active: bool = True) -> None:
    """The trainer's side, by hand (``RunDir.write_target`` writes the same shape)."""
    from rlboost_hpc.rundir import RunDir

    RunDir(run_dir).write_target(n_prem, active=active, step=1, gpus_per_instance=1, wanted=wanted)


def test_a_run_asks_for_what_it_could_use_so_a_share_of_zero_is_no_deadlock(served):
    """Regression (issue 45): the scavenger posted its capped target (0, capped by a share of 0) as its demand,
    so the service granted 0 again, for ever. It posts what the run could use; the share then grows and the
    capacity the trainer reads with it."""
    clock, fake, run_dir, sc, svc = served
    write_target(run_dir, n_prem=0, wanted=2)  # the trainer saw capacity 0; its law wants 2
    sc.reconcile_once()
    assert svc.spool.read_demands()["r1"].demand.instances == 2
    svc.run_cycle()
    res = sc.reconcile_once()
    assert res.share == 2 and res.desired == 0 and res.submitted == []  # kept: 0 until the trainer re-caps
    assert json.loads((run_dir / "capacity.json").read_text())["idle_slots"] == 2  # what the trainer reads next
    write_target(run_dir, n_prem=2, wanted=2)
    clock.t += 5
    svc.run_cycle()
    assert len(sc.reconcile_once().submitted) == 2
    write_target(run_dir, n_prem=1, wanted=9)  # within --max-jobs
    clock.t += 5
    sc.reconcile_once()
    assert svc.spool.read_demands()["r1"].demand.instances == 3


def test_the_scavenger_says_why_it_holds_back_once_per_change(served, caplog):
    clock, fake, run_dir, sc, svc = served
    caplog.set_level(logging.INFO, logger="scavenger")

    def step() -> str:
        res = sc.reconcile_once()
        sc._log_held_back(res)
        clock.t += 5
        return res.held_back

    assert "no target.json yet" in step()
    write_target(run_dir, n_prem=3, wanted=3)
    step()  # waits for the service's first listing
    svc.policy = svc.policy.model_copy(update={"blackout": [Blackout(start="00:00", end="23:59")]})
    svc.run_cycle()
    assert step() == "the harvest service grants 0 of the 3 rollout jobs asked: blackout"
    svc.run_cycle()
    step()
    svc.policy = svc.policy.model_copy(update={"blackout": []})
    svc.run_cycle()
    assert step() == ""
    said = [r.getMessage() for r in caplog.records if "held back" in r.getMessage() or "holding back" in r.getMessage()]
    assert said == ["scavenger: holding back: no target.json yet: the trainer has not said how many rollout jobs of "
                    "which size it wants",
                    "scavenger: holding back: the harvest service grants 0 of the 3 rollout jobs asked: blackout",
                    "scavenger: no longer held back (0 live rollout job(s), desired 3)"], said


def test_a_trainer_job_that_ends_ends_the_harvesting_within_one_poll(env):
    """Regression (issue 45): a trainer that failed left target.json active; the scavenger kept its rollout jobs
    and waited for ever. It watches the trainer job (one listing, no extra Slurm call) and cancels at once."""
    clock, fake, run_dir, make = env
    fake.jobs["7"] = {"name": "rlboost-train-r1", "comment": "", "state": "RUNNING", "restart_cnt": 0,
                      "submit_time": clock.t, "gpus": 1, "node": "n4", "start_time": clock.t}
    sc = make(ScavengerConfig(max_jobs=2, poll_s=5, trainer_job="7"))
    write_target(run_dir, n_prem=2)
    assert len(sc.reconcile_once().submitted) == 2
    fake.schedule()
    calls = len(fake.our_calls("squeue"))
    clock.t += 5
    assert sc.reconcile_once().cancelled == [] and len(fake.our_calls("squeue")) == calls + 1
    fake.finish("7", "FAILED", exit_code=1)
    clock.t += 5
    assert sc.reconcile_once().target.active  # one listing could be a requeue passing by: the next one decides
    clock.t += 5
    res = sc.reconcile_once()
    assert not res.target.active and res.target.source == "trainer_ended" and sorted(res.cancelled) == ["100", "101"]
    assert live_ids(fake) == ["7"] or live_ids(fake) == []
    assert sc.run_forever(max_cycles=3, exit_when_done=True) == 0 and sc.reconcile_once().live == 0


def test_rollout_jobs_are_released_while_their_trainer_job_waits_requeued_and_come_back_when_it_runs(env, caplog):
    """Issue 57 item 8 (prime-rl #2961): while the trainer job was requeued and pending, its rollout jobs kept
    cycling on harvested GPUs with no manager to serve (an hour pending: 4 GPU-hours). Now nothing is submitted
    while it waits, its live jobs are cancelled once it has waited ``trainer_pending_release_s``, and the target
    holds again when it runs."""
    clock, fake, run_dir, make = env
    fake.jobs["7"] = {"name": "rlboost-train-r1", "comment": "", "state": "PENDING", "restart_cnt": 0,
                      "submit_time": clock.t, "gpus": 1, "reason": "Priority"}
    sc = make(ScavengerConfig(max_jobs=3, poll_s=5, trainer_job="7", trainer_pending_release_s=60))
    write_target(run_dir, n_prem=3)
    res = sc.reconcile_once()  # not started yet: no manager, nothing submitted
    assert res.submitted == [] and res.desired == 0 and "trainer job 7 is PENDING (Priority)" in res.held_back
    fake.jobs["7"].update(state="RUNNING", node="n4", start_time=clock.t, reason="")
    clock.t += 5
    assert len(sc.reconcile_once().submitted) == 3
    fake.schedule()
    fake.preempt("7")  # requeued: pending again
    clock.t += 5
    with caplog.at_level(logging.WARNING, logger="scavenger"):
        res = sc.reconcile_once()
    assert res.submitted == res.cancelled == [] and res.live == 3 and "none is submitted" in res.held_back
    assert any("trainer job 7 is PENDING (BeginTime)" in r.getMessage() for r in caplog.records)
    clock.t += 55
    assert sc.reconcile_once().cancelled == []  # (59 s: not yet)
    clock.t += 5
    res = sc.reconcile_once()
    assert sorted(res.cancelled) == ["100", "101", "102"] and "released until it runs" in res.held_back
    assert live_ids(fake) == ["7"]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sorted(e["job_id"] for e in events if e.get("reason") == "trainer_pending") == ["100", "101", "102"]
    clock.t += 600  # an hour pending costs no rollout GPU
    assert sc.reconcile_once().submitted == [] and live_ids(fake) == ["7"]
    fake.schedule()  # the trainer runs again: the target holds again
    clock.t += 5
    res = sc.reconcile_once()
    assert len(res.submitted) == 3 and res.held_back == "" and res.target.active


def test_a_trainer_job_slurm_no_longer_lists_counts_as_ended_after_two_listings(env):
    sc = env[3](ScavengerConfig(max_jobs=1, trainer_job="4242"))
    assert sc.reconcile_once().target.source == "default"  # one listing without it: not yet
    assert sc.reconcile_once().target.source == "trainer_ended"


# ---------------------------------------------------------------------------------------------- the service
def _own(path: Path, user: pwd.struct_passwd) -> None:
    os.chown(path, user.pw_uid, user.pw_gid)


def test_a_demand_speaks_only_for_the_jobs_of_its_files_owner(tmp_path):
    """Regression (issue 45): a user who posted a demand under another user's run id and tag, then went silent,
    had the service scancel the other user's jobs once the demand timed out."""
    jobs = [JobInfo(**{**job("11", "rlboost:a@0").__dict__, "user": "alice"}),
            JobInfo(**{**job("12", "rlboost:a@0").__dict__, "user": "alice"})]
    slurm, clock = RecordedSlurm([node("n1", used=2), node("n2")], jobs), Clock()
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=4, ts=1.0))  # mallory's file, alice's tag
    _own(svc.spool.demands / "a.json", NOBODY)
    res = svc.run_cycle()
    share = svc.spool.read_share("a")
    assert res.shares == {"a": 0} and share.jobs == [] and "held by the jobs of user(s) alice" in share.reason
    clock.t += 31  # mallory goes silent
    res = svc.run_cycle()
    assert res.vanished == ["a"] and res.cancelled == [] and slurm.cancelled == []  # alice's jobs untouched
    assert svc.spool.read_demands() == {}  # forgotten: none of *mallory's* jobs is live


def test_another_users_jobs_under_a_runs_tag_are_never_its_own(tmp_path):
    me = pwd.getpwuid(os.getuid()).pw_name
    jobs = [JobInfo(**{**job("11", "rlboost:a@0").__dict__, "user": me}),
            JobInfo(**{**job("12", "rlboost:a@0", node_="n2").__dict__, "user": "nobody"})]
    slurm, clock = RecordedSlurm([node("n1", used=1), node("n2", used=1)], jobs), Clock()
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=4, ts=1.0, trainer_job="12"))
    res = svc.run_cycle()
    share = svc.spool.read_share("a")
    assert [j.job_id for j in share.jobs] == ["11"] and res.held_gpus == 1 and res.shares == {"a": 3}
    assert share.trainer is None and share.trainer_job == "12"  # another user's job is not this run's trainer


def test_a_run_cannot_post_over_another_users_demand(tmp_path):
    spool = HarvestSpool(tmp_path / "spool").create()
    spool.post_demand(DemandFile("a", "rlboost:a@0", instances=1))
    _own(spool.demands / "a.json", NOBODY)
    with pytest.raises(RunIdTaken, match="run id 'a' is held by user nobody"):
        spool.post_demand(DemandFile("a", "rlboost:a@1", instances=1))


def test_reservations_are_judged_against_each_runs_job_time_limit(tmp_path):
    """Regression (issue 45): the horizon was one fixed hour for every run, so a run of 4-hour jobs was offered
    nodes reserved for maintenance in 2 hours, and its jobs sat pending there."""
    slurm, clock = RecordedSlurm([node(f"n{i}") for i in range(1, 5)], []), Clock()
    slurm.reservations_ = [Reservation("maint", clock.t + 2 * 3600, clock.t + 3 * 3600, frozenset({"n1", "n2"}))]
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("short", "rlboost:short@0", instances=2, time_limit_s=1800, ts=1.0))
    svc.spool.post_demand(DemandFile("long", "rlboost:long@0", instances=8, time_limit_s=4 * 3600, ts=1.0))
    res = svc.run_cycle()
    assert res.shares == {"short": 2, "long": 4} and res.pool_gpus == 8 and res.reserved_nodes == ["n1", "n2"]
    assert svc.spool.read_share("long").pool_gpus == 4 and svc.spool.read_share("short").pool_gpus == 8
    svc.spool.post_demand(DemandFile("short", "rlboost:short@0", instances=8, time_limit_s=1800, ts=2.0))
    assert svc.run_cycle().shares == {"short": 4, "long": 4}  # short gets n1, n2 that long may not use
    assert time_limit_seconds("4:00:00") == 4 * 3600 and time_limit_seconds("1-0") == 86400


def test_group_limits_bound_the_runs_confined_to_fewer_nodes():
    d = [RunDemand("a", 10), RunDemand("b", 10), RunDemand("c", 10, weight=2.0)]
    assert weighted_shares(d, 8, groups=[(frozenset({"c"}), 2)]) == {"a": 3, "b": 3, "c": 2}
    assert weighted_shares(d, 8, groups=[(frozenset({"b", "c"}), 3)]) == {"a": 5, "b": 1, "c": 2}


def test_names_slurm_does_not_know_are_named_with_their_key():
    pol = SitePolicy(partitions=["scavenger", "gpu-low"], qos=["", "low"], accounts={"phys": {}, "bio": {}})
    assert unknown_names(pol, {"scavenger", "train"}, {"normal"}, {"phys"}) == [
        "harvest.partitions: 'gpu-low' is not a partition Slurm knows (it knows scavenger, train)",
        "harvest.qos: 'low' is not a QoS Slurm knows (it knows normal)",
        "harvest.accounts.bio: 'bio' is not an account Slurm knows (it knows phys)"]
    assert unknown_names(pol, {"scavenger", "gpu-low"}, None, None) == []  # no accounting: not checked


def test_the_shipped_example_policy_has_no_active_blackout_and_its_commented_examples_load(tmp_path):
    from rlboost_hpc.paths import shipped

    text = shipped("sbatch/harvest/harvest.toml").read_text()
    pol = load_site_policy(shipped("sbatch/harvest/harvest.toml"))
    assert pol.blackout == [] and pol.accounts == {} and pol.idle_share_free == 0.1
    examples = "\n".join(ln[2:] if ln.startswith("# [") or (ln.startswith("# ") and " = " in ln[:30]) else ln
                         for ln in text.splitlines())
    (tmp_path / "all.toml").write_text(examples)
    pol = load_site_policy(tmp_path / "all.toml")
    assert pol.blackout and pol.accounts["rl-research"].weight == 2.0 and pol.runs["qwen3-8b-gsm8k"].max_gpus == 32
    assert pol.in_blackout(dt.datetime(2026, 12, 7, 10)) and not pol.in_blackout(dt.datetime(2026, 12, 6, 10))


# ---------------------------------------------------------------------------------------------- the user's doors
def test_a_scavenger_joins_only_a_spool_a_harvest_service_created(tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    (tmp_path / "made-by-hand" / "demands").mkdir(parents=True)
    with pytest.raises(NotASpool, match="not a harvest service's spool"):
        HarvestSpool(tmp_path / "made-by-hand").require()
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(run_dir), "--check", "--harvest-dir"]
    bad = subprocess.run([*cmd, str(tmp_path / "made-by-hand")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--harvest-dir" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    spool = HarvestSpool(tmp_path / "spool").create()
    good = subprocess.run([*cmd, str(spool.root)], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "ok" in good.stdout, good.stderr


@pytest.mark.parametrize("flag,value", [("--days", "-1"), ("--days", "nan"), ("--since", "yesterday-ish")])
def test_harvest_report_with_a_bad_window_is_exit_2_naming_the_flag(flag, value):
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "report", flag, value],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_gpus_of_a_node_whose_cpus_are_taken_are_not_idle(tmp_path):
    """Regression (issue 45): a trainer job holding all of a node's CPUs (train.sbatch asks 4) and one of its GPUs
    left the other GPU counted as idle; the service granted shares the cluster could not start, and the runs' jobs
    sat pending. A GPU is idle only where a job's CPUs fit too — in the service's pool and the scavenger's slots."""
    from scavenger.shares import harvestable_gpus
    from scavenger.slurm_records import NodeInfo

    full = NodeInfo("n1", "MIXED", ("scavenger",), 4, 2, 1, alloc_cpus=4)  # the trainer's node
    half = NodeInfo("n2", "MIXED", ("scavenger",), 4, 2, 0, alloc_cpus=3)
    assert harvestable_gpus([full, half, node("n3")], [], partitions=["scavenger"], run_tags=set())[:2] == (3, 3)
    assert harvestable_gpus([half], [], partitions=["scavenger"], run_tags=set(), cpus_per_gpu=2)[1] == 0
    clock = FakeClock()
    fake = FakeSlurm(clock, nodes=1)
    fake.sinfo_nodes = lambda partition=None: [full]
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    sc = Scavenger(ScavengerConfig(max_jobs=2), run_dir, slurm=fake, clock=clock, script=tmp_path / "s.sh")
    write_target(run_dir, n_prem=2)
    res = sc.reconcile_once()
    assert res.free_slots == 0 and res.submitted == [] and "no idle slot" in res.held_back


def test_the_demand_proportional_rule_starves_a_small_run_that_max_min_serves():
    """The open anchor's rule (RLix: leftover GPUs in proportion to outstanding demand), kept for comparison
    (``share_rule``, bench_harvest.py part C): under contention a run asking for one instance gets none."""
    from scavenger.shares import proportional_shares

    d = [RunDemand("a", 12), RunDemand("b", 12), RunDemand("c", 10), RunDemand("new", 1)]
    assert proportional_shares(d, 14) == {"a": 5, "b": 5, "c": 4, "new": 0}
    assert weighted_shares(d, 14) == {"a": 5, "b": 4, "c": 4, "new": 1}
    assert proportional_shares([RunDemand("a", 3), RunDemand("b", 2)], 10) == {"a": 3, "b": 2}  # never above demand
    assert proportional_shares([RunDemand("a", 10, gpus_per_instance=4), RunDemand("b", 10)], 12) == {"a": 2, "b": 3}
    assert proportional_shares(d, 14, groups=[(frozenset({"a"}), 2)])["a"] == 2


def test_the_service_splits_by_the_policys_share_rule(tmp_path):
    slurm, clock = RecordedSlurm([node(f"n{i}") for i in range(1, 8)], []), Clock()
    svc = _service(tmp_path, slurm, clock, share_rule="demand_proportional", idle_share_free=0.0)
    for rid, n in (("a", 12), ("b", 12), ("c", 10), ("new", 1)):
        svc.spool.post_demand(DemandFile(rid, f"rlboost:{rid}@0", instances=n, ts=1.0))
    assert svc.run_cycle().shares == {"a": 5, "b": 5, "c": 4, "new": 0}


def test_a_second_service_on_the_same_spool_is_refused(tmp_path):
    """A new user's finding (issue 45): a second `harvest serve` on one spool ran beside the first, both splitting the
    GPUs and cancelling jobs. The spool is claimed (a lock held for the service's life); the second is exit 2."""
    from scavenger.harvest import SpoolBusy

    first = HarvestSpool(tmp_path / "spool").claim().create()
    with pytest.raises(SpoolBusy, match=f"another harvest service \\(pid {os.getpid()} on"):
        HarvestSpool(tmp_path / "spool").claim()
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "serve", "--spool", str(first.root),
                        "--once"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "another harvest service" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_joining_the_spool_of_a_stopped_service_warns_and_abbreviated_flags_are_refused(tmp_path):
    spool = HarvestSpool(tmp_path / "spool").create()
    spool.beat(1.0)  # its last cycle: long ago
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "scavenger", str(run_dir), "--check", "--harvest-dir",
           str(spool.root)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "has run no cycle for" in p.stderr and "is it stopped?" in p.stderr, p.stderr
    p = subprocess.run([*cmd, "--max-job", "2"], capture_output=True, text=True, timeout=60)  # not --max-jobs
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "unrecognized arguments: --max-job 2" in p.stderr
