"""Scavenger daemon unit tests against a fake Slurm (the real cluster is in test_scavenger_slurm.py)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from scavenger.config import ScavengerConfig, ScavengerConfigError, load_scavenger_config
from rlboost_hpc.rundir import RunDirError
from scavenger.daemon import Scavenger, Target, read_target
from rlboost_hpc.events import append_event, drain_marker_path, read_events
from scavenger.slurm import SlurmCommandError
from scavenger.slurm_records import JobInfo, NodeInfo
from scavenger.stats import compute_stats


class FakeClock:
    """Manual clock: ``time()`` returns ``t``; ``sleep(s)`` records ``s`` and advances ``t``."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


class FakeSlurm:
    """Test double following the contract of :class:`scavenger.slurm.SlurmClient` (same methods and
    signatures, returns ``NodeInfo``/``JobInfo``, raises ``SlurmCommandError`` on failure) over a tiny
    in-memory scheduler: ``nodes`` × ``gpus_per_node`` GPUs in one partition; :meth:`schedule` starts pending
    jobs where GPUs are free (lowest id first), :meth:`preempt` requeues a running job (restart_cnt + 1) the
    way PreemptMode=REQUEUE does, :meth:`finish` ends one. Failures are injected per method with
    :meth:`fail_next`; every call is recorded in ``calls``."""

    def __init__(self, clock: FakeClock, nodes: int = 4, gpus_per_node: int = 2, partition: str = "scavenger"):
        self.clock = clock
        self.partition = partition
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.gpus_per_node = gpus_per_node
        self.external: dict[str, int] = {n: 0 for n in self.node_names}  # GPUs held by other users' jobs
        self.jobs: dict[str, dict] = {}
        self.next_id = 100
        self.calls: list[tuple] = []
        self.failures: dict[str, list[SlurmCommandError]] = {}
        self.signals: dict[str, list[str]] = {}

    # -- failure injection ----------------------------------------------------------------------
    def fail_next(self, method: str, times: int = 1, timed_out: bool = True) -> None:
        err = SlurmCommandError([method], None if timed_out else 1,
                                "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
                                timed_out)
        self.failures.setdefault(method, []).extend([err] * times)

    def _maybe_fail(self, method: str) -> None:
        q = self.failures.get(method)
        if q:
            raise q.pop(0)

    # -- contract methods -----------------------------------------------------------------------
    def sinfo_nodes(self, partition: str | None = None) -> list[NodeInfo]:
        self.calls.append(("sinfo", partition))
        self._maybe_fail("sinfo_nodes")
        used = dict(self.external)
        for j in self.jobs.values():
            if j["state"] == "RUNNING":
                used[j["node"]] += j["gpus"]
        out = []
        for n in self.node_names:
            st = "IDLE" if used[n] == 0 else ("ALLOCATED" if used[n] >= self.gpus_per_node else "MIXED")
            out.append(NodeInfo(n, st, (self.partition,), 4, self.gpus_per_node, used[n]))
        return [x for x in out if partition is None or partition in x.partitions]

    def squeue_jobs(self, name_prefix=None, comment_tag=None, all_states=False, only_mine=True) -> list[JobInfo]:
        self.calls.append(("squeue", comment_tag, all_states))
        self._maybe_fail("squeue_jobs")
        out = []
        for jid, j in self.jobs.items():
            info = JobInfo(job_id=jid, name=j["name"], comment=j["comment"], state=j["state"],
                           state_reason=j.get("reason", ""), partition=self.partition,
                           restart_cnt=j["restart_cnt"], nodes=j.get("node") or "",
                           submit_time=j["submit_time"], start_time=j.get("start_time"),
                           end_time=j.get("end_time"), gpus=j["gpus"], exit_code=j.get("exit_code"))
            if name_prefix is not None and not info.name.startswith(name_prefix):
                continue
            if comment_tag is not None and info.comment != comment_tag:
                continue
            if not all_states and info.terminal:
                continue
            out.append(info)
        return out

    def sbatch(self, script_path, args=(), env=None) -> str:
        self.calls.append(("sbatch", str(script_path), list(args)))
        self._maybe_fail("sbatch")
        opts = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
        jid = str(self.next_id)
        self.next_id += 1
        gres = opts.get("gres", "gpu:0")
        self.jobs[jid] = {"name": opts.get("job-name", ""), "comment": opts.get("comment", ""),
                          "state": "PENDING", "restart_cnt": 0, "submit_time": self.clock.time(),
                          "gpus": int(gres.split(":")[-1]), "args": list(args)}
        return jid

    def scancel(self, job_ids, signal=None, batch=False) -> None:
        ids = [str(j) for j in job_ids]
        self.calls.append(("scancel", ids, signal, batch))
        self._maybe_fail("scancel")
        for jid in ids:
            j = self.jobs[jid]
            if signal:
                self.signals.setdefault(jid, []).append(signal)
            elif j["state"] in ("PENDING", "RUNNING"):
                j["state"] = "CANCELLED"
                j["end_time"] = self.clock.time()

    # -- scheduler ------------------------------------------------------------------------------
    def free(self) -> dict[str, int]:
        nodes = {n.name: n.free_gpus for n in self.sinfo_nodes()}
        self.calls.pop()
        return nodes

    def schedule(self) -> list[str]:
        started = []
        for jid in sorted(self.jobs, key=int):
            j = self.jobs[jid]
            if j["state"] != "PENDING":
                continue
            for node, free in self.free().items():
                if free >= j["gpus"]:
                    j.update(state="RUNNING", node=node, start_time=self.clock.time())
                    started.append(jid)
                    break
        return started

    def preempt(self, jid: str) -> None:
        j = self.jobs[jid]
        assert j["state"] == "RUNNING"
        j.update(state="PENDING", node=None, start_time=None, reason="BeginTime")
        j["restart_cnt"] += 1

    def finish(self, jid: str, state: str = "COMPLETED", exit_code: int = 0) -> None:
        self.jobs[jid].update(state=state, exit_code=exit_code, end_time=self.clock.time())

    def our_calls(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


# --------------------------------------------------------------------------------------------------
@pytest.fixture
def env(tmp_path: Path):
    clock = FakeClock()
    fake = FakeSlurm(clock)
    run_dir = tmp_path / "run1"
    run_dir.mkdir()
    script = tmp_path / "rollout.sbatch"
    script.write_text("#!/bin/bash\nsleep 1000\n")
    cfg = ScavengerConfig(max_jobs=4, grace_s=15, poll_s=5, max_backoff_s=60)

    def make(config: ScavengerConfig = cfg) -> Scavenger:
        return Scavenger(config, run_dir, slurm=fake, clock=clock, script=script)

    return clock, fake, run_dir, make


def set_target(run_dir: Path, n: int, active: bool = True) -> None:
    (run_dir / "target.json").write_text(json.dumps({"n_prem": n, "active": active, "step": 3}))


def live_ids(fake: FakeSlurm) -> list[str]:
    return [jid for jid, j in fake.jobs.items() if j["state"] in ("PENDING", "RUNNING")]


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == kind]


