"""Unit tests of the manager's state machine (pure logic, injected clock, no sockets)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M

TRAINER = b"trainer"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(pending_limit=4, max_attempts=3, **settings):
    clock = Clock()
    core = ManagerCore(clock=clock, settings=ManagerSettings(
        pending_limit=pending_limit, heartbeat_s=0.25, heartbeat_timeout_s=2.0, max_attempts=max_attempts, **settings))
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    core.outbox.clear()
    return core, clock


def register(core, peer: bytes, job: str, attempt=0, kind="preemptible", version=0, max_batch=32, engine="torch"):
    core.on_message(peer, M.Register(job_id=job, attempt=attempt, kind=kind, max_batch=max_batch, engine=engine))
    if version is not None:
        core.on_message(peer, M.WeightsLoaded(version=version, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))


def submit(core, step=0, groups=1, n=4, max_new=8, version=0):
    specs = [M.GroupSpec(gid=f"s{step}g{g}", prompt_ids=[1, 5, 6], n=n, max_new_tokens=max_new, temperature=1.0,
                         top_p=1.0, seed=10 * g, stop_ids=[1, 2]) for g in range(groups)]
    core.on_message(TRAINER, M.SubmitStep(step=step, version=version, groups=specs))


def sent(core, peer=None, kind=None):
    out = [(p, m) for p, m in core.outbox if (peer is None or p == peer) and (kind is None or isinstance(m, kind))]
    return [m for _, m in out]


def tokens(rid, offset, ids, version=0, finish=M.FINISH_NONE):
    return M.Tokens(rids=[rid], offsets=[offset], counts=[len(ids)], versions=[version], finish=[finish],
                    ids=M.pack_i32(ids), logprobs=M.pack_f32([-0.5] * len(ids)))


def test_registration_identity_is_job_and_attempt_and_never_merges():
    core, _ = make()
    register(core, b"a", "job7", 0)
    assert isinstance(sent(core, b"a")[0], M.Welcome)
    core.outbox.clear()
    register(core, b"b", "job7", 0, version=None)  # same identity from another connection
    assert isinstance(sent(core, b"b")[0], M.Reject)
    assert core.counters.rejected_registrations == 1
    register(core, b"c", "job7", 1)  # the requeued attempt is a new instance
    assert isinstance(sent(core, b"c", M.Welcome)[0], M.Welcome)
    assert set(core.fleet.instances) == {"job7#0", "job7#1"}


def test_reregistering_a_dead_attempt_is_rejected():
    core, clock = make()
    register(core, b"a", "job1", 0)
    clock.t = 10.0
    core.tick()
    core.outbox.clear()
    register(core, b"z", "job1", 0, version=None)
    assert isinstance(sent(core, b"z")[0], M.Reject)


def test_routable_only_with_latest_verified_version():
    core, _ = make()
    register(core, b"a", "j", version=None)
    submit(core)
    core.tick()
    assert not sent(core, b"a", M.Assign)  # still pulling: nothing routed
    core.on_message(b"a", M.WeightsFailed(version=0, error="checksum mismatch at chunk 3"))
    core.tick()
    assert not sent(core, b"a", M.Assign) and core.fleet.instances["j#0"].state == "fenced"
    core.on_message(b"a", M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.1, load_s=0.0))
    core.tick()
    assert len(sent(core, b"a", M.Assign)[0].works) == 4


def test_full_pulls_are_timed_apart_from_delta_pulls():
    """A pull that moved the whole version (wire bytes ≥ the version's) is a full pull; a delta pull is not."""
    core, _ = make()
    register(core, b"a", "a", version=None)
    register(core, b"b", "b", version=None)
    core.on_message(b"a", M.WeightsLoaded(version=0, checksum=1, nbytes=1000, pull_s=2.0, load_s=0.0, wire_bytes=1000))
    core.on_message(b"b", M.WeightsLoaded(version=0, checksum=1, nbytes=1000, pull_s=0.2, load_s=0.0, wire_bytes=30))
    st = core.stats()
    assert st.full_pull_seconds_mean == 2.0 and st.pull_seconds_mean == 1.1
    assert core.dist.full_pull_seconds.count == 1 and core.dist.pull_seconds.count == 2


def test_jsq_with_pending_limit_holds_the_rest_at_the_manager():
    core, _ = make(pending_limit=3)
    register(core, b"a", "a")
    register(core, b"b", "b")
    submit(core, groups=2, n=4)  # 8 requests
    core.tick()
    got = {p: sum(len(m.works) for m in sent(core, p, M.Assign)) for p in (b"a", b"b")}
    assert got == {b"a": 3, b"b": 3}
    assert len(core.book.queue) == 2


def test_tokens_complete_group_delivered_exactly_once():
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=2, max_new=3)
    core.tick()
    core.outbox.clear()
    core.on_message(b"a", tokens("s0g0/0", 0, [7, 8, 1], finish=M.FINISH_STOP))
    assert not sent(core, TRAINER, M.GroupDone)
    core.on_message(b"a", tokens("s0g0/1", 0, [9, 9]))
    core.on_message(b"a", tokens("s0g0/1", 2, [4], finish=M.FINISH_LENGTH))
    done = sent(core, TRAINER, M.GroupDone)
    assert len(done) == 1
    r = {x.rid: x for x in done[0].responses}
    assert M.unpack_i32(r["s0g0/1"].ids).tolist() == [9, 9, 4]
    assert M.expand_version_runs(r["s0g0/1"].version_runs).tolist() == [0, 0, 0]
    assert r["s0g0/0"].finish_reason == "stop" and r["s0g0/1"].finish_reason == "length"
    core.outbox.clear()
    core.on_message(b"a", tokens("s0g0/1", 3, [4], finish=M.FINISH_LENGTH))  # replayed frame
    assert not sent(core, TRAINER, M.GroupDone)


