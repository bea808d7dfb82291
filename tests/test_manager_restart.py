"""Issue 33: the rollout manager's work log and a restarted manager continuing the step in flight (pure logic:
the core with an injected clock, the log on a temporary file; the real restart is in test_rollout_integration)."""
from __future__ import annotations

import random
import time

import pytest

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.restore import restore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.manager.state import RequestState
from rlboost_hpc.protocol import messages as M
from test_manager_core import TRAINER, Clock, register, sent, submit, tokens


LOADED = M.WeightsLoaded(version=0, checksum=77, nbytes=1, pull_s=0.0, load_s=0.0)


def journaled(tmp_path, epoch=1, keep=False):
    """A core journaling into a work log at tmp_path (its service's part done by :func:`commit`)."""
    clock = Clock()
    core = ManagerCore(clock=clock, epoch=epoch, settings=ManagerSettings(pending_limit=4, heartbeat_s=0.25,
                                                                         heartbeat_timeout_s=2.0))
    log = W.WorkLog(tmp_path / "work.log", "run", epoch, keep=keep)
    core.worklog = []
    return core, clock, log


def feed(core, peer, msg):
    """What the manager's service does with a frame: a Tokens frame is journaled whole, then the core applies it and
    the record learns which deltas it did not apply."""
    rec = None
    if core.worklog is not None and isinstance(msg, M.Tokens):
        core.log_work(rec := W.Frame(peer, M.encode(msg)))
    core.on_message(peer, msg)
    if rec is not None:
        rec.dropped = core.dropped


def commit(core, log):
    log.write(core.worklog, 0.0)
    core.worklog.clear()
    log.commit(core.counters)


def started(tmp_path):
    core, clock, log = journaled(tmp_path)
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={"a": 1}))
    feed(core, TRAINER, M.SetVersion(version=0, checksum=77))
    for peer in (b"a", b"b"):
        register(core, peer, peer.decode(), version=None)
        feed(core, peer, LOADED)
    submit(core, groups=2, n=2, max_new=8)
    core.tick()
    return core, clock, log


def restarted(tmp_path, epoch=2):
    clock = Clock()
    core = ManagerCore(clock=clock, epoch=epoch, settings=ManagerSettings(pending_limit=4, heartbeat_s=0.25,
                                                                         heartbeat_timeout_s=2.0))
    log = W.WorkLog(tmp_path / "work.log", "run", epoch, keep=True)
    restore(core, log.restored, clock())
    core.worklog = []
    return core, clock, log


def owner(core, rid):
    return core.book.requests[rid].instance


def test_a_restarted_manager_rebuilds_the_step_and_the_instance_continues_at_the_logged_length(tmp_path):
    core, clock, log = started(tmp_path)
    a = owner(core, "s0g0/0")
    peer = core.fleet.instances[a].peer
    feed(core, peer, tokens("s0g0/0", 0, [4, 5, 6]))
    commit(core, log)
    feed(core, peer, tokens("s0g0/0", 3, [7]))  # accepted, but not committed: lost with the kill
    log.close()

    new, clock2, log2 = restarted(tmp_path)
    assert new.trainer_peer == TRAINER and new.lineage.latest.number == 0 and new.lineage.latest.checksum == 77
    assert new.step == 0 and len(new.book.requests) == 4 and new.book.requests["s0g0/0"].n == 3
    assert set(new.fleet.instances) == {"a#0", "b#0"}
    assert all(i.state == "pulling" for i in new.fleet.values())
    assert set(new.held) == set(new.book.requests) and not new.book.queue and new.counters.manager_restarts == 1
    # the instance's next delta (it had sent token 7 into the void) is past the gap: dropped, nothing released
    feed(new, peer, tokens("s0g0/0", 4, [8]))
    assert not sent(new, peer, M.Release) and new.book.requests["s0g0/0"].n == 3 and "s0g0/0" in new.held
    # its resend (asked in the Welcome of its re-registration) overlaps the log: the rest is kept
    feed(new, peer, M.Register(job_id="a", attempt=0, kind="preemptible", max_batch=32))
    welcome = sent(new, peer, M.Welcome)[-1]
    assert welcome.resend and welcome.epoch == 2 and welcome.latest_checksum == 77
    feed(new, peer, tokens("s0g0/0", 0, [4, 5, 6, 7, 8]))
    req = new.book.requests["s0g0/0"]
    assert req.state == "running" and req.instance == a and req.n == 5 and M.unpack_i32(bytes(req.ids)).tolist() == [
        4, 5, 6, 7, 8]
    # a resend that disagrees with the log is refused and released
    rid = next(r for r in new.book.requests if r != "s0g0/0" and owner(core, r) == a)
    other = next(r for r in new.book.requests if owner(core, r) != a)
    new.book.requests[other].append(M.pack_i32([3]), M.pack_f32([0.0]), 1, 0)  # (as if the log held a token)
    feed(new, peer, tokens(other, 0, [9, 9]))
    assert [m.rids for m in sent(new, peer, M.Release)] == [[other]] and new.book.requests[other].state == "queued"
    # another held response continued exactly where the log ends: adopted, tokens kept
    feed(new, peer, tokens(rid, 0, [9, 9]))
    req = new.book.requests[rid]
    assert req.state == "running" and req.instance == a and req.n == 2
    assert new.counters.responses_adopted == 2
    # the held rest is queued once the hold ends (2 s), and dispatched when an instance confirms the version
    feed(new, peer, LOADED)
    assert new.fleet.instances[a].state == "ready"
    clock2.t = 2.5
    feed(new, peer, M.Heartbeat(version=0, active=1, tokens_generated=0))
    new.tick()
    works = {w.rid: w for m in sent(new, peer, M.Assign) for w in m.works}
    assert works[other].prefix_ids == [3]  # not adopted: resumes from the log
    assert rid not in works and "s0g0/0" not in works  # adopted: they run on