# --------------------------------------------------------------------------------------------------
def test_nothing_is_submitted_before_the_run_says_how_many_jobs_of_which_size(env):
    """Regression (issue 13): with no target.json yet the daemon submitted max_jobs of its own default size, so a
    run whose instances take 2 GPUs got 1-GPU rollout jobs."""
    clock, fake, run_dir, make = env
    sc = make()
    res = sc.reconcile_once()
    assert res.ok and res.target == Target(0, True, "default") and res.submitted == [] and live_ids(fake) == []
    set_target(run_dir, 4)
    clock.t += 5
    assert len(sc.reconcile_once().submitted) == 4 == len(live_ids(fake))


def test_target_follows_up_and_down(env):
    clock, fake, run_dir, make = env
    sc = make()
    set_target(run_dir, 2)
    assert len(sc.reconcile_once().submitted) == 2
    fake.schedule()
    clock.t += 5
    set_target(run_dir, 3)
    res = sc.reconcile_once()
    assert len(res.submitted) == 1 and res.live == 2
    fake.schedule()
    clock.t += 5
    assert sc.reconcile_once().submitted == []  # at target: nothing to do
    set_target(run_dir, 1)
    clock.t += 5
    res = sc.reconcile_once()
    assert len(res.signalled) == 2 and res.cancelled == []  # running surplus: warning first
    # still running within the grace: no new action, and the draining jobs are not counted as live targets
    clock.t += 5
    res = sc.reconcile_once()
    assert res.signalled == [] and res.cancelled == [] and res.submitted == []
    clock.t += 11  # grace (15 s) expired
    res = sc.reconcile_once()
    assert sorted(res.cancelled) == sorted(fake.signals)
    assert len(live_ids(fake)) == 1
    # back up: submits again, never exceeding the target
    set_target(run_dir, 3)
    clock.t += 5
    res = sc.reconcile_once()
    assert len(res.submitted) == 2 and len(live_ids(fake)) == 3


def test_target_is_clamped_to_max_jobs(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 50)
    res = make().reconcile_once()
    assert res.desired == 4 and len(res.submitted) == 4