def test_group_done_carries_the_versions_the_engines_stamped():
    """GroupDone's version runs come from each accepted delta's stamp (not from the request's version): a
    delta stamped with another version is refused (its instance fenced) and never reaches the runs; the
    response finishes elsewhere and the trainer sees exactly the stamps of the tokens it trains."""
    core, _ = make()
    register(core, b"a", "a")
    register(core, b"b", "b")
    submit(core, n=1, max_new=4)
    core.tick()
    (peer,) = [p for p in (b"a", b"b") if sent(core, p, M.Assign)]
    other = b"b" if peer == b"a" else b"a"
    core.on_message(peer, tokens("s0g0/0", 0, [7, 8]))
    core.on_message(peer, tokens("s0g0/0", 2, [9], version=5))  # an engine stamping the wrong version
    assert core.counters.off_version_tokens_rejected == 1
    assert core.fleet.instances[f"{peer.decode()}#0"].state == "fenced"
    core.outbox.clear()
    core.tick()
    assert sent(core, other, M.Assign)[0].works[0].prefix_ids == [7, 8]  # resumes after the accepted tokens
    core.on_message(other, tokens("s0g0/0", 2, [3, 4], finish=M.FINISH_LENGTH))
    (done,) = sent(core, TRAINER, M.GroupDone)
    assert M.unpack_i32(done.responses[0].version_runs).tolist() == [0, 4]  # two deltas, one run of version 0
    assert M.expand_version_runs(done.responses[0].version_runs).tolist() == [0, 0, 0, 0]


def test_killed_instance_migrates_each_response_with_reduced_budget():
    core, clock = make()
    register(core, b"a", "a")
    submit(core, n=2, max_new=8)
    core.tick()
    core.on_message(b"a", tokens("s0g0/0", 0, [5, 6, 7]))
    core.on_message(b"a", M.Heartbeat(version=0, active=2, tokens_generated=5))  # 2 produced but never sent
    register(core, b"b", "b")
    clock.t = 3.0
    core.on_message(b"b", M.Heartbeat(version=0, active=0, tokens_generated=0))
    core.outbox.clear()
    core.tick()
    works = {w.rid: w for m in sent(core, b"b", M.Assign) for w in m.works}
    assert works["s0g0/0"].prefix_ids == [5, 6, 7] and works["s0g0/0"].tokens_left == 5  # case R1
    assert works["s0g0/1"].prefix_ids == [] and works["s0g0/1"].tokens_left == 8
    assert core.counters.responses_migrated == 2
    assert core.counters.tokens_regenerated == 2
    assert core.stats().instances_lost == 1 and core.fleet.instances["a#0"].state == "suspect"
    # the silent instance's late frame is dropped, never appended twice
    core.on_message(b"a", tokens("s0g0/0", 3, [8]))
    assert core.book.requests["s0g0/0"].n == 3


def test_warned_preemption_releases_everything_and_regenerates_nothing():
    core, _ = make()
    register(core, b"a", "a")
    register(core, b"b", "b")
    submit(core, n=2, max_new=8)
    core.tick()
    mine = [w.rid for m in sent(core, b"a", M.Assign) for w in m.works]
    core.outbox.clear()
    core.on_message(b"a", M.Draining(reason="preempted (SIGTERM)"))
    core.on_message(b"a", tokens(mine[0], 0, [3, 3]))
    core.on_message(b"a", M.Released(rids=mine, tokens_generated=2))
    core.on_message(b"a", M.Deregister(reason="preempted", tokens_generated=2, cause="preempted"))
    core.tick()
    works = {w.rid: w for m in sent(core, b"b", M.Assign) for w in m.works}
    assert works[mine[0]].prefix_ids == [3, 3] and works[mine[0]].tokens_left == 6
    assert core.counters.tokens_regenerated == 0
    assert core.counters.instances_preempted_with_warning == 1


@pytest.mark.parametrize("cause,counter", [("preempted", "instances_preempted_with_warning"),
                                           ("time_limit", "instances_time_limit"), ("drained", "instances_drained"),
                                           ("stopped", "instances_drained")])
def test_each_kind_of_warned_end_has_one_counter_even_before_the_instance_was_welcomed(cause, counter):
    """A worker warned while starting sends Deregister right behind its Register (regression: it used to exit
    without deregistering and was counted lost without warning)."""
    core, _ = make()
    core.on_message(b"a", M.Register(job_id="a", attempt=0, kind="preemptible", max_batch=8, engine="torch"))
    core.on_message(b"a", M.Draining(reason="warned"))
    core.on_message(b"a", M.Released(rids=[], tokens_generated=0))
    core.on_message(b"a", M.Deregister(reason="warned", tokens_generated=0, cause=cause))
    counted = {k: getattr(core.counters, k) for k in ("instances_preempted_with_warning", "instances_time_limit",
                                              "instances_drained")}
    assert counted == {k: int(k == counter) for k in counted}
    assert "a#0" in core.fleet.ended and "a#0" not in core.fleet.instances and core.stats().instances_lost == 0


def test_migrations_are_counted_per_engine_kind_for_partial_responses_only():
    core, clock = make()
    register(core, b"s", "s", engine="sglang")
    submit(core, n=2, max_new=8)
    core.tick()
    core.on_message(b"s", tokens("s0g0/0", 0, [4, 4]))  # s0g0/1 produced nothing yet
    core.on_message(b"s", M.Released(rids=["s0g0/0", "s0g0/1"], tokens_generated=2))
    core.on_message(b"s", M.Deregister(reason="preempted (SIGUSR2)", tokens_generated=2, cause="preempted"))
    register(core, b"t", "t", engine="torch")
    core.tick()
    assert core.counters.migrations_by_engine == {"out_of": {"sglang": 1}, "into": {"torch": 1}}
    assert core.stats().migrations_by_engine["into"] == {"torch": 1}
    assert "s#0" in core.fleet.ended


def test_off_version_tokens_are_rejected_and_instance_fenced():
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=1)
    core.tick()
    core.on_message(b"a", tokens("s0g0/0", 0, [4, 4], version=7))
    assert core.counters.off_version_tokens_rejected == 2
    assert core.fleet.instances["a#0"].state == "fenced"
    assert core.book.requests["s0g0/0"].n == 0 and core.book.requests["s0g0/0"].state == "queued"