def test_finished_responses_turns_and_acks_survive_and_the_step_completes_exactly_once(tmp_path):
    core, clock, log = started(tmp_path)
    for rid in ("s0g0/0", "s0g0/1"):
        feed(core, core.fleet.instances[owner(core, rid)].peer, tokens(rid, 0, [4, 1], finish=M.FINISH_STOP))
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    feed(core, TRAINER, M.CloseSeeding(step=0))
    commit(core, log)
    log.close()
    new, clock2, _ = restarted(tmp_path)
    assert new.book.groups["s0g0"].delivered and new.book.groups["s0g0"].done == 2 and not new.seeding_open
    assert sorted(new.held) == ["s0g1/0", "s0g1/1"]
    # the trainer's resent calls are answered as already done
    feed(new, TRAINER, M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(
        gid=f"s0g{g}", prompt_ids=[1, 5, 6], n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=10 * g,
        stop_ids=[1, 2]) for g in range(2)], cid=5))
    assert sent(new, TRAINER, M.Ok)[-1].cid == 5
    register(new, b"c", "c", version=None)
    feed(new, b"c", LOADED)
    clock2.t = 3.0
    feed(new, b"c", M.Heartbeat(version=0, active=0, tokens_generated=0))
    new.tick()
    for rid in ("s0g1/0", "s0g1/1"):
        feed(new, b"c", tokens(rid, 0, [3, 1], finish=M.FINISH_STOP))
    done = sent(new, TRAINER, M.GroupDone)
    assert [g.gid for g in done] == ["s0g1"]  # the acknowledged group is not delivered again
    feed(new, TRAINER, M.Redeliver())
    assert [g.gid for g in sent(new, TRAINER, M.GroupDone)] == ["s0g1", "s0g1"]