def test_clamped_to_idle_capacity(env):
    clock, fake, run_dir, make = env
    fake.external.update(n1=2, n2=2, n3=1)  # other users hold 5 of 8 GPUs: 3 free (n3:1, n4:2)
    set_target(run_dir, 4)
    sc = make()
    res = sc.reconcile_once()
    assert res.free_slots == 3 and len(res.submitted) == 3
    clock.t += 5
    # pending jobs already claim the free slots: nothing more is submitted while they wait
    assert sc.reconcile_once().submitted == []
    fake.schedule()
    clock.t += 5
    res = sc.reconcile_once()  # our running jobs count as placed; no free GPU left → nothing new, no cancel
    assert res.submitted == [] and res.cancelled == [] and res.signalled == [] and res.running == 3
    fake.external["n1"] = 0  # capacity frees up: the 4th job goes in
    clock.t += 5
    assert len(sc.reconcile_once().submitted) == 1


def test_capacity_view_and_the_runs_instance_size_reach_the_trainer_and_sbatch(env):
    """Issue 13: the trainer clamps N_prem to what the scavenger sees (live jobs + idle slots, capacity.json), and
    the run's rollout.gpus_per_instance (target.json) is what jobs ask for, not the daemon's own default."""
    from rlboost_hpc.cluster.capacity import available_from_scavenger
    from rlboost_hpc.rundir import RunDir

    clock, fake, run_dir, make = env
    fake.external.update(n1=2, n2=1)  # 5 of 8 GPUs free: n2 1, n3 2, n4 2
    RunDir(run_dir).write_target(1, active=True, step=0, gpus_per_instance=2)
    sc = make()
    res = sc.reconcile_once()
    assert len(res.submitted) == 1 and "--gres=gpu:2" in fake.calls[-1][2]
    view = RunDir(run_dir).read_capacity()
    assert (view.live_jobs, view.idle_slots, view.gpus_per_instance, view.ts) == (0, 2, 2, clock.t)
    fake.schedule()
    clock.t += 5
    sc.reconcile_once()
    assert (RunDir(run_dir).read_capacity().live_jobs, RunDir(run_dir).read_capacity().idle_slots) == (1, 1)
    assert available_from_scavenger(run_dir, now=clock.t) == 2
    assert available_from_scavenger(run_dir, now=clock.t + 1000) is None  # a dead scavenger's view is stale


def test_unknown_states_occupy_capacity_and_held_jobs_are_cancelled_at_run_end(env, caplog):
    """Issue 13: a job in a state the daemon does not know was ignored (so the daemon submitted another); a held
    job of the run outlived it."""
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    a, b = sc.reconcile_once().submitted
    fake.jobs[a]["state"] = "FROBNICATING"  # a state from a future Slurm
    fake.jobs[b]["reason"] = "JobHeldUser"
    clock.t += 5
    with caplog.at_level(logging.WARNING, logger="scavenger"):
        res = sc.reconcile_once()
    assert res.submitted == [] and res.live == 2 and res.held == 1, res
    assert sc.unknown_states_total == 1 and "FROBNICATING" in caplog.text
    set_target(run_dir, 0, active=False)
    clock.t += 5
    res = sc.reconcile_once()
    assert sorted(res.cancelled) == sorted([a, b])


def test_reconcile_log_records_each_changed_view(env):
    from scavenger.stats import read_reconcile_log

    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    sc.run_forever(poll_s=5, max_cycles=3)  # submit 2; unchanged; unchanged
    set_target(run_dir, 1)
    sc.run_forever(poll_s=5, max_cycles=1)  # one is told to leave (pending: cancelled)
    views = read_reconcile_log(run_dir)
    assert [(v["target"], v["live"]) for v in views] == [(2, 0), (2, 2), (1, 2)], views
    assert all(v["idle_slots"] is not None for v in views)


def test_capacity_counts_whole_jobs_per_node(env):
    clock, fake, run_dir, make = env
    fake.external.update(n1=1, n2=1, n3=1, n4=2)  # 3 free GPUs, but never 2 on one node
    set_target(run_dir, 4)
    res = make(ScavengerConfig(max_jobs=4, gpus_per_job=2)).reconcile_once()
    assert res.free_slots == 0 and res.submitted == []
    fake.external["n2"] = 0
    res = make(ScavengerConfig(max_jobs=4, gpus_per_job=2)).reconcile_once()
    assert res.free_slots == 1 and len(res.submitted) == 1
    assert any("--gres=gpu:2" in a for a in fake.our_calls("sbatch")[0][2])