def test_budget_overrun_fences():
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=1, max_new=8)
    core.tick()
    core.on_message(b"a", tokens("s0g0/0", 0, [4] * 9))
    assert core.fleet.instances["a#0"].state == "fenced"
    assert core.book.requests["s0g0/0"].n == 0


def test_a_gap_after_lost_frames_migrates_the_response_and_keeps_the_instance():
    """Frames lost with a connection (a TCP reset) leave a gap: the response resumes from what arrived (the
    instance is told to release it), the gap's tokens are dropped, and the instance stays routable."""
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=1, max_new=8)
    core.tick()
    core.on_message(b"a", tokens("s0g0/0", 0, [4, 5]))
    core.outbox.clear()
    core.on_message(b"a", tokens("s0g0/0", 4, [6]))  # tokens 2-3 were lost
    core.on_message(b"a", tokens("s0g0/0", 5, [7]))  # streamed before it saw the Release: late too
    assert core.fleet.instances["a#0"].state == "ready" and core.book.requests["s0g0/0"].n == 2
    assert [m.rids for m in sent(core, b"a", M.Release)] == [["s0g0/0"]] and core.counters.deltas_out_of_order == 1
    core.on_message(b"a", M.Released(rids=["s0g0/0"], tokens_generated=6))
    core.tick()
    assert sent(core, b"a", M.Assign)[0].works[0].prefix_ids == [4, 5]  # resumes from the accepted prefix


def test_a_closed_connection_makes_the_instance_suspect_at_once():
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=2, max_new=8)
    core.tick()
    core.disconnected(b"a")
    assert core.fleet.instances["a#0"].state == "suspect" and core.book.requests["s0g0/0"].state == "queued"
    assert core.counters.connections_closed == 1
    core.disconnected(b"nobody")  # unknown peers (a stranger, the trainer) change nothing


def test_version_changes_only_between_steps():
    core, _ = make()
    register(core, b"a", "a")
    submit(core, n=1, max_new=2)
    core.tick()
    core.outbox.clear()
    core.on_message(TRAINER, M.SetVersion(version=1))
    assert isinstance(sent(core, TRAINER)[0], M.Error)  # W4: never discard in-flight work
    core.on_message(b"a", tokens("s0g0/0", 0, [5, 1], finish=M.FINISH_STOP))
    core.outbox.clear()
    core.on_message(TRAINER, M.SetVersion(version=1))
    assert isinstance(sent(core, b"a")[0], M.NewVersion)
    assert not core.routable(core.fleet.instances["a#0"])


def test_close_seeding_hands_reserved_work_to_remote_instances():
    core, _ = make(pending_limit=8)
    register(core, b"r", "reserved", kind="reserved")
    submit(core, n=4)
    core.tick()
    assert sum(len(m.works) for m in sent(core, b"r", M.Assign)) == 4
    register(core, b"p", "p1")
    core.outbox.clear()
    core.on_message(TRAINER, M.CloseSeeding(step=0))
    rel = sent(core, b"r", M.Release)
    assert len(rel) == 1 and len(rel[0].rids) == 4
    core.on_message(b"r", M.Released(rids=rel[0].rids, tokens_generated=0))
    core.tick()
    assert sum(len(m.works) for m in sent(core, b"p", M.Assign)) == 4
    assert not core.routable(core.fleet.instances["reserved#0"])


def test_co_located_fallback_without_preemptible_instances():
    core, _ = make(pending_limit=8)
    register(core, b"r", "reserved", kind="reserved")
    submit(core, n=4)
    core.tick()
    core.outbox.clear()
    core.on_message(TRAINER, M.CloseSeeding(step=0))
    assert not sent(core, b"r", M.Release)
    assert core.routable(core.fleet.instances["reserved#0"])


def test_the_fallbacks_seconds_are_reported_so_the_trainer_does_not_count_them_as_waiting():
    """Regression (bench_live_vs_sim: live T_seed 1.4 s after step 0 where the simulator's was 0.45 s): seeding closed
    with no remote instance up, the reserved engine kept generating (the co-located fallback) and the trainer
    counted all of it as waiting for data. The manager now measures the fallback — from the close to the first
    preemptible instance pulling or ready, as the simulator keeps seeding open until then — and reports it with
    the step."""
    core, clock = make(pending_limit=8)
    register(core, b"r", "reserved", kind="reserved")
    submit(core, n=4)
    core.tick()
    assert len(core.fleet.instances["reserved#0"].inflight) == 4
    clock.t = 1.0
    core.on_message(TRAINER, M.CloseSeeding(step=0))  # no preemptible instance: fallback from t = 1
    for t in (1.8, 2.6, 3.5):  # the reserved engine generates (and heartbeats) on
        clock.t = t
        core.on_message(b"r", M.Heartbeat(version=0, active=4, tokens_generated=0))
        core.tick()
    assert core.step_account.fallback_since == 1.0  # still no remote capacity
    register(core, b"p", "p", version=None)  # booted: pulling from t = 3.5
    clock.t = 3.6
    core.tick()
    assert core.step_account.fallback_since is None and core.step_account.fallback_s == pytest.approx(2.6)
    for rid in sorted(core.book.requests):
        core.on_message(b"r", tokens(rid, 0, [2], finish=M.FINISH_STOP))
    core.on_message(TRAINER, M.SetVersion(version=1))
    assert core.stats().last_step_remote.fallback_s == pytest.approx(2.6) and core.step_account.fallback_s == 0.0