def test_a_resumed_trainer_of_another_version_drops_the_restored_work_and_counts_it(tmp_path):
    core, clock, log = started(tmp_path)
    feed(core, core.fleet.instances[owner(core, "s0g0/0")].peer, tokens("s0g0/0", 0, [4, 5]))
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    feed(new, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w2", model_config={}))
    feed(new, b"trainer-2", M.SetVersion(version=0, checksum=77, cid=3))  # the checkpoint of version 0 again
    assert sent(new, b"trainer-2", M.Ok)[-1].cid == 3 and len(new.book.requests) == 4  # same version: kept
    new1, _, _ = restarted(tmp_path, epoch=3)
    feed(new1, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w2", model_config={}))
    feed(new1, b"trainer-2", M.SetVersion(version=0, checksum=78, cid=3))  # version 0 made by other weights
    assert sent(new1, b"trainer-2", M.Ok)[-1].cid == 3 and not new1.book.requests  # (issue 50) not the same version
    assert new1.counters.responses_discarded_stale == 4
    new2, _, _ = restarted(tmp_path, epoch=4)
    feed(new2, b"trainer-3", M.TrainerHello(weights_endpoint="tcp://w3", model_config={}))
    feed(new2, b"trainer-3", M.SetVersion(version=1, checksum=9, cid=4))
    assert sent(new2, b"trainer-3", M.Ok)[-1].cid == 4 and not new2.book.requests and not new2.held
    assert new2.counters.responses_discarded_stale == 4 and new2.counters.tokens_discarded_stale == 2


def test_a_resumed_trainer_gets_every_group_of_the_restored_step_again(tmp_path):
    core, clock, log = started(tmp_path)
    for rid in ("s0g0/0", "s0g0/1"):
        feed(core, core.fleet.instances[owner(core, rid)].peer, tokens(rid, 0, [4, 1], finish=M.FINISH_STOP))
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    feed(new, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(new, b"trainer-2", M.Redeliver())
    assert [g.gid for g in sent(new, b"trainer-2", M.GroupDone)] == ["s0g0"]


def test_a_manager_restarted_after_a_trainer_resumed_still_owes_it_the_groups_the_old_trainer_took(tmp_path):
    """Regression (the long chaos run, step 26): a trainer killed after acknowledging its step's groups resumes; the
    manager owes the new trainer those groups — and still does after a manager restart, which replays the old
    trainer's acknowledgements and must replay the new trainer's hello as it was applied (not as a bare address)."""
    core, clock, log = started(tmp_path)
    for rid in sorted(core.book.requests):
        feed(core, core.fleet.instances[owner(core, rid)].peer, tokens(rid, 0, [4, 1], finish=M.FINISH_STOP))
    for gid in ("s0g0", "s0g1"):
        feed(core, TRAINER, M.AckGroup(gid=gid))
    feed(core, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, b"trainer-2", M.SetVersion(version=0, checksum=77, cid=1))  # the checkpoint's version: kept
    feed(core, b"trainer-2", M.AckGroup(gid="s0g1"))  # it took one before the manager died
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    feed(new, b"trainer-2", M.Redeliver())
    assert [g.gid for g in sent(new, b"trainer-2", M.GroupDone)] == ["s0g0"]


def test_a_manager_restarted_after_a_resumed_trainer_changed_the_version_does_not_bring_the_old_work_back(tmp_path):
    core, clock, log = started(tmp_path)
    feed(core, core.fleet.instances[owner(core, "s0g0/0")].peer, tokens("s0g0/0", 0, [4, 5]))
    feed(core, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, b"trainer-2", M.SetVersion(version=3, checksum=9, cid=1))
    assert not core.book.requests
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    assert not new.book.requests and new.lineage.latest.number == 3 and new.trainer_peer == b"trainer-2"


def test_deltas_the_manager_refused_are_not_replayed(tmp_path):
    """Regression (the long chaos run, step 9): frames of a peer the manager did not know (a resumed trainer's
    reserved engine before it registered with this manager) and late deltas of an instance that no longer owned the
    response were journaled whole and replayed after the next restart as if accepted — a response then held its
    whole budget without being finished, and every instance failed it (max_new_tokens = 0) until the step failed."""
    core, clock, log = started(tmp_path)
    rid = "s0g0/0"
    other = next(i for i in core.fleet.instances.values() if i.key != owner(core, rid))
    feed(core, b"stranger", tokens(rid, 0, [4] * 8, finish=M.FINISH_LENGTH))  # unknown peer: dropped
    feed(core, other.peer, tokens(rid, 0, [6] * 8, finish=M.FINISH_LENGTH))  # not its owner: late
    feed(core, core.fleet.instances[owner(core, rid)].peer, tokens(rid, 0, [5, 5]))  # accepted
    assert core.book.requests[rid].n == 2 and core.book.requests[rid].state == "running"
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    req = new.book.requests[rid]
    assert req.n == 2 and bytes(req.ids) == M.pack_i32([5, 5]) and req.state == "queued"


def test_an_adopted_resend_is_replayed_past_what_the_log_held(tmp_path):
    core, clock, log = started(tmp_path)
    rid = "s0g0/0"
    peer = core.fleet.instances[owner(core, rid)].peer
    feed(core, peer, tokens(rid, 0, [5, 5]))
    commit(core, log)
    log.close()
    new, clock, log = restarted(tmp_path)
    inst = next(i for i in new.fleet.instances.values() if i.peer == peer)
    feed(new, peer, M.Register(job_id=inst.key.split("#")[0], attempt=int(inst.key.split("#")[1]),
                               kind="preemptible", max_batch=32, engine="torch"))
    resend = tokens(rid, 0, [5, 5, 7, 7])
    feed(new, peer, M.Tokens(rids=resend.rids, offsets=resend.offsets, counts=resend.counts, versions=resend.versions,
                             finish=resend.finish, ids=resend.ids, logprobs=resend.logprobs, resent=True))
    assert new.book.requests[rid].n == 4
    commit(new, log)
    log.close()
    third, _, _ = restarted(tmp_path, epoch=3)
    assert bytes(third.book.requests[rid].ids) == M.pack_i32([5, 5, 7, 7])


def test_compaction_keeps_the_log_to_one_step(tmp_path):
    core, clock, log = started(tmp_path)
    sizes = []
    for step in range(6):
        for rid in sorted(core.book.requests):
            req = core.book.requests[rid]
            if req.state == "running":
                feed(core, core.fleet.instances[req.instance].peer, tokens(rid, 0, [4] * 7 + [1], version=req.version,
                                                                              finish=M.FINISH_STOP))
        for gid in list(core.book.groups):
            feed(core, TRAINER, M.AckGroup(gid=gid))
        feed(core, TRAINER, M.SetVersion(version=step + 1, checksum=step))
        for peer in (b"a", b"b"):
            feed(core, peer, M.WeightsLoaded(version=step + 1, checksum=step, nbytes=1, pull_s=0.0, load_s=0.0))
        submit(core, step=step + 1, groups=2, n=2, max_new=8, version=step + 1)
        core.tick()
        commit(core, log)
        sizes.append((tmp_path / "work.log").stat().st_size)
    assert max(sizes) - min(sizes) <= 8 and max(sizes) < 2_000, sizes  # (counters gain digits, nothing piles up)
    new, _, _ = restarted(tmp_path)
    assert new.step == 6 and new.lineage.latest.number == 6 and len(new.book.requests) == 4
    assert new.counters.registrations == 2  # the counters of the snapshot


@pytest.mark.parametrize("seed", range(3))
def test_a_log_torn_at_any_byte_is_recovered_up_to_its_last_complete_record(tmp_path, seed):
    core, clock, log = started(tmp_path)
    rng = random.Random(seed)
    rid = "s0g0/0"
    peer = core.fleet.instances[owner(core, rid)].peer
    for k in range(8):  # (the response's budget)
        feed(core, peer, tokens(rid, k, [rng.randrange(3, 100)]))
        commit(core, log)
    log.close()
    data = (tmp_path / "work.log").read_bytes()
    full, end = W.read(tmp_path / "work.log")
    assert end == len(data)
    for cut in sorted(rng.sample(range(len(data)), 25)):
        (tmp_path / "work.log").write_bytes(data[:cut])
        got, end = W.read(tmp_path / "work.log")
        assert got == full[:len(got)] and end <= cut
        assert end == sum(len(W.frame(r)) for r in got)
    last = max(i for i, r in enumerate(full) if isinstance(r, W.Frame))  # (running totals may follow it)
    (tmp_path / "work.log").write_bytes(data[:sum(len(W.frame(r)) for r in full[:last + 1]) - 3])
    new, _, log2 = restarted(tmp_path)
    assert new.book.requests[rid].n == 7  # the last delta was torn
    log2.close()
    assert W.read(tmp_path / "work.log")[1] == (tmp_path / "work.log").stat().st_size  # the tail was cut


def test_a_log_of_another_run_or_with_epochs_going_backwards_is_an_error_naming_the_file(tmp_path):
    W.WorkLog(tmp_path / "work.log", "run", 3, keep=False).close()
    with pytest.raises(W.WorkLogError, match="work.log.*belongs to run 'run'"):
        W.WorkLog(tmp_path / "work.log", "other", 4, keep=True)
    with pytest.raises(W.WorkLogError, match="work.log.*epochs go backwards"):
        W.WorkLog(tmp_path / "work.log", "run", 2, keep=True)
    W.WorkLog(tmp_path / "work.log", "run", 4, keep=True).close()


def test_group_commit_waits_its_window_and_nothing_reaches_the_trainer_before_it_is_on_disk(tmp_path):
    from rlboost_hpc.manager.service import ManagerService

    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False, commit_every_s=0.05)
    log.write([W.Frame(b"a", b"\0" * 8)], now=10.0)
    assert not log.due(10.01) and log.due(10.05)
    log.commit()
    (tmp_path / "x").mkdir()
    core, _, _ = journaled(tmp_path / "x")  # (its own log there is not used: the service writes ``log``)
    svc = ManagerService(core, worklog=log)
    try:
        core.trainer = W.Hello(TRAINER, "tcp://w", "", {}, {})
        size = (tmp_path / "work.log").stat().st_size
        core.worklog.append(W.Acked("g"))
        core.send(b"inst", M.Alive(epoch=1))
        svc._journal(20.0, idle=False)
        assert (tmp_path / "work.log").stat().st_size == size  # an instance's message waits for the window
        core.send(TRAINER, M.GroupDone(step=0, gid="g", responses=[]))
        svc._journal(20.01, idle=False)  # under load, a finished group waits for the window's commit, held back
        assert (tmp_path / "work.log").stat().st_size == size and [p for p, _ in core.outbox] == [b"inst"]
        core.outbox.clear()
        svc._journal(20.06, idle=False)
        assert (tmp_path / "work.log").stat().st_size > size and [p for p, _ in core.outbox] == [TRAINER]
        core.outbox.clear()
        size = (tmp_path / "work.log").stat().st_size
        core.worklog.append(W.Acked("i"))
        core.send(TRAINER, M.GroupDone(step=0, gid="g2", responses=[]))
        svc._journal(20.061, idle=True)  # nothing else coming in (the step's tail): at once
        assert (tmp_path / "work.log").stat().st_size > size and [p for p, _ in core.outbox] == [TRAINER]
        size = (tmp_path / "work.log").stat().st_size
        core.worklog.append(W.Acked("h"))
        core.outbox.clear()
        size = (tmp_path / "work.log").stat().st_size
        core.send(TRAINER, M.Ok(what="x", cid=1))
        svc._journal(20.07, idle=False)
        assert (tmp_path / "work.log").stat().st_size > size  # a reply to a call commits at once
    finally:
        svc.close()


def _kill_manager_at(out, after_lines: list[int], delay_s: float, proc, then=None) -> list[int]:
    """SIGKILL the run's current manager ``delay_s`` after metrics.jsonl reaches each count in ``after_lines`` and
    the work log holds tokens of the next step (its rollout is in flight), calling ``then(i)`` after the i-th kill;
    returns the killed pids."""
    import os
    import signal

    from rlboost_hpc.manager.journal import read
    from rlboost_hpc.rundir import RunDir

    rd, killed = RunDir(out), []
    for n in after_lines:
        while proc.poll() is None and (not rd.metrics.exists() or len(rd.metrics.read_text().splitlines()) < n):
            time.sleep(0.02)
        while proc.poll() is None and not any(isinstance(r, W.Frame) for r in W.read(rd.work_log)[0]):
            time.sleep(0.01)  # the next step's tokens are coming in (journaled)
        time.sleep(delay_s)
        starts = [r for r in read(rd.journal) if r.get("event") == "start"]
        if proc.poll() is not None or len(starts) != len(killed) + 1:
            break
        os.kill(int(starts[-1]["pid"]), signal.SIGKILL)
        killed.append(int(starts[-1]["pid"]))
        if then is not None:
            then(len(killed) - 1)
    return killed


@pytest.mark.chaos
@pytest.mark.integration
def test_a_manager_killed_mid_step_is_restarted_and_the_run_goes_on_exactly_once(tmp_path):
    """Issue 33 item 1: the demo run (local cluster, two preemptible workers) with its manager SIGKILLed twice while a
    step's rollout is in flight. The trainer restarts it each time (no exit, no resume), the new manager continues
    the step from its work log, and the run ends with nothing lost, duplicated, off-version or trained twice."""
    import json
    import subprocess
    import sys

    from rlboost_hpc.manager.journal import read
    from rlboost_hpc.rundir import RunDir

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress",
                             "--set", "trainer.steps=6", "--set", "trainer.checkpoint_every=0",
                             "--set", "rollout.max_new_tokens=160"],  # (a rollout long enough to land in)
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        killed = _kill_manager_at(out, [2, 4], 0.05, proc)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rep = json.loads(RunDir(out).report.read_text())
    assert len(killed) == 2 and rep["manager_restarts"] == 2 and rep["resumes"] == 0
    assert len([r for r in read(RunDir(out).journal) if r.get("event") == "start"]) == 3
    assert rep["steps"] == 6 and rep["responses_trained"] == 6 * 8 * 8
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0
    assert rep["prompts_not_trained_exactly_once"] == 0
    restored = [json.loads(line)["msg"] for line in (RunDir(out).logs / "manager.jsonl").read_text().splitlines()
                if "restored from the work log" in line]
    assert len(restored) == 2, restored
    assert rep["responses_adopted"] > 0 and rep["tokens_regenerated"] == 0  # the instances kept their work


def multi_turn_started(tmp_path, spec: M.GroupSpec):
    """A journaling core with an environment and one instance ("a") that holds the responses of group ``spec``."""
    core, _, log = journaled(tmp_path)
    core.environment = True
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, TRAINER, M.SetVersion(version=0, checksum=77))
    register(core, b"a", "a", version=None)
    feed(core, b"a", LOADED)
    feed(core, TRAINER, M.SubmitStep(step=0, version=0, groups=[spec]))
    core.tick()
    return core, log