def test_no_duplicates_after_daemon_restart(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 3)
    first = make()
    assert len(first.reconcile_once().submitted) == 3
    fake.schedule()
    clock.t += 5
    first.reconcile_once()
    del first  # the daemon dies
    clock.t += 30
    second = make()  # a new instance sees the tagged jobs already queued
    res = second.reconcile_once()
    assert res.ok and res.submitted == [] and res.live == 3
    assert len(fake.our_calls("sbatch")) == 3
    # and it does not log the same life-cycle twice
    assert len(events_of(run_dir, "submitted")) == 3
    assert len(events_of(run_dir, "started")) == 3
    assert events_of(run_dir, "adopted") == []


def test_restart_without_event_log_adopts_instead_of_resubmitting(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    make().reconcile_once()
    (run_dir / "events.jsonl").unlink()  # e.g. the event write was lost with the old daemon
    res = make().reconcile_once()
    assert res.submitted == [] and len(events_of(run_dir, "adopted")) == 2


def test_jobs_of_other_runs_are_ignored(env):
    clock, fake, run_dir, make = env
    fake.jobs["7"] = {"name": "rlboost-rollout-other", "comment": "rlboost:other", "state": "RUNNING",
                      "restart_cnt": 0, "submit_time": 0.0, "gpus": 1, "node": "n1", "start_time": 1.0}
    set_target(run_dir, 0)
    res = make().reconcile_once()
    assert res.live == 0 and fake.our_calls("scancel") == []


def test_cancel_surplus_order(env):
    clock, fake, run_dir, make = env
    sc = make()

    def job(jid: str, state: str, submit: float, start: float | None = None) -> None:
        fake.jobs[jid] = {"name": sc.job_name, "comment": sc.tag, "state": state, "restart_cnt": 0,
                          "submit_time": submit, "gpus": 1, "start_time": start,
                          "node": "n1" if state == "RUNNING" else None}

    t0 = clock.t
    job("100", "RUNNING", t0 - 100, t0 - 90)
    job("101", "RUNNING", t0 - 100, t0 - 50)  # the newest running
    job("102", "PENDING", t0 - 40)
    job("103", "PENDING", t0 - 30)  # the newest pending
    set_target(run_dir, 1)
    res = sc.reconcile_once()
    scancels = fake.our_calls("scancel")
    # newest pending first, then the newest running with the warning signal on its batch shell
    assert scancels[0] == ("scancel", ["103", "102"], None, False)
    assert scancels[1] == ("scancel", ["101"], "USR2", True)
    assert res.cancelled == ["103", "102"] and res.signalled == ["101"]
    assert drain_marker_path(run_dir, "101").exists() and not drain_marker_path(run_dir, "100").exists()
    assert fake.jobs["100"]["state"] == "RUNNING" and fake.signals == {"101": ["USR2"]}
    # a drained job that requeues itself anyway is cancelled at once, and its requeue is not a preemption
    fake.preempt("101")
    clock.t += 5
    res = sc.reconcile_once()
    assert res.cancelled == ["101"] and res.submitted == []
    req = events_of(run_dir, "requeued")
    assert req and req[-1]["cause"] == "drain"
    st = compute_stats(read_events(run_dir), now=clock.t)
    assert st.requeues == 1 and st.preemptions == 0 and st.drains == 1


def test_drained_job_is_killed_after_the_grace(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    sc.reconcile_once()
    fake.schedule()
    set_target(run_dir, 1)
    clock.t += 5
    [victim] = sc.reconcile_once().signalled
    clock.t += 14
    assert sc.reconcile_once().cancelled == []
    # a restarted daemon remembers the drain request (from the event log) and keeps the deadline
    clock.t += 2
    res = make().reconcile_once()
    assert res.cancelled == [victim] and res.signalled == [] and len(live_ids(fake)) == 1


def test_inactive_cancels_everything_at_once(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 3)
    sc = make()
    sc.reconcile_once()
    fake.schedule()
    fake.jobs["102"].update(state="PENDING", node=None)
    clock.t += 5
    set_target(run_dir, 3, active=False)
    res = sc.reconcile_once()
    assert res.desired == 0 and sorted(res.cancelled) == ["100", "101", "102"] and res.signalled == []
    assert live_ids(fake) == []
    cancelled = events_of(run_dir, "cancelled")
    assert {e["reason"] for e in cancelled} == {"run_inactive"}
    clock.t += 5
    res = sc.reconcile_once()
    assert res.submitted == [] and res.cancelled == [] and res.live == 0
    assert {e["job_id"] for e in events_of(run_dir, "finished")} == {"100", "101", "102"}
    # --exit-when-done: the loop ends once nothing is live
    assert sc.run_forever(max_cycles=10, exit_when_done=True) == 0
    assert clock.sleeps == []


def test_event_log_records_requeue_when_restart_cnt_increases(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 1)
    sc = make()
    [jid] = sc.reconcile_once().submitted
    fake.schedule()
    clock.t += 5
    sc.reconcile_once()
    clock.t += 60
    fake.preempt(jid)  # a high-priority job took the node; Slurm requeued ours
    sc.reconcile_once()
    clock.t += 5
    fake.schedule()
    sc.reconcile_once()
    clock.t += 100
    fake.finish(jid, "COMPLETED")
    sc.reconcile_once()
    evs = [e for e in read_events(run_dir) if e.get("job_id") == jid]
    assert [(e["event"], e["restart_cnt"]) for e in evs] == [
        ("submitted", 0), ("started", 0), ("requeued", 1), ("started", 1), ("finished", 1)]
    req = evs[2]
    assert req["cause"] == "preempted_or_requeued" and req["reason"] == "BeginTime"
    assert evs[1]["node"] and evs[1]["gpus"] == 1
    assert all(isinstance(e["ts"], float) and e["source"] == "scavenger" for e in evs)
    st = compute_stats(read_events(run_dir), now=clock.t)
    js = st.per_job[jid]
    assert (js.attempts, js.requeues, js.preemptions, js.final_state) == (2, 1, 1, "COMPLETED")
    assert st.jobs == 2  # the finished job was replaced in the same step (target 1)
    # a second requeue that happens while the daemon is away is still counted, once per restart
    fake.jobs[jid].update(state="PENDING", restart_cnt=3)
    clock.t += 5
    make().reconcile_once()
    assert [e["restart_cnt"] for e in events_of(run_dir, "requeued")] == [1, 2, 3]


def test_command_failures_back_off_and_recover(env, caplog):
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    fake.fail_next("squeue_jobs", times=3)
    with caplog.at_level(logging.WARNING, logger="scavenger"):
        sc.run_forever(poll_s=5, max_cycles=5)
    assert clock.sleeps == [10, 20, 40, 5]  # poll·2^k while failing, back to the poll interval after
    fails = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(fails) == 3 and "slurmctld" in fails[0].getMessage()
    assert len(fake.our_calls("sbatch")) == 2 and len(live_ids(fake)) == 2


def test_backoff_is_capped(env):
    clock, fake, run_dir, make = env
    sc = make()
    fake.fail_next("squeue_jobs", times=8)
    sc.run_forever(poll_s=5, max_cycles=8)
    assert max(clock.sleeps) == 60


def test_sbatch_failure_mid_batch_then_no_duplicates(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 3)
    sc = make()
    real_sbatch, calls = fake.sbatch, {"n": 0}

    def flaky(script, args=(), env=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise SlurmCommandError(["sbatch"], 1, "sbatch: error: Socket timed out on send/recv operation", False)
        return real_sbatch(script, args, env)

    fake.sbatch = flaky  # type: ignore[method-assign]
    res = sc.reconcile_once()
    assert not res.ok and len(res.submitted) == 1 and "slurmctld" in res.error
    clock.t += 10
    res = sc.reconcile_once()
    assert res.ok and len(res.submitted) == 2 and len(live_ids(fake)) == 3


def test_sbatch_that_timed_out_after_creating_the_job_is_adopted_not_duplicated(env):
    """sbatch's reply was lost (timeout) but slurmctld created the job: the next listing finds it by its comment
    tag and adopts it; the target is met without a second submission."""
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    real_sbatch, calls = fake.sbatch, {"n": 0}

    def created_then_timed_out(script, args=(), env=None):
        calls["n"] += 1
        jid = real_sbatch(script, args, env)
        if calls["n"] == 1:
            raise SlurmCommandError(["sbatch"], None, "", True)
        return jid

    fake.sbatch = created_then_timed_out  # type: ignore[method-assign]
    assert not sc.reconcile_once().ok
    clock.t += 10
    res = sc.reconcile_once()
    assert res.ok and len(res.submitted) == 1 and len(live_ids(fake)) == 2
    assert len(events_of(run_dir, "adopted")) == 1 and calls["n"] == 2


def test_sinfo_failure_blocks_submission_only(env):
    clock, fake, run_dir, make = env
    sc = make()
    fake.fail_next("sinfo_nodes")
    res = sc.reconcile_once()
    assert not res.ok and res.submitted == [] and fake.our_calls("sbatch") == []


def test_scancel_failure_is_retried(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    sc.reconcile_once()
    set_target(run_dir, 0)
    fake.fail_next("scancel")
    clock.t += 5
    assert not sc.reconcile_once().ok
    clock.t += 10
    res = sc.reconcile_once()
    assert res.ok and sorted(res.cancelled) == ["100", "101"]


def test_quickly_failing_jobs_pause_submissions(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 1)
    sc = make()
    [jid] = sc.reconcile_once().submitted
    fake.schedule()
    clock.t += 2
    fake.finish(jid, "FAILED", exit_code=1)
    res = sc.reconcile_once()
    assert res.submitted == [] and res.submit_paused_until == pytest.approx(clock.t + 30)
    clock.t += 31
    [jid2] = sc.reconcile_once().submitted
    fake.schedule()
    clock.t += 2
    fake.finish(jid2, "FAILED", exit_code=1)
    res = sc.reconcile_once()
    assert res.submit_paused_until == pytest.approx(clock.t + 60)  # doubled, capped at max_backoff_s


def test_a_drained_job_that_ends_failed_does_not_pause_submissions(env):
    """Regression: jobs the scavenger asked to drain ended FAILED (exit 140, the batch shell's status when the
    warning interrupted its wait) and counted as quick failures: submissions paused 30 s, then 60 s."""
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    sc.reconcile_once()
    fake.schedule()
    clock.t += 2
    set_target(run_dir, 1)
    [victim] = sc.reconcile_once().signalled
    clock.t += 1
    fake.finish(victim, "FAILED", exit_code=140)
    res = sc.reconcile_once()
    assert res.submit_paused_until is None or res.submit_paused_until <= clock.t
    set_target(run_dir, 2)
    clock.t += 1
    assert len(sc.reconcile_once().submitted) == 1  # at once, no back-off


def test_a_job_killed_by_the_warning_signal_does_not_pause_submissions(env):
    """Regression: a rollout job preempted 1 s after it started died of USR2 before its batch shell trapped it
    (FAILED, exit 140) and counted as a quick failure: submissions paused 30 s while the target asked for more
    (the Slurm control-loop test). Any other quick failure still pauses."""
    clock, fake, run_dir, make = env
    set_target(run_dir, 1)
    sc = make()
    [jid] = sc.reconcile_once().submitted
    fake.schedule()
    clock.t += 1
    fake.finish(jid, "FAILED", exit_code=128 + 12)  # SIGUSR2, the configured warning signal
    res = sc.reconcile_once()
    assert res.submit_paused_until is None or res.submit_paused_until <= clock.t
    assert len(res.submitted) == 1  # replaced at once
    fake.schedule()
    clock.t += 1
    fake.finish(res.submitted[0], "FAILED", exit_code=128 + 9)  # SIGKILL: not a warning
    assert sc.reconcile_once().submit_paused_until == pytest.approx(clock.t + 30)


def test_malformed_target_keeps_last_good(env, caplog):
    clock, fake, run_dir, make = env
    sc = make()
    (run_dir / "target.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="scavenger"):
        res = sc.reconcile_once()
    assert res.target is None and res.submitted == [] and "not JSON" in caplog.text
    set_target(run_dir, 1)
    sc.reconcile_once()
    (run_dir / "target.json").write_text('{"n_prem": -1}')
    clock.t += 5
    res = sc.reconcile_once()
    assert res.target == Target(1, True, "last_good") and res.ok


def test_read_target_shapes(tmp_path):
    assert read_target(tmp_path, 3) == Target(3, True, "default")
    (tmp_path / "target.json").write_text('{"n_prem": 2, "active": false, "step": 9}')
    assert read_target(tmp_path, 3) == Target(2, False, "file")
    for bad, says in (('[]', "object"), ('{"n_prem": true}', "n_prem"), ('{"n_prem": 1, "active": "no"}', "active"),
                      ('{"active": true}', "n_prem"), ('{"n_prem": -1}', "n_prem"), ('{"n_prem": 1', "not JSON"),
                      ('{"n_prem": 1, "gpus_per_instance": -2}', "gpus_per_instance")):
        (tmp_path / "target.json").write_text(bad)
        with pytest.raises(RunDirError, match=f"target.json: .*{says}"):
            read_target(tmp_path, 3)


def test_capacity_file_round_trips_and_a_malformed_one_names_its_field(tmp_path):
    from rlboost_hpc.rundir import CapacityView, RunDir

    rd = RunDir(tmp_path)
    assert rd.read_capacity() is None
    view = CapacityView(live_jobs=3, idle_slots=1, gpus_per_instance=2, ts=5.0)
    rd.write_capacity(view)
    assert rd.read_capacity() == view
    for bad, says in (('{"live_jobs": -1, "idle_slots": 0, "gpus_per_instance": 1, "ts": 1}', "live_jobs"),
                      ('{"live_jobs": 1, "gpus_per_instance": 1, "ts": 1}', "idle_slots"), ("", "not JSON")):
        (tmp_path / "capacity.json").write_text(bad)
        with pytest.raises(RunDirError, match=f"capacity.json: .*{says}"):
            rd.read_capacity()


def test_vanished_job_is_logged_finished_after_two_listings(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 1)
    sc = make()
    [jid] = sc.reconcile_once().submitted
    del fake.jobs[jid]  # slurmctld lost it (cold start) or it aged out
    set_target(run_dir, 0)
    sc.reconcile_once()
    assert events_of(run_dir, "finished") == []
    sc.reconcile_once()
    [fin] = events_of(run_dir, "finished")
    assert fin["job_id"] == jid and fin["state"] == "UNKNOWN" and fin["vanished"] is True


def test_sbatch_command_line(env):
    clock, fake, run_dir, make = env
    cfg = ScavengerConfig(partition="scav", qos="low", account="rl", gpus_per_job=2, time_limit="2:00:00",
                          grace_s=30, max_jobs=1, extra_sbatch_args=["--mem=8G"])
    set_target(run_dir, 1)
    assert make(cfg).reconcile_once().free_slots == 0  # no node in partition "scav": nothing submitted
    fake.partition = "scav"
    make(cfg).reconcile_once()
    [(_, script, args)] = fake.our_calls("sbatch")
    assert script.endswith("rollout.sbatch")
    rid = cfg.resolved_run_id(run_dir)  # the run's own id (the trainer's): the directory's name
    assert rid == run_dir.resolve().name
    tag = cfg.resolved_tag(run_dir)  # + a hash of its path: same-named runs never adopt each other's jobs
    assert tag.startswith(f"rlboost:{rid}@") and len(tag) == len(f"rlboost:{rid}@") + 8
    for want in ("--partition=scav", "--qos=low", "--account=rl", "--gres=gpu:2", "--time=2:00:00",
                 "--requeue", "--signal=B:USR2@30", f"--comment={tag}", f"--job-name=rlboost-rollout-{rid}",
                 "--mem=8G", "--open-mode=append"):
        assert want in args
    export = next(a for a in args if a.startswith("--export="))
    assert export == f"--export=ALL,RLBOOST_RUN_DIR={run_dir.resolve()},RLBOOST_RUN_ID={rid}"
    assert (run_dir / "scavenger" / "logs").is_dir()  # sbatch would not create the --output directory


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="NCCL"):
        ScavengerConfig(signal="SIGUSR1")
    assert ScavengerConfig(signal="sigusr2").signal == "USR2"
    assert "--no-requeue" in ScavengerConfig(requeue=False, gpus_per_job=0).sbatch_args(tmp_path)
    assert not any(a.startswith("--gres") for a in ScavengerConfig(gpus_per_job=0).sbatch_args(tmp_path))
    with pytest.raises(ValueError):
        ScavengerConfig(time_limit="1 hour")
    with pytest.raises(ScavengerConfigError, match="unknown_knob"):
        load_scavenger_config(None, unknown_knob=1)
    toml = tmp_path / "s.toml"
    toml.write_text('[scavenger]\npartition = "p2"\nmax_jobs = 7\n')
    cfg = load_scavenger_config(toml, max_jobs=3)
    assert (cfg.partition, cfg.max_jobs) == ("p2", 3)
    with pytest.raises(ScavengerConfigError, match="not found"):
        ScavengerConfig(script=str(tmp_path / "nope.sbatch")).resolved_script()
    comma = tmp_path / "a,b"
    with pytest.raises(ScavengerConfigError, match="comma"):
        ScavengerConfig().sbatch_args(comma)


def test_cpu_only_jobs_use_free_cpus(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 20)
    res = make(ScavengerConfig(max_jobs=20, gpus_per_job=0, cpus_per_job=2)).reconcile_once()
    assert res.free_slots == 8 and len(res.submitted) == 8  # 4 nodes × 4 CPUs / 2


def test_events_from_rollout_jobs_share_the_log(env):
    clock, fake, run_dir, make = env
    set_target(run_dir, 1)
    sc = make()
    [jid] = sc.reconcile_once().submitted
    append_event(run_dir, {"event": "tokens", "job_id": jid, "attempt": 0, "produced": 10, "handed_off": 3})
    append_event(run_dir, {"event": "started", "job_id": jid, "attempt": 0, "gpus": "0"})  # the worker's own
    clock.t += 5
    res = make().reconcile_once()  # a restarted daemon replays only its own events
    assert res.ok and res.submitted == [] and events_of(run_dir, "adopted") == []
    st = compute_stats(read_events(run_dir), now=clock.t)
    assert st.attempts == 0 and st.tokens_produced == 10


def test_missing_script_is_a_step_error_not_a_crash(env, tmp_path):
    clock, fake, run_dir, make = env
    sc = Scavenger(ScavengerConfig(script=str(tmp_path / "gone.sbatch")), run_dir, slurm=fake, clock=clock)
    set_target(run_dir, 2)
    res = sc.reconcile_once()
    assert not res.ok and "not found" in res.error and fake.our_calls("sbatch") == []


def test_s3_job_that_exits_during_grace_is_replaced(env):
    """Case S3: a scavenger job that exits by itself during the grace time is COMPLETED, not requeued —
    the daemon brings the capacity back by submitting a replacement as soon as there is room."""
    clock, fake, run_dir, make = env
    set_target(run_dir, 2)
    sc = make()
    first = sc.reconcile_once().submitted
    fake.schedule()
    clock.t += 5
    sc.reconcile_once()
    fake.finish(first[0], "COMPLETED")  # handed off and exited instead of `scontrol requeue`
    fake.external["n1"] = 2  # the high-priority job now holds that node
    clock.t += 5
    res = sc.reconcile_once()
    assert len(res.submitted) == 1 and res.live == 1
    assert fake.jobs[res.submitted[0]]["state"] == "PENDING"
    fake.schedule()
    assert fake.jobs[res.submitted[0]]["node"] != "n1"


def two_jobs_for_an_hour_then_a_preemption(sc: Scavenger, fake: FakeSlurm, clock: FakeClock, run_dir: Path) -> None:
    """The harvest the statistics tests check, one reconciliation after each stage: the run asks for 2 jobs (step 3);
    both run for an hour; one is preempted, its worker having produced 1,000,000 tokens."""
    set_target(run_dir, 2)
    sc.run_forever(max_cycles=1)
    fake.schedule()
    clock.t += 3600
    sc.run_forever(max_cycles=1)
    jid = live_ids(fake)[0]
    fake.preempt(jid)
    clock.t += 60
    append_event(run_dir, {"event": "tokens", "source": "worker", "job_id": jid, "attempt": 0, "produced": 1_000_000})
    sc.run_forever(max_cycles=1)


def test_metrics_endpoint_serves_capacity_preemptions_and_cost(env):
    """Issue 7 §5: the scavenger's Prometheus endpoint (real HTTP) shows its jobs by state, the target, preemptions
    and requeues, harvested GPU-hours and the cost per token at the configured prices."""
    import urllib.request

    clock, fake, run_dir, make = env
    sc = make(ScavengerConfig(max_jobs=4, grace_s=15, poll_s=5, metrics_port=0, spot_price_per_gpu_hour=2.0,
                              on_demand_price_per_gpu_hour=10.0))
    url = sc.start_metrics()
    assert json.loads((run_dir / "scavenger-metrics.json").read_text())["url"] == url
    two_jobs_for_an_hour_then_a_preemption(sc, fake, clock, run_dir)
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()) if k != "run")
            got[smp.name + (f"{{{extra}}}" if extra else "")] = smp.value
    assert got["rlboost_scavenger_jobs{state=pending}"] + got["rlboost_scavenger_jobs{state=running}"] == 2
    assert got["rlboost_scavenger_target_jobs"] == 2
    assert got["rlboost_scavenger_submitted_total"] == 2 and got["rlboost_scavenger_reconciliations_total"] == 3
    assert got["rlboost_scavenger_preemptions_total"] == 1 and got["rlboost_scavenger_requeues_total"] == 1
    hours = got["rlboost_scavenger_harvested_gpu_seconds_total"] / 3600
    assert 2.0 <= hours <= 2.1  # two 1-GPU jobs for ~1 h each
    assert got["rlboost_scavenger_tokens_produced_total"] == 1_000_000
    assert got["rlboost_scavenger_cost_per_token_dollars"] * 1e6 == pytest.approx(hours * 2.0)
    assert got["rlboost_scavenger_saving_vs_on_demand_dollars_total"] == pytest.approx(hours * 8.0)


def test_the_warning_signal_is_read_in_one_place_and_checked_at_load():
    """The config's ``signal`` and every Slurm client's ``scancel(signal=...)`` resolve names the same way; a name
    that is no signal is a config error (exit 2 in the CLI), not a KeyError when the first job finishes."""
    import signal

    from scavenger.config import ScavengerConfig
    from scavenger.slurm_records import signal_number

    assert signal_number("USR2") == signal_number("sigusr2") == signal_number(str(int(signal.SIGUSR2))) \
        == int(signal.SIGUSR2)
    assert ScavengerConfig(signal="sigterm").signal == "TERM"
    for bad in ("NOPE", "999"):
        with pytest.raises(ValueError, match="not a signal"):
            ScavengerConfig(signal=bad)