def test_the_first_preemptible_instance_ready_after_a_fallback_takes_the_reserved_engines_work():
    """Regression (bench_live_vs_sim: the live controller set N_prem 2 after step 0, the simulator 16): after a
    co-located fallback the reserved engine kept every response it had taken, so the preemptible instances that came
    up during the step got almost none, the step's remote work looked tiny and the cap collapsed. As in the
    simulator, remote capacity now ends the fallback by handing the reserved engine's unfinished responses back."""
    core, clock = make(pending_limit=8)
    register(core, b"r", "reserved", kind="reserved")
    submit(core, n=4)
    core.tick()
    core.on_message(TRAINER, M.CloseSeeding(step=0))  # no preemptible instance: fallback
    core.outbox.clear()
    register(core, b"p", "p", version=None)  # booted, pulling: nothing released yet (it could not take the work)
    core.tick()
    assert not sent(core, b"r", M.Release)
    core.on_message(b"p", M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=0.1, load_s=0.0))
    (rel,) = sent(core, b"r", M.Release)
    assert sorted(rel.rids) == sorted(core.book.requests) and not core.routable(core.fleet.instances["reserved#0"])
    core.on_message(b"r", M.Released(rids=rel.rids, tokens_generated=0))
    core.tick()
    assert sum(len(m.works) for m in sent(core, b"p", M.Assign)) == 4


def test_a_step_whose_remote_capacity_was_up_at_the_close_has_no_fallback():
    core, clock = make(pending_limit=8)
    register(core, b"p", "p")
    submit(core, n=2)
    core.tick()
    core.on_message(TRAINER, M.CloseSeeding(step=0))
    assert core.step_account.fallback_since is None and core.step_account.fallback_s == 0.0


def test_repeated_engine_failures_fail_the_step_not_train_it():
    core, _ = make(max_attempts=2)
    register(core, b"a", "a")
    submit(core, n=1)
    for _ in range(2):
        core.tick()
        core.on_message(b"a", M.RequestFailed(rid="s0g0/0", error="engine exploded"))
    failed = sent(core, TRAINER, M.StepFailed)
    assert failed and "engine exploded" in failed[0].error
    assert not sent(core, TRAINER, M.GroupDone)


def test_unregistered_peers_cannot_inject_tokens_or_steer():
    core, _ = make()
    submit(core, n=1)
    core.on_message(b"x", tokens("s0g0/0", 0, [4]))
    core.on_message(b"x", M.SetVersion(version=5))
    assert core.lineage.latest.number == 0 and core.book.requests["s0g0/0"].n == 0
    assert core.counters.protocol_rejects >= 2


# --------------------------------------------------------------------------- property test
def _tok(rid: str, pos: int) -> int:
    return 3 + (hash((rid, pos)) % 500)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n_inst=st.integers(1, 4), kill_p=st.floats(0, 0.08),
       warn_p=st.floats(0, 0.1))
def test_no_response_lost_or_duplicated_under_random_preemptions(seed, n_inst, kill_p, warn_p):
    """Simulated instances produce token f(rid, position); instances die (with or without warning) and new
    attempts register. Every response must be delivered once, with exactly the uninterrupted tokens."""
    rng = random.Random(seed)
    core, clock = make(pending_limit=3)
    groups, n, max_new = 3, 4, 6
    submit(core, groups=groups, n=n, max_new=max_new)
    alive: dict[bytes, dict] = {}
    attempts = 0

    def spawn():
        nonlocal attempts
        peer = f"p{attempts}".encode()
        register(core, peer, f"job{attempts % n_inst}", attempt=attempts)
        alive[peer] = {"work": {}, "buf": []}
        attempts += 1

    for _ in range(n_inst):
        spawn()
    delivered: dict[str, list[int]] = {}
    for _round in range(3000):
        clock.t += 0.1
        for peer, m in core.outbox:
            if isinstance(m, M.Assign) and peer in alive:
                for w in m.works:
                    alive[peer]["work"][w.rid] = [len(w.prefix_ids), w.tokens_left]
            elif isinstance(m, M.Release) and peer in alive:
                for rid in m.rids:
                    alive[peer]["work"].pop(rid, None)
                core_msgs = [M.Released(rids=m.rids, tokens_generated=0)]
                for cm in core_msgs:
                    core.on_message(peer, cm)
            elif isinstance(m, M.GroupDone):
                for r in m.responses:
                    assert r.rid not in delivered, "duplicate delivery"
                    delivered[r.rid] = M.unpack_i32(r.ids).tolist()
        core.outbox.clear()
        for peer in list(alive):
            st_ = alive[peer]
            x = rng.random()
            if x < kill_p:
                del alive[peer]  # SIGKILL: silence
                continue
            if x < kill_p + warn_p:
                rids = list(st_["work"])
                core.on_message(peer, M.Draining(reason="warn"))
                core.on_message(peer, M.Released(rids=rids, tokens_generated=0))
                core.on_message(peer, M.Deregister(reason="warn", tokens_generated=0))
                del alive[peer]
                continue
            core.on_message(peer, M.Heartbeat(version=0, active=len(st_["work"]), tokens_generated=0))
            for rid, (pos, left) in list(st_["work"].items()):
                k = min(left, rng.randint(1, 3))
                ids = [_tok(rid, pos + i) for i in range(k)]
                fin = M.FINISH_LENGTH if k == left else M.FINISH_NONE
                core.on_message(peer, tokens(rid, pos, ids, finish=fin))
                if fin:
                    del st_["work"][rid]
                else:
                    st_["work"][rid] = [pos + k, left - k]
        if len(alive) < n_inst and rng.random() < 0.3:
            spawn()
        core.tick()
        if len(delivered) == groups * n:
            break
    assert len(delivered) == groups * n
    for rid, ids in delivered.items():
        assert ids == [_tok(rid, i) for i in range(max_new)]