def test_a_trajectory_keeps_its_turns_and_a_tool_call_in_flight_is_asked_again(tmp_path):
    """Multi-turn: the observation and turn structure come back; a tool call the old manager's environment was
    running is asked of the restarted manager's environment."""
    from rlboost_hpc.manager.state import ENV_PEER
    from test_trajectories import DOT, EOS

    spec = M.GroupSpec(gid="s0g0", prompt_ids=[1, 5, 6], n=2, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3,
                       stop_ids=[EOS], max_turns=3, max_trajectory_tokens=30, tool_stop_ids=[DOT])
    core, log = multi_turn_started(tmp_path, spec)
    feed(core, b"a", tokens("s0g0/0", 0, [7, DOT], finish=M.FINISH_STOP))  # turn 0 ends in a tool call
    feed(core, ENV_PEER, M.EnvResult(rid="s0g0/0", turn=0, obs_ids=M.pack_i32([40, 41]), status="ok", tool_s=0.1))
    feed(core, b"a", tokens("s0g0/1", 0, [8, DOT], finish=M.FINISH_STOP))  # its call is still running
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    r0, r1 = new.book.requests["s0g0/0"], new.book.requests["s0g0/1"]
    assert r0.turn == 1 and r0.turn_start == 4 and r0.observations == [2, 2] and r0.state == "queued"
    assert M.unpack_i32(bytes(r0.ids)).tolist() == [7, DOT, 40, 41]
    assert r1.state == "environment" and [m.rid for m in sent(new, ENV_PEER, M.EnvCall)] == ["s0g0/1"]
    assert sorted(new.held) == ["s0g0/0"]


def test_a_restored_instance_reconnecting_with_a_new_agent_takes_its_identity_over(tmp_path):
    """A worker that outlived a trainer crash reconnects with a new agent (a new routing id) under the same
    (job, attempt): the restarted manager lets it in instead of refusing a duplicate identity."""
    core, clock, log = started(tmp_path)
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    feed(new, b"a-new", M.Register(job_id="a", attempt=0, kind="preemptible", max_batch=32))
    assert sent(new, b"a-new", M.Welcome) and not sent(new, b"a-new", M.Reject)
    assert new.fleet.by_peer == {b"a-new": "a#0", b"b": "b#0"} and new.fleet.instances["a#0"].peer == b"a-new"
    feed(new, b"c", M.Register(job_id="a", attempt=0, kind="preemptible", max_batch=32))
    assert sent(new, b"c", M.Reject)  # once it spoke, the identity is its own again


def test_every_restart_is_counted_even_several_within_one_step(tmp_path):
    core, clock, log = started(tmp_path)
    commit(core, log)
    log.close()
    for epoch in (2, 3, 4):
        new, _, log2 = restarted(tmp_path, epoch=epoch)
        log2.close()
        assert new.counters.manager_restarts == epoch - 1


def test_a_step_naming_a_group_twice_is_refused(tmp_path):
    """The step builder shared with restore: a group id twice in one SubmitStep is an error, not an overwrite."""
    core, _, _ = journaled(tmp_path)
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, TRAINER, M.SetVersion(version=0))
    g = M.GroupSpec(gid="s0g0", prompt_ids=[1], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0,
                    stop_ids=[])
    feed(core, TRAINER, M.SubmitStep(step=0, version=0, groups=[g, g], cid=9))
    assert "duplicate request id s0g0/0" in sent(core, TRAINER, M.Error)[-1].error and not core.book.requests