def test_an_instance_declared_lost_is_told_so_and_can_return_as_a_new_attempt():
    """Regression (chaos run): the reserved engine, starved of CPU past the heartbeat deadline, was declared
    lost but kept heartbeating into the void; with no routable instance left the step stalled for 300 s."""
    core, clock = make()
    register(core, b"r", "reserved", kind="reserved")
    clock.t = 10.0
    core.tick()
    assert core.fleet.instances["reserved#0"].state == "suspect"
    clock.t = 10.0 + core.settings.instance_expiry_s + 1  # silent past the expiry: gone for good
    core.tick()
    assert "reserved#0" in core.fleet.ended and core.counters.instances_expired == 1
    core.outbox.clear()
    core.on_message(b"r", M.Heartbeat(version=0, active=0, tokens_generated=0))
    rej = sent(core, b"r", M.Reject)
    assert rej and "register as a new attempt" in rej[0].reason
    core.on_message(b"r", M.Heartbeat(version=0, active=0, tokens_generated=0))  # rate-limited: told once a second
    assert len(sent(core, b"r", M.Reject)) == 1
    register(core, b"r", "reserved", attempt=1, kind="reserved")
    submit(core, n=2)
    core.tick()
    assert sum(len(m.works) for m in sent(core, b"r", M.Assign)) == 2


def test_a_short_stall_makes_an_instance_suspect_and_it_returns_without_registering():
    """Invariant 7 / case L3: two routable instances stall past the heartbeat deadline: both leave routing at
    once, their work migrates to the third (tokens already received kept), they are not told to exit; when they
    speak again under their identity they are routable again (no Register), told to release what was taken from
    them, and what they still send for it is dropped as late."""
    core, clock = make(pending_limit=8)
    for peer in (b"a", b"b", b"c"):
        register(core, peer, peer.decode())
    submit(core, n=6, max_new=8)
    core.tick()
    mine = {p: [w.rid for m in sent(core, p, M.Assign) for w in m.works] for p in (b"a", b"b", b"c")}
    core.on_message(b"a", tokens(mine[b"a"][0], 0, [5, 6]))
    clock.t = 3.0  # a and b stalled (SIGSTOP); c keeps heartbeating
    core.on_message(b"c", M.Heartbeat(version=0, active=2, tokens_generated=0))
    core.outbox.clear()
    core.tick()
    assert [core.fleet.instances[k].state for k in ("a#0", "b#0", "c#0")] == ["suspect", "suspect", "ready"]
    assert not sent(core, b"a", M.Reject) and not sent(core, b"b", M.Reject)
    moved = {w.rid: w for m in sent(core, b"c", M.Assign) for w in m.works}
    assert moved[mine[b"a"][0]].prefix_ids == [5, 6]  # received tokens kept
    assert core.stats().instances_lost == 2 and core.counters.instances_suspected == 2
    clock.t = 9.0  # a 6 s stall ends: a speaks again
    core.outbox.clear()
    core.on_message(b"a", tokens(mine[b"a"][0], 2, [7]))  # generated before the stall: late now
    assert core.fleet.instances["a#0"].state == "ready" and core.book.requests[mine[b"a"][0]].n == 2
    assert core.counters.late_tokens == 1 and core.counters.instances_recovered == 1
    assert sorted(sent(core, b"a", M.Release)[0].rids) == sorted(mine[b"a"])
    assert not sent(core, b"a", M.Welcome) and core.counters.registrations == 3
    submit(core, step=1, n=1)  # new work reaches the returned instance again
    assert core.routable(core.fleet.instances["a#0"]) and not core.routable(core.fleet.instances["b#0"])


def test_a_suspect_that_missed_a_version_returns_pulling_and_is_told_the_latest():
    core, clock = make()
    register(core, b"a", "a")
    clock.t = 5.0
    core.tick()
    assert core.fleet.instances["a#0"].state == "suspect"
    core.on_message(TRAINER, M.SetVersion(version=1))  # published while a was silent
    core.outbox.clear()
    core.on_message(b"a", M.Heartbeat(version=0, active=0, tokens_generated=0))
    assert core.fleet.instances["a#0"].state == "pulling" and sent(core, b"a", M.NewVersion)[0].version == 1
    core.on_message(b"a", M.WeightsLoaded(version=1, checksum=1, nbytes=1, pull_s=0.1, load_s=0.1))
    assert core.routable(core.fleet.instances["a#0"])


def test_work_taken_from_a_suspect_is_not_given_back_to_it_before_it_released_it():
    """Regression (TCP reset test): a returning suspect was re-assigned the responses taken from it before it
    had processed their Release; its late Released then requeued the new assignment and the next Assign hit a
    'duplicate rid' in its engine until the step failed."""
    core, clock = make()
    register(core, b"a", "a")
    submit(core, n=2, max_new=8)
    core.tick()
    core.disconnected(b"a")
    clock.t = 0.5
    core.outbox.clear()
    core.on_message(b"a", M.Heartbeat(version=0, active=2, tokens_generated=3))  # reconnected
    core.tick()
    assert sent(core, b"a", M.Release) and not sent(core, b"a", M.Assign)  # held at the manager meanwhile
    core.on_message(b"a", M.Released(rids=["s0g0/0", "s0g0/1"], tokens_generated=3))
    core.tick()
    assert sorted(w.rid for w in sent(core, b"a", M.Assign)[0].works) == ["s0g0/0", "s0g0/1"]
    core.on_message(b"a", M.Released(rids=["s0g0/0"], tokens_generated=3))  # a duplicate, late confirmation
    assert core.book.requests["s0g0/0"].state == "queued"  # (a Released always means: I no longer run it)


def test_a_release_lost_with_a_connection_is_sent_again_and_the_work_stays_away_until_confirmed():
    """Regression (long chaos run: 'duplicate rid' until the step failed): an instance suspected twice — the
    Release after its first return lost with a reset — kept the first batch excluded and is told again."""
    core, clock = make()
    register(core, b"a", "a")
    register(core, b"b", "b")
    submit(core, n=4, max_new=8)
    core.tick()
    mine = sorted(w.rid for m in sent(core, b"a", M.Assign) for w in m.works)
    core.disconnected(b"a")
    core.on_message(b"a", M.Heartbeat(version=0, active=2, tokens_generated=0))  # back; its Release gets lost
    core.disconnected(b"a")  # reset again before it answered
    core.outbox.clear()
    core.on_message(b"a", M.Heartbeat(version=0, active=2, tokens_generated=0))
    assert sorted(sent(core, b"a", M.Release)[0].rids) == mine  # told again about the first batch
    assert core.fleet.instances["a#0"].releasing == set(mine)  # and none of it is dispatched to a before it confirms
    core.on_message(b"a", M.Released(rids=mine, tokens_generated=0))
    assert not core.fleet.instances["a#0"].releasing


@pytest.mark.parametrize("before,after", [("pulling", "pulling"), ("ready", "ready"), ("fenced", "fenced"),
                                          ("draining", "draining")])
def test_every_state_goes_suspect_on_silence_and_returns_to_where_it_was(before, after):
    core, clock = make()
    register(core, b"a", "a", version=None if before == "pulling" else 0)
    if before == "fenced":
        core.on_message(b"a", M.WeightsFailed(version=0, error="x"))
    if before == "draining":
        core.on_message(b"a", M.Draining(reason="preempted (SIGUSR2)"))
    assert core.fleet.instances["a#0"].state == before
    clock.t = 3.0
    core.tick()
    assert core.fleet.instances["a#0"].state == "suspect" and core.stats().instances_lost == 1
    core.on_message(b"a", M.Heartbeat(version=-1 if before == "pulling" else 0, active=0, tokens_generated=0))
    assert core.fleet.instances["a#0"].state == after and core.stats().instances_lost == 0
    if before == "pulling":  # a suspect that was still pulling is counted lost while pulling until it returns
        assert core.counters.suspected_while_pulling == core.counters.recovered_while_pulling == 1
    if before == "draining":
        core.on_message(b"a", M.Deregister(reason="preempted (SIGUSR2)", tokens_generated=0, cause="preempted"))
        assert "a#0" in core.fleet.ended and core.counters.instances_preempted_with_warning == 1


def test_instance_state_changes_only_along_the_state_machine():
    from rlboost_hpc.manager.state import InstanceState

    core, clock = make()
    register(core, b"a", "a")
    inst = core.fleet.instances["a#0"]
    core.fleet.set_state(inst, InstanceState.DRAINING)
    with pytest.raises(RuntimeError, match="no transition draining → ready"):
        core.fleet.set_state(inst, InstanceState.READY)