@pytest.mark.integration
def test_resuming_with_a_work_log_of_another_run_exits_2_naming_the_file(repo_root, tmp_path):
    """Bad input: a run directory whose work log names another run (copied from elsewhere) is refused on resume —
    exit 2, the file named — instead of continuing someone else's step."""
    from test_demo_run import run_cli

    out = tmp_path / "run"
    p = run_cli(repo_root, out, "trainer.steps=1", "cluster.max_workers=0")
    assert p.returncode == 0, p.stderr[-3000:]
    log = W.WorkLog(tmp_path / "other.log", "someone-else", 1, keep=False)
    log.close()
    (out / "manager-work.log").write_bytes((tmp_path / "other.log").read_bytes())
    p = run_cli(repo_root, out, "trainer.steps=2", "cluster.max_workers=0")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "manager-work.log" in p.stderr and "belongs to run 'someone-else'" in p.stderr
    assert "Traceback" not in p.stderr


def test_an_instance_suspect_at_the_kill_is_not_waited_for_and_its_new_agent_takes_it_over(tmp_path):
    """Found by the long chaos run: after a trainer crash the old reserved engine was suspect in the log, and the
    resumed trainer's new reserved engine (same identity, new connection) was refused as a duplicate."""
    core, clock, log = started(tmp_path)
    core.disconnected(b"b")  # its connection closed: suspect (journaled)
    commit(core, log)
    log.close()
    new, clock2, _ = restarted(tmp_path)
    assert new.fleet.instances["b#0"].state == "suspect" and not new.fleet.instances["b#0"].restored
    feed(new, b"b-new", M.Register(job_id="b", attempt=0, kind="preemptible", max_batch=32))
    assert sent(new, b"b-new", M.Welcome) and not sent(new, b"b-new", M.Reject)
    feed(new, b"b-new", M.Heartbeat(version=-1, active=0, tokens_generated=0))
    assert new.fleet.instances["b#0"].state == "pulling"  # it spoke: back from suspect


def test_a_manager_whose_trainer_died_while_it_started_exits_quietly(capfd):
    """Regression (the long chaos run): a trainer SIGKILLed while its manager was starting left a BrokenPipeError
    traceback in the run's log (the manager reporting its endpoint to nobody). It now logs one line and exits 0."""
    import multiprocessing as mp

    from rlboost_hpc.manager.service import run_manager_process

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_manager_process, args=("tcp://127.0.0.1:0", ManagerSettings(), child))
    proc.start()
    child.close()
    parent.close()  # the trainer is gone before the manager reports its endpoint
    proc.join(60)
    err = capfd.readouterr().err
    assert proc.exitcode == 0 and "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]


def test_a_suspect_restored_from_the_log_that_returns_is_not_counted_as_lost_while_pulling(tmp_path):
    """Regression (the long chaos run printed kills_during_weight_transfer = -8): a suspect rebuilt from the work log
    was marked as silent while pulling, so its return was counted as a return from a silence while pulling that this
    manager never counted — the difference went negative."""
    core, clock, log = started(tmp_path)
    clock.t = 10.0
    feed(core, b"b", M.Heartbeat(version=0, active=0, tokens_generated=0))
    core.tick()  # "a" is silent past the deadline: suspect (it held the version: not while pulling)
    assert core.fleet.instances["a#0"].state == "suspect" and core.counters.suspected_while_pulling == 0
    commit(core, log)
    log.close()
    new, clock, _ = restarted(tmp_path)
    feed(new, b"a", M.Heartbeat(version=0, active=0, tokens_generated=0))
    assert new.fleet.instances["a#0"].state != "suspect"
    assert new.counters.recovered_while_pulling == 0 and new.stats().instances_lost_while_pulling == 0


def test_a_resumed_trainer_that_kept_the_restored_version_keeps_its_steps_in_flight_across_a_restart(tmp_path):
    """Regression (chaos with max_staleness = 1): a resumed trainer confirmed the restored version (kept), then the
    manager restarted; the replay saw its hello but not the confirmation, so its next, ordinary version change was
    taken for a resumed trainer's other version and discarded every response in flight — the step submitted ahead
    lost half its groups and the run hung at the step deadline."""
    core, clock, log = started(tmp_path)
    feed(core, b"trainer-2", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, b"trainer-2", M.SetVersion(version=0, checksum=77, cid=1))  # the checkpoint's version: kept
    commit(core, log)
    log.close()
    new, _, log = restarted(tmp_path)
    for rid in sorted(new.book.requests):  # the step finishes; the trainer changes the version as always
        req = new.book.requests[rid]
        req.move(RequestState.RUNNING, "replayed")
        new.table.finish(req, "stop")
    feed(new, b"trainer-2", M.SetVersion(version=1, checksum=78, cid=2))
    assert new.counters.responses_discarded_stale == 0 and len(new.book.requests) == 4


def test_a_first_manager_killed_while_it_starts_is_started_again_within_the_budget():
    """Regression (the long chaos run, step 77): a trainer resumed, and its first manager was SIGKILLed before it
    reported its endpoint; the trainer died of the EOFError with a traceback. The first start now retries within the
    restart budget and, past it, fails the run in one line (RunFailed, exit 1)."""
    from rlboost_hpc.errors import RunFailed
    from rlboost_hpc.manager.supervisor import ManagerSupervisor

    class Proc:
        def is_alive(self):
            return True

    calls = []

    def spawn(fail: int):
        def f(**kw):
            calls.append(kw)
            if len(calls) <= fail:
                raise EOFError
            return Proc(), "tcp://127.0.0.1:5555", "http://127.0.0.1:9100/metrics"
        return f

    sup = ManagerSupervisor(spawn(1), restore=True, restarts=3, window_s=600, bind="tcp://127.0.0.1:0")
    assert len(calls) == 2 and calls[1]["restore"] is True and sup.bound == "tcp://127.0.0.1:5555"
    calls.clear()
    with pytest.raises(RunFailed, match="could not be started"):
        ManagerSupervisor(spawn(10), restore=False, restarts=3, window_s=600, bind="tcp://127.0.0.1:0")
    assert len(calls) == 4  # the first start and its 3 restarts