def test_balancer_moves_running_requests_beyond_a_learned_plateau_to_an_idle_instance():
    """Invariant 6 (MISSION §3): instance a's decode rate stops growing beyond batch ~8 (learned online from its
    own token stream); when b joins idle, a's running requests beyond its plateau are released and resume on b
    per sample (prefix kept, budget reduced), fewest generated tokens first."""
    from rlboost_hpc.policy.dispatch import Balancer

    clock = Clock()
    core = ManagerCore(clock=clock, balancer=Balancer(min_samples=4, min_buckets=3, cooldown_s=100.0), settings=ManagerSettings(
            pending_limit=32, heartbeat_s=0.25, heartbeat_timeout_s=1e9, balance_every_s=1.0))
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    register(core, b"a", "a", max_batch=32)
    pos: dict[str, int] = {}

    def stream(peer, rids, per_rid):  # each running request advances by per_rid tokens
        for r in rids:
            core.on_message(peer, tokens(r, pos.get(r, 0), [5] * per_rid, version=core.lineage.latest.number))
            pos[r] = pos.get(r, 0) + per_rid

    step = 0
    for batch in (2, 4, 8, 16, 24):  # plateau: 8+ requests decode at the same total rate (~80 tokens/s)
        submit(core, step=step, groups=1, n=batch, max_new=400, version=step)
        core.tick()
        rids = sorted(core.fleet.instances["a#0"].inflight)
        for _ in range(3):
            clock.t += 1.0
            stream(b"a", rids, max(1, 80 // max(batch, 8)) if batch >= 8 else 10)
            core.tick()
        for r in rids:  # finish this step's requests
            core.on_message(b"a", tokens(r, pos[r], [5], version=step, finish=M.FINISH_STOP))
        core.on_message(TRAINER, M.SetVersion(version=step + 1))
        core.on_message(b"a", M.WeightsLoaded(version=step + 1, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
        step += 1
        pos.clear()
    assert core.balancer.plateau("a#0") == 8
    submit(core, step=step, groups=1, n=24, max_new=400, version=step)
    core.tick()
    running = sorted(core.fleet.instances["a#0"].inflight)
    stream(b"a", running[:12], 2)  # some requests already produced tokens
    register(core, b"b", "b", max_batch=32, version=step)
    core.outbox.clear()
    clock.t += 1.0
    core.tick()
    (rel,) = sent(core, b"a", M.Release)
    # 24 vs 0: move 12 (never past equal loads), the 12 that have generated nothing yet (cheapest re-prefill)
    assert sorted(rel.rids) == running[12:] and core.counters.balancer_moves == 12
    core.on_message(b"a", M.Released(rids=rel.rids, tokens_generated=0))
    core.tick()
    works = [w for m in sent(core, b"b", M.Assign) for w in m.works]
    assert sorted(w.rid for w in works) == sorted(rel.rids)
    clock.t += 1.0
    core.outbox.clear()
    core.tick()  # 12 vs 12: no ping-pong
    assert not sent(core, b"a", M.Release) and not sent(core, b"b", M.Release)


def test_alive_reaches_every_live_instance_once_a_second_even_when_idle():
    """Idle instances hear from the manager (Alive with its epoch) at least every alive_every_s, so a quiet manager
    is never mistaken for a dead one during a long training step (agent manager_timeout_s = 10 s)."""
    core, clock = make()
    core.epoch = 3
    register(core, b"a", "a")
    register(core, b"b", "b")
    core.on_message(b"b", M.Deregister(reason="preempted", tokens_generated=0))
    for _ in range(5):
        core.outbox.clear()
        clock.t += 1.0
        core.on_message(b"a", M.Heartbeat(version=0, active=0, tokens_generated=0))
        core.tick()
        assert [m.epoch for m in sent(core, b"a", M.Alive)] == [3] and not sent(core, b"b", M.Alive)


def test_round_robin_ablation_takes_instances_in_turn():
    clock = Clock()
    core = ManagerCore(clock=clock, settings=ManagerSettings(
            pending_limit=8, heartbeat_s=0.25, heartbeat_timeout_s=2.0, dispatch_policy="round_robin"))
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    for p in (b"a", b"b", b"c"):
        register(core, p, p.decode())
    core.outbox.clear()
    submit(core, groups=1, n=6)
    core.tick()
    order = [(p, w.rid) for p, m in core.outbox if isinstance(m, M.Assign) for w in m.works]
    assert sorted(p for p, _ in order) == [b"a", b"a", b"b", b"b", b"c", b"c"]  # each in turn, twice


def test_request_states_change_only_along_the_transition_table():
    """A response's state changes in one place (Request.move): queued → running (with its instance) → done, never
    back from done, never running without an instance or owned while not running."""
    from rlboost_hpc.manager.state import REQUEST_TRANSITIONS, Request, RequestState as R

    req = Request(rid="s0g0/0", step=0, gid="s0g0", sample=0, prompt_ids=[1], max_new_tokens=4, temperature=1.0,
                  top_p=1.0, seed=0, stop_ids=[2], version=0)
    with pytest.raises(ValueError):
        req.move(R.RUNNING)  # running needs the instance that runs it
    req.move(R.RUNNING, "a#0")
    assert (req.state, req.instance) == (R.RUNNING, "a#0")
    req.move(R.QUEUED)  # its instance left: resumes elsewhere
    assert req.instance is None
    req.move(R.RUNNING, "b#0")
    req.move(R.DONE, finish_reason="stop")
    assert (req.state, req.instance, req.finish_reason) == (R.DONE, None, "stop")
    for new in R:
        with pytest.raises(ValueError):
            req.move(new, "a#0" if new == R.RUNNING else None)
    assert set(REQUEST_TRANSITIONS) == set(R)


def test_manager_settings_are_the_configs_and_the_core_takes_them_whole():
    """One home per default: a run with the built-in config gets ManagerSettings' defaults field by field (but
    relay and balancing, which a run turns on), every setting reaches the core, and bad input to the new key
    names it."""
    from dataclasses import asdict, replace

    from rlboost_hpc.config import ConfigError, load_config

    s = ManagerSettings.from_config(load_config(None, []))
    assert replace(s, relay_fanout=0, balance=False) == ManagerSettings()
    cfg = load_config(None, ["manager.pending_limit=7", "rollout.stream_every_tokens=3", "policy.dispatch=round_robin",
                             "weights.relay=false", "policy.balance=true", "manager.dispatch_silence_s=1.5"])
    s = ManagerSettings.from_config(cfg)
    assert (s.pending_limit, s.stream_every_tokens, s.dispatch_policy, s.relay_fanout, s.balance,
            s.dispatch_silence_s) == (7, 3, "round_robin", 0, True, 1.5)
    core = ManagerCore(clock=lambda: 0.0, settings=s)
    assert core.balancing and core.settings is s
    assert {k: getattr(core, k) for k in asdict(s) if hasattr(core, k)} == {
        k: v for k, v in asdict(s).items() if hasattr(core, k)}
    with pytest.raises(ConfigError, match="manager.dispatch_silence_s"):
        load_config(None, ["manager.dispatch_silence_s=0.3"])  # < 2 heartbeats of 0.25 s


def test_a_request_the_balancer_moved_goes_to_the_instance_it_chose_when_that_one_has_room():
    """A tail move (toward a faster idle instance) must not land on whichever idle instance JSQ picks first."""
    t = [0.0]
    core = ManagerCore(clock=lambda: t[0])
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0))
    for name in ("a", "b", "c"):
        core.on_message(name.encode(), M.Register(job_id=name, attempt=0, kind="preemptible", max_batch=4))
        core.on_message(name.encode(), M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=0.0, load_s=0.0))
    core.on_message(b"t", M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(
        gid="g", prompt_ids=[1, 2], n=1, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=1, stop_ids=[])]))
    core.tick()
    (rid,) = core.fleet.instances["a#0"].inflight  # JSQ: the first of three idle instances
    core.book.requests[rid].prefer = "c#0"
    core.table.requeue(rid, core.fleet.instances["a#0"], "released")
    core.dispatch()
    assert core.book.requests[rid].instance == "c#0" and core.book.requests[rid].prefer is None


def test_a_node_that_vanished_without_closing_its_connection_gets_no_new_work_before_its_deadline():
    """Issue 29 item 8 (regression): an instance silent past ``dispatch_silence_s`` (power loss,
    partition: no connection closes) stayed routable until the heartbeat deadline and JSQ kept giving it new work,
    which then waited there for the deadline. Now it keeps what it runs (it is not suspect yet) but gets nothing
    new; when it speaks again it gets work at once. Its silence is measured, and work handed to it after its last
    word is counted when it is suspected."""
    core, clock = make(pending_limit=4)  # heartbeat 0.25 s, deadline 2.0 s, no new work after 1.0 s of silence
    register(core, b"a", "a")
    register(core, b"b", "b")
    submit(core, step=0, groups=1, n=2)
    core.tick()
    first = {p: [w.rid for m in sent(core, p, M.Assign) for w in m.works] for p in (b"a", b"b")}
    assert len(first[b"a"]) == 1 and len(first[b"b"]) == 1
    clock.t = core.settings.dispatch_silence_s + 0.1  # a vanished at t = 0; b keeps heartbeating
    core.on_message(b"b", M.Heartbeat(version=0, active=1, tokens_generated=0))
    core.outbox.clear()
    submit(core, step=1, groups=2, n=4)  # more work: 8 requests, Θ = 4 each
    core.tick()
    assert core.fleet.instances["a#0"].state == "ready"  # still routable: not past its deadline
    assert not sent(core, b"a", M.Assign)
    assert sum(len(m.works) for m in sent(core, b"b", M.Assign)) == 3  # b fills up to Θ; the rest wait here
    clock.t = 2.5  # past the deadline: a is suspect, what it ran migrates
    core.on_message(b"b", M.Heartbeat(version=0, active=4, tokens_generated=0))
    core.tick()
    assert core.fleet.instances["a#0"].state == "suspect"
    assert core.counters.responses_assigned_to_vanished == 0  # everything it held was given before its last word