def test_a_trainer_call_outlives_a_manager_restart_slower_than_the_calls_timeout():
    """Regression (issue 49's chaos runs on a loaded 2-core host): the trainer's SetVersion failed with "did not answer
    SetVersion within 10s" although the manager was only restarting — its restart, which the call's wait blocks for
    (``ManagerSupervisor.alive``), took 10.3 s and used up the call's whole timeout. A restarted manager now gets the
    call again with the whole timeout: here a 1.5 s restart inside a 1 s call."""
    import threading

    import zmq

    from rlboost_hpc.trainer.client import ManagerClient

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    state = {"restarted": 0, "dies_at": time.monotonic() + 0.3}

    def alive() -> bool:  # as the supervisor's: blocks while it restarts the dead manager
        if state["restarted"] == 0 and time.monotonic() >= state["dies_at"]:
            time.sleep(1.5)
            state["restarted"] = 1
        return True

    def manager() -> None:  # the dead manager answers nothing; the restarted one answers the resent call
        while True:
            ident, frame = router.recv_multipart()
            msg = M.decode(frame)
            if state["restarted"]:
                router.send_multipart([ident, M.encode(M.Ok(what="setver", cid=msg.cid))])
                return

    t = threading.Thread(target=manager, daemon=True)
    t.start()
    client = ManagerClient(f"tcp://127.0.0.1:{port}", ctx=ctx, timeout_s=1.0, alive=alive, resend_s=5.0,
                           restarts=lambda: state["restarted"])
    try:
        reply = client.call(M.SetVersion(version=1, checksum=5))
        assert isinstance(reply, M.Ok) and client.resends >= 1
    finally:
        client.close()
        router.close()
        ctx.term()


def test_a_migration_of_the_step_in_flight_is_still_counted_after_a_restart(tmp_path):
    """Regression (CI of 2026-12-06, the Megatron LoRA demo): an instance preempted with warning handed a partial
    response over, the manager was killed before the step ended, and the restarted one reported 0 migrations — the
    running totals were journaled only when the log was compacted, the response's own count and the tallies by
    engine and turn not at all. Now the totals of the last commit and each migration are in the log."""
    core, clock, log = started(tmp_path)
    a = owner(core, "s0g0/0")
    peer = core.fleet.instances[a].peer
    feed(core, peer, tokens("s0g0/0", 0, [4, 5]))
    mine = sorted(r for r in core.book.requests if owner(core, r) == a)
    feed(core, peer, M.Released(rids=mine, tokens_generated=2))
    feed(core, peer, M.Deregister(reason="preempted (SIGTERM)", tokens_generated=2, cause="preempted"))
    before = core.stats()
    assert before.responses_migrated == len(mine) and before.instances_preempted_with_warning == 1
    assert before.migrations_by_engine["out_of"] == {"torch": 1} and before.migrations_by_turn == {"0": 1}
    commit(core, log)
    log.close()

    new, _, log2 = restarted(tmp_path)
    after = new.stats()
    for f in ("responses_migrated", "tokens_migrated", "instances_preempted_with_warning", "migrations_by_engine",
              "migrations_by_turn", "registrations", "dispatched"):
        assert getattr(after, f) == getattr(before, f), f
    assert after.manager_restarts == 1 and all(new.book.requests[r].migrations == 1 for r in mine)
    assert all(new.book.requests[r].migrations == 0 for r in new.book.requests if r not in mine)
    # a second restart of the same step keeps them too (the restored totals are journaled by the next commit)
    feed(new, b"b", M.Heartbeat(version=0, active=0, tokens_generated=0))
    new.worklog.append(W.Silent("b#0", True))
    commit(new, log2)
    log2.close()
    third, _, _ = restarted(tmp_path, epoch=3)
    assert third.stats().responses_migrated == len(mine) and third.counters.manager_restarts == 2


def test_the_running_totals_are_journaled_only_when_they_changed_and_only_with_records(tmp_path):
    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False)
    c = W.ManagerCounters(dispatched=3)
    log.commit(c)  # nothing buffered: nothing written
    log.write([W.Acked("g0")], 0.0)
    log.commit(c)
    log.write([W.Acked("g1")], 0.0)
    log.commit(c)  # unchanged: not written again
    c.migrations_by_turn["0"] = 1
    log.write([W.Acked("g2")], 0.0)
    log.close(c)
    recs, _ = W.read(tmp_path / "work.log")
    assert [type(r).__name__ for r in recs] == ["Begin", "Acked", "Counters", "Acked", "Acked", "Counters"]
    assert recs[-1].counters.migrations_by_turn == {"0": 1} and recs[2].counters.migrations_by_turn == {}


def test_a_held_response_with_tokens_that_no_instance_adopts_is_counted_as_migrated(tmp_path):
    """Regression (the LoRA demo, 2 of 5 local runs): the manager was killed within the commit window after a
    preempted instance left, so the restored one still listed it and held its partial responses; when the hold ended
    they resumed elsewhere uncounted (0 migrations). Queued from the hold with tokens is a migration."""
    core, clock, log = started(tmp_path)
    a = owner(core, "s0g0/0")
    feed(core, core.fleet.instances[a].peer, tokens("s0g0/0", 0, [4, 5]))
    commit(core, log)
    log.close()
    new, clock2, _ = restarted(tmp_path)
    clock2.t = 2.5  # the hold is over: no instance resent
    new.tick()
    assert new.counters.responses_migrated == 1 and new.counters.tokens_migrated == 2
    assert new.book.requests["s0g0/0"].migrations == 1 and all(r.migrations == 0 for k, r in new.book.requests.items()
                                                          if k != "s0g0/0")
    assert any(isinstance(r, W.Migrated) and r.rid == "s0g0/0" for r in new.worklog)


@pytest.mark.chaos
@pytest.mark.integration
def test_workers_warned_while_their_manager_is_dead_hand_their_responses_to_the_restarted_one(tmp_path):
    """A warned preemption that lands while the manager is down (CI of fb9dcb2: the LoRA demo's preemption fell on
    its manager SIGKILL). Through ``rlboost-hpc run``: the manager SIGKILLed twice while a step's rollout is in
    flight, and a live preemptible worker warned (SIGTERM) at once after the first kill (its drain is queued for
    the dead manager) and another 2.6 s after the second (it finds the manager silent). Each waits for the restarted
    manager's Farewell before it exits, so its responses migrate with every token: every end is counted as a warned
    preemption, no instance is lost, no token generated again (before: the workers exited 2 s after draining into
    the void; the restored manager waited for them past its heartbeat deadline and generated their last tokens
    again)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from rlboost_hpc.rundir import RunDir

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress",
                             "--set", "trainer.steps=6", "--set", "trainer.checkpoint_every=0",
                             "--set", "rollout.max_new_tokens=160", "--set", "cluster.max_workers=3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    warned: list[list[int]] = []

    def warn_workers(i: int) -> None:
        time.sleep(2.6 * i)
        warned.append([])
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "rlboost_hpc.rollout.worker" in " ".join(p.cmdline()):
                    os.kill(p.pid, signal.SIGTERM)
                    warned[-1].append(p.pid)
                    return
            except psutil.Error:  # (a process that ended meanwhile)
                pass

    try:
        killed = _kill_manager_at(out, [2, 4], 0.05, proc, then=warn_workers)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rep = json.loads(RunDir(out).report.read_text())
    assert len(killed) == 2 and rep["manager_restarts"] == 2 and all(warned) and len(warned) == 2, (killed, warned)
    assert rep["steps"] == 6 and rep["responses_trained"] == 6 * 8 * 8
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0
    # every warned end counted by the manager: the trace's own (the cluster's events) and the two of this test — a
    # worker this test warned that the trace preempted too while it drained (waiting for the restarted manager) ended
    # once, not twice
    events = [json.loads(x) for x in RunDir(out).events.read_text().splitlines()]
    pid_of = {(e["job_id"], e["restart_cnt"]): e["pid"] for e in events
              if e.get("event") == "started" and e.get("source") == "local-cluster"}
    trace_warned = {pid_of.get((e["job_id"], e["restart_cnt"])) for e in events
                    if e.get("event") == "finished" and e.get("cause") == "preempt"}
    both = len(trace_warned & {pid for pids in warned for pid in pids})
    assert rep["instances_preempted_with_warning"] == rep["preemptions_with_warning"] + 2 - both, (rep, both)
    assert rep["instances_lost_without_warning"] == 0 and rep["tokens_regenerated"] == 0, rep


def test_the_held_out_evaluations_outlive_a_restart_and_the_compaction_of_the_log(tmp_path):
    """Issue 58 item 5: the trainer tells the manager each held-out evaluation (its Prometheus gauges: pass@k, the
    rewards); the work log keeps them through a step's compaction, so a restarted manager serves them again, and a
    later "after" evaluation joins the restored "before"."""
    from rlboost_hpc.protocol.stats import HeldOutEvaluation

    core, clock, log = journaled(tmp_path)
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={"a": 1}))
    feed(core, TRAINER, M.SetVersion(version=0, checksum=77))
    before = HeldOutEvaluation(version=0, reward_sampled=0.25, reward_greedy=0.5, pass_at_k={"1": 0.25, "4": 0.5})
    feed(core, TRAINER, M.Evaluation(when="before", result=before))
    feed(core, b"stranger", M.Evaluation(when="after", result=before))  # only the trainer tells evaluations
    assert core.stats().heldout == {"before": before}
    submit(core, groups=1, n=2, max_new=8)  # a step begins: the log is compacted to a snapshot
    commit(core, log)
    log.close()
    new, _, log2 = restarted(tmp_path)
    assert new.stats().heldout == {"before": before}
    after = HeldOutEvaluation(version=1, reward_sampled=0.75, reward_greedy=1.0, pass_at_k={"1": 0.75, "4": 1.0})
    feed(new, TRAINER, M.Evaluation(when="after", result=after))
    assert new.stats().heldout == {"before": before, "after": after}