def test_before_the_fix_a_vanished_node_was_given_work_until_its_deadline_and_that_is_counted():
    """The counter that measured the fault: with the silence rule off (``dispatch_silence_s`` beyond the
    deadline) a vanished instance takes new work, and each such response is counted when the instance is
    suspected."""
    core, clock = make(pending_limit=4, dispatch_silence_s=100.0)
    register(core, b"a", "a")
    register(core, b"b", "b")
    clock.t = 1.5  # a vanished at t = 0; b heartbeats
    core.on_message(b"b", M.Heartbeat(version=0, active=0, tokens_generated=0))
    submit(core, step=0, groups=1, n=4)
    core.tick()
    given = sum(len(m.works) for m in sent(core, b"a", M.Assign))
    assert given == 2  # JSQ split the group between the two
    clock.t = 2.2
    core.on_message(b"b", M.Heartbeat(version=0, active=2, tokens_generated=0))
    core.tick()
    assert core.fleet.instances["a#0"].state == "suspect" and core.counters.responses_assigned_to_vanished == 2


def test_a_silent_instance_gets_work_again_as_soon_as_it_speaks_and_its_silence_is_measured():
    core, clock = make(pending_limit=4)
    register(core, b"a", "a")
    clock.t = core.settings.dispatch_silence_s + 0.2  # stopped (GC pause, a loaded host), not dead
    submit(core, step=0, groups=1, n=2)
    core.tick()
    assert not sent(core, b"a", M.Assign) and core.book.queue
    core.on_message(b"a", M.Heartbeat(version=0, active=0, tokens_generated=0))
    core.dispatch()
    assert sum(len(m.works) for m in sent(core, b"a", M.Assign)) == 2 and not core.book.queue
    silences = core.dist.silence_seconds
    assert silences.count == 1 and silences.total == pytest.approx(clock.t)
    core.on_message(b"a", M.Heartbeat(version=0, active=2, tokens_generated=0))  # no silence: not observed
    assert silences.count == 1


def test_ended_attempts_leave_the_registry_so_a_tick_scans_only_live_instances(monkeypatch):
    """Regression (bench_week): gone attempts stayed in the registry for good, so liveness, dispatch and stats —
    every 20 ms — scanned every attempt that ever ran (a tick at 256 live instances: 0.7 ms after 100 preemptions,
    2.4 ms after 1,000). Now a gone attempt leaves it; its identity is remembered, bounded, oldest first, and its
    re-registration is still rejected."""
    import rlboost_hpc.manager.fleet as fleet_mod

    monkeypatch.setattr(fleet_mod, "ENDED_KEPT", 50)
    core, clock = make()
    register(core, b"live", "live")
    for k in range(200):
        register(core, f"p{k}".encode(), "job", attempt=k)
        core.on_message(f"p{k}".encode(), M.Deregister(reason="preempted", tokens_generated=0, cause="preempted"))
    assert set(core.fleet.instances) == {"live#0"}
    assert len(core.fleet.ended) == 50 and "job#199" in core.fleet.ended and "job#0" not in core.fleet.ended
    assert core.counters.instances_preempted_with_warning == 200
    core.outbox.clear()
    register(core, b"again", "job", attempt=199, version=None)
    assert isinstance(sent(core, b"again")[0], M.Reject) and "already ended" in sent(core, b"again")[0].reason


def _reserved_and_a_worker_at_a_version_change(hold_s: float):
    """A reserved engine and a worker that loaded version 1 in 30 ms; version 2 is set and the reserved engine (shared
    memory: at once) loaded it; a step of 64 responses is submitted."""
    core, clock = make(pending_limit=64, arrival_hold_s=hold_s)
    register(core, b"r", "reserved", kind="reserved", max_batch=64)
    register(core, b"w", "w1", max_batch=64)
    core.on_message(TRAINER, M.SetVersion(version=1, checksum=1))
    clock.t = 0.03
    core.on_message(b"w", M.WeightsLoaded(version=1, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
    core.on_message(b"r", M.WeightsLoaded(version=1, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
    clock.t = 1.0
    core.on_message(TRAINER, M.SetVersion(version=2, checksum=1))
    core.on_message(b"r", M.WeightsLoaded(version=2, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
    submit(core, step=0, groups=8, n=8, version=2)
    core.dispatch()
    return core, clock


def test_an_instance_loading_the_new_version_finds_its_share_waiting_and_only_for_a_while():
    """Issue 55: a reserved engine maps a new version in milliseconds, a preemptible worker pulls it over the network.
    Without a share for the worker, every response of the step piled onto the reserved engine (the worker, routable
    30 ms later, found nothing and sat idle: harvested capacity bought nothing). The arriving instance's share waits
    for it — at most twice its previous load time (+ 50 ms), never past ``arrival_hold_s`` — then JSQ as before."""
    core, clock = _reserved_and_a_worker_at_a_version_change(1.0)
    # the worker's share waits
    assert (len(core.fleet.instances["reserved#0"].inflight), len(core.book.queue)) == (32, 32)
    clock.t = 1.03
    core.on_message(b"w", M.WeightsLoaded(version=2, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
    core.dispatch()
    assert len(core.fleet.instances["w1#0"].inflight) == 32 and not core.book.queue
    # a worker that does not come within twice its last load time (+ 50 ms) keeps nothing waiting
    core, clock = _reserved_and_a_worker_at_a_version_change(1.0)
    clock.t = 1.0 + 2 * 0.03 + 0.05 + 0.001
    core.dispatch()
    assert len(core.fleet.instances["reserved#0"].inflight) == 64 and not core.book.queue
    # never past arrival_hold_s; 0: never wait
    core, clock = _reserved_and_a_worker_at_a_version_change(0.0)
    assert len(core.fleet.instances["reserved#0"].inflight) == 64 and not core.book.queue
