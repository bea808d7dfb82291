"""Issue 50 item 1: a trainer resumed from an older checkpoint never strands instances holding a version it never made.

A weight version's identity is (number, whole-version checksum). The path of a version is checked at each trust
boundary: the trainer's ``SetVersion`` (manager: the current lineage, :class:`VersionLineage`), the manager's
``NewVersion`` / ``PullFrom`` (instance: it takes the announced version even when its number is lower), the
holder's manifest (puller: a version of that number with another checksum is refused before any byte moves), the
instance's ``WeightsLoaded`` (manager: routable only with a version of the current lineage) and the tokens (only a
routed instance's are accepted). The scenario of the issue: the trainer resumes from a checkpoint two versions back
while instances hold the newer ones.
"""
from __future__ import annotations

import time

import pytest
import torch

from rlboost_hpc.manager.state import VersionLineage
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.weights.source import PulledVersion
from test_manager_core import TRAINER, make, register, sent, tokens

RESUMED = b"trainer-resumed"
OLD = {v: 1000 + v for v in range(6)}  # checksums of the first trainer's versions
NEW = {v: 2000 + v for v in range(6)}  # ... of the resumed trainer's (from version 3 on: other weights)
NEW[2] = OLD[2]  # the checkpoint of version 2 holds the bytes version 2 had


def loaded(version: int, checksum: int) -> M.WeightsLoaded:
    return M.WeightsLoaded(version=version, checksum=checksum, nbytes=1, pull_s=0.0, load_s=0.0)


def first_trainer_at_version_4():
    """A manager whose trainer made versions 0–4 (with checksums); instance a holds 4, b holds 3 (still pulling 4)."""
    core, clock = make()
    core.on_message(TRAINER, M.SetVersion(version=0, checksum=OLD[0]))
    register(core, b"a", "a", version=None)
    register(core, b"b", "b", version=None)
    for v in range(1, 5):
        core.on_message(TRAINER, M.SetVersion(version=v, checksum=OLD[v]))
        core.on_message(b"a", loaded(v, OLD[v]))
        if v < 4:
            core.on_message(b"b", loaded(v, OLD[v]))
    core.outbox.clear()
    return core, clock


def test_the_lineage_keeps_number_and_checksum_and_a_resume_cuts_what_lies_above_it():
    lin = VersionLineage(window=1)
    for v in range(5):
        lin.make_current(VersionId(v, OLD[v]))
    V = VersionId
    assert lin.holds(V(4, OLD[4])) and lin.holds(V(3, OLD[3])) and not lin.holds(V(2, OLD[2]))  # (window of 1)
    assert not lin.holds(VersionId(4, 7))  # the number alone is not the version
    lin.make_current(VersionId(2, NEW[2]))  # a trainer resumed two versions back
    assert lin.holds(V(2, NEW[2])) and not lin.holds(V(4, OLD[4])) and not lin.holds(V(3, OLD[3]))
    lin.make_current(VersionId(3, NEW[3]))
    assert lin.holds(V(3, NEW[3])) and not lin.holds(V(3, OLD[3])) and lin.holds(V(2, NEW[2]))
    zero = VersionLineage()
    zero.make_current(VersionId(5, 0))  # a trainer that gives no checksum: the number names the version
    assert zero.holds(VersionId(5, 123)) and not zero.holds(VersionId(4, 0))


def test_the_lineage_owns_the_latest_version_and_names_it_by_number_and_checksum():
    """The latest version lives in the lineage, one value (was a number on the manager beside a checksum looked up in
    the lineage): none before the first SetVersion, the newest made current after, a resume's lower number too."""
    lin = VersionLineage(window=1)
    assert lin.latest == VersionId(-1, 0) and not lin.is_latest(VersionId(-1, 0))
    for v in range(5):
        lin.make_current(VersionId(v, OLD[v]))
    assert lin.latest == VersionId(4, OLD[4]) and lin.is_latest(VersionId(4, OLD[4]))
    assert not lin.is_latest(VersionId(4, 7)) and not lin.is_latest(VersionId(3, OLD[3]))  # held, not the latest
    lin.make_current(VersionId(2, NEW[2]))
    assert lin.latest == VersionId(2, NEW[2]) and not lin.is_latest(VersionId(4, OLD[4]))


def test_a_version_id_names_the_same_weights_by_number_and_known_checksums():
    """Issue 56: one rule for "the same version" wherever a version travels (the agent's staleness, the manager's
    repeat of SetVersion, a restored journal): the number, and the checksums where both are known."""
    assert VersionId(3, 7).same_weights(VersionId(3, 7)) and VersionId(3, 0).same_weights(VersionId(3, 7))
    assert VersionId(3, 7).same_weights(VersionId(3, 0)) and not VersionId(3, 7).same_weights(VersionId(3, 8))
    assert not VersionId(2, 7).same_weights(VersionId(3, 7))
    m = M.SetVersion(version=3, checksum=7)
    assert M.decode(M.encode(m)).identity == VersionId(3, 7) == m.identity  # (the wire keeps two flat fields)


def test_a_trainer_resumed_two_versions_back_strands_no_instance():
    """The issue's test, at the manager: before the fix instance a (holding 4) stayed routable after the resumed
    trainer made version 2 current (4 ≥ 2), was given version-2 work, had its tokens refused as off-version and
    was fenced; it ignored version 2 (a lower number) and every later one until the numbers passed it again."""
    core, _ = first_trainer_at_version_4()
    a, b = core.fleet.instances["a#0"], core.fleet.instances["b#0"]
    assert core.routable(a) and not core.routable(b)
    core.on_message(RESUMED, M.TrainerHello(weights_endpoint="tcp://w2", model_config={}))
    core.on_message(RESUMED, M.SetVersion(version=2, checksum=NEW[2], cid=1))
    assert sent(core, RESUMED, M.Ok)[-1].cid == 1 and core.lineage.latest == VersionId(2, NEW[2])
    # trainer → manager → instance: both are told the resumed trainer's version, with its identity
    for peer in (b"a", b"b"):
        nv = sent(core, peer, M.NewVersion)[-1]
        assert (nv.version, nv.checksum) == (2, NEW[2])
    assert not core.routable(a) and not core.routable(b)  # neither holds a version of the current lineage
    core.on_message(RESUMED, M.SubmitStep(step=0, version=2, groups=[M.GroupSpec(
        gid="s0g0", prompt_ids=[1, 5, 6], n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0, stop_ids=[1])]))
    core.tick()
    assert not sent(core, b"a", M.Assign) and not sent(core, b"b", M.Assign)  # nothing goes to them
    # b's pull of the old version 4 ends now: of no lineage the manager routes to (counted), still not routable
    core.on_message(b"b", loaded(4, OLD[4]))
    core.tick()
    assert not core.routable(b) and core.counters.weight_loads_of_another_lineage == 1 and not sent(core, b"b", M.Assign)
    # a takes version 2 (its number is lower than what it held) and serves the step
    core.on_message(b"a", loaded(2, NEW[2]))
    core.tick()
    works = [w for m in sent(core, b"a", M.Assign) for w in m.works]
    assert core.routable(a) and len(works) == 2 and {w.version for w in works} == {2}
    for w in works:
        core.on_message(b"a", tokens(w.rid, 0, [7, 1], version=2, finish=M.FINISH_STOP))
    assert core.counters.off_version_tokens_rejected == 0 and core.counters.instances_fenced == 0
    assert [g.gid for g in sent(core, RESUMED, M.GroupDone)] == ["s0g0"]
    # the resumed trainer's version 3 is not the first trainer's version 3, nor is its 4 the one b holds
    core.on_message(RESUMED, M.AckGroup(gid="s0g0"))
    core.on_message(RESUMED, M.SetVersion(version=3, checksum=NEW[3], cid=2))
    core.on_message(RESUMED, M.SetVersion(version=4, checksum=NEW[4], cid=3))
    assert sent(core, RESUMED, M.Ok)[-1].cid == 3
    assert not core.routable(b)  # b holds (4, OLD[4]): the number of the latest, not its identity
    assert (sent(core, b"b", M.NewVersion)[-1].version, sent(core, b"b", M.NewVersion)[-1].checksum) == (4, NEW[4])
    core.on_message(b"b", loaded(4, NEW[4]))
    assert core.routable(b) and core.counters.weight_checksum_mismatches == 0


def test_the_same_trainer_cannot_make_the_current_version_current_again_with_other_weights():
    core, _ = first_trainer_at_version_4()
    core.on_message(TRAINER, M.SetVersion(version=4, checksum=OLD[4], cid=7))  # a resent call: fine
    assert sent(core, TRAINER, M.Ok)[-1].cid == 7
    core.on_message(TRAINER, M.SetVersion(version=4, checksum=99, cid=8))
    err = sent(core, TRAINER, M.Error)[-1]
    assert err.cid == 8 and "checksum" in err.error and core.lineage.latest.checksum == OLD[4]


def test_a_resumed_trainer_at_the_latest_number_with_other_weights_is_a_new_lineage():
    """Resumed at the number the instances hold, but with other weights (another checksum): not the same version."""
    core, _ = first_trainer_at_version_4()
    core.on_message(RESUMED, M.TrainerHello(weights_endpoint="tcp://w2", model_config={}))
    core.on_message(RESUMED, M.SetVersion(version=4, checksum=NEW[4], cid=1))
    assert not core.routable(core.fleet.instances["a#0"])
    assert (sent(core, b"a", M.NewVersion)[-1].version, sent(core, b"a", M.NewVersion)[-1].checksum) == (4, NEW[4])


def test_a_restarted_manager_routes_only_to_the_resumed_trainers_lineage(tmp_path):
    """The production path: the trainer job died with its manager; the restarted manager restores version 4 from
    its work log, the instance re-registers keeping (4, OLD[4]) — then the resumed trainer makes version 2 current."""
    from test_manager_restart import commit, feed, journaled, restarted

    core, clock, log = journaled(tmp_path)
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    for v in range(5):
        feed(core, TRAINER, M.SetVersion(version=v, checksum=OLD[v]))
    commit(core, log)
    log.close()
    new, _, log = restarted(tmp_path)
    assert new.lineage.latest.number == 4 and new.lineage.latest.checksum == OLD[4]
    register(new, b"a", "a", version=None)
    feed(new, b"a", loaded(4, OLD[4]))  # its weights are the restored version's: kept
    assert new.routable(new.fleet.instances["a#0"])
    feed(new, RESUMED, M.TrainerHello(weights_endpoint="tcp://w2", model_config={}))
    feed(new, RESUMED, M.SetVersion(version=2, checksum=NEW[2]))
    assert not new.routable(new.fleet.instances["a#0"])
    assert (sent(new, b"a", M.NewVersion)[-1].version, sent(new, b"a", M.NewVersion)[-1].checksum) == (2, NEW[2])
    commit(new, log)
    log.close()
    again, _, _ = restarted(tmp_path, epoch=3)  # the lineage survives a restart of the manager
    assert again.lineage.latest.number == 2 and again.lineage.latest.checksum == NEW[2]
    assert again.lineage.holds(VersionId(2, NEW[2])) and not again.lineage.holds(VersionId(4, OLD[4]))


# ---------------------------------------------------------------- the instance (rollout agent)
def _agent_holding(version: int, checksum: int, source):
    """An agent whose engine holds (``version``, ``checksum``) in the current manager epoch; pulls go to ``source``
    (``fn(version, checksum) -> PulledVersion``)."""
    from test_agent_unit import _Frames, _HoldingEngine

    from rlboost_hpc.rollout.agent import RolloutAgent

    class Weights:
        def pull(self, endpoint, v, *, peers=(), keys=None, shards="", checksum=0, adapter=None):
            return source(v, checksum)

    a = RolloutAgent("tcp://127.0.0.1:1", "job", 0, weights=Weights())
    a.link = _Frames()
    a.engine = _HoldingEngine()
    a.engine.version, a.engine.weights_checksum = version, checksum
    a._handle(M.Welcome(instance="job#0", latest_version=version, weights_endpoint="tcp://w", model_config={},
                        heartbeat_s=1.0, stream_every_tokens=4, stream_every_s=0.05, epoch=0, latest_checksum=checksum))
    a.engine_epoch = 0
    a.link.msgs.clear()
    return a


def _settle(a, until) -> None:
    deadline = time.monotonic() + 5
    while not until():
        a.weight_slot.step()
        time.sleep(0.01)
        assert time.monotonic() < deadline


def test_an_instance_takes_the_resumed_trainers_version_though_its_number_is_lower():
    """Before the fix the agent ignored NewVersion(2) while holding 4 (``version < want_version``) — and later a
    NewVersion(4) of the resumed trainer too, its number being the one it held: stranded until 5."""
    asked: list[tuple[int, int]] = []

    def source(v, checksum):
        asked.append((v, checksum))
        return PulledVersion({}, checksum=NEW[v], nbytes=1)

    a = _agent_holding(4, OLD[4], source)
    a.weight_slot.step()
    assert a.weight_slot._pull is None  # it holds the latest
    a._handle(M.NewVersion(version=2, checksum=NEW[2]))
    _settle(a, lambda: a.engine.version == 2)
    a._handle(M.NewVersion(version=3, checksum=NEW[3]))
    _settle(a, lambda: a.engine.version == 3)
    a._handle(M.NewVersion(version=4, checksum=NEW[4]))  # the number it held before, other weights
    _settle(a, lambda: a.engine.weights_checksum == NEW[4])
    assert asked == [(2, NEW[2]), (3, NEW[3]), (4, NEW[4])]  # the announced identity goes with every pull
    got = [(m.version, m.checksum) for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    assert got == [(2, NEW[2]), (3, NEW[3]), (4, NEW[4])]


def test_a_pull_of_a_version_above_the_resumed_trainers_is_dropped_not_loaded():
    """A pull of the old version 5 is under way when the resumed trainer's version 2 is announced: it is dropped when
    it ends (no trainer will ever route to it) and version 2 is pulled next."""
    import threading

    gate = threading.Event()

    def source(v, checksum):
        if v == 5:
            gate.wait(5)
            return PulledVersion({}, checksum=OLD[5], nbytes=1)
        return PulledVersion({}, checksum=NEW[v], nbytes=1)

    a = _agent_holding(4, OLD[4], source)
    a._handle(M.NewVersion(version=5, checksum=OLD[5]))
    a.weight_slot.step()
    assert a.weight_slot._pull is not None
    a._handle(M.NewVersion(version=2, checksum=NEW[2]))
    gate.set()
    _settle(a, lambda: a.engine.version == 2)
    got = [(m.version, m.checksum) for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    assert got == [(2, NEW[2])]


def test_a_re_registration_does_not_claim_a_version_of_the_same_number_with_other_weights():
    """Welcome names the version the engine holds by number but with another checksum: the agent pulls, it does not
    report the weights it holds as that version (the manager would fence and drain it)."""
    a = _agent_holding(4, OLD[4], lambda v, c: PulledVersion({}, checksum=NEW[v], nbytes=1))
    a._handle(M.Welcome(instance="job#0", latest_version=4, weights_endpoint="tcp://w", model_config={},
                        heartbeat_s=1.0, stream_every_tokens=4, stream_every_s=0.05, epoch=0, latest_checksum=NEW[4]))
    assert not [m for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    _settle(a, lambda: a.engine.weights_checksum == NEW[4])
    assert [(m.version, m.checksum) for m in a.link.msgs if isinstance(m, M.WeightsLoaded)] == [(4, NEW[4])]


# ---------------------------------------------------------------- the holder's manifest (puller)
def test_the_puller_refuses_a_holders_version_of_another_checksum_before_any_byte_moves():
    from rlboost_hpc.weights.puller import WeightPuller, WeightTransferError
    from rlboost_hpc.weights.server import WeightServer

    server = WeightServer().start()
    try:
        server.publish(2, {"w": torch.arange(4096, dtype=torch.float32)}, dtype=torch.float32)
        right = server.manifest(2).checksum
        got = WeightPuller(server.endpoint, timeout_s=10).pull(2, checksum=int(right))
        assert got.checksum == right
        with pytest.raises(WeightTransferError, match="another trainer lineage") as e:
            WeightPuller(server.endpoint, timeout_s=10).pull(2, checksum=int(right) ^ 1)
        assert e.value.phase == "manifest"
    finally:
        server.close()


def test_an_adapter_pull_is_checked_against_the_adapter_on_the_runs_base_before_any_byte_moves():
    """Issue 56: a LoRA run's version identity is the adapter's checksum combined with the base's; the pull checks it
    (it was switched off for adapters, ``checksum = 0``): an adapter of another lineage — or one for another base —
    is refused at the manifest, by the real puller, the trainer's publisher and the shared-memory source alike."""
    from rlboost_hpc.protocol.adapter import AdapterSpec
    from rlboost_hpc.weights.puller import WeightPuller, WeightTransferError
    from rlboost_hpc.weights.server import WeightServer
    from rlboost_hpc.weights.source import identity

    spec = AdapterSpec(rank=4, alpha=8.0, targets=["q_proj"], base_checksum=0xBA5E, base_bytes=1, base_dtype="float32")
    other_base = AdapterSpec(rank=4, alpha=8.0, targets=["q_proj"], base_checksum=0xBA5F, base_bytes=1,
                             base_dtype="float32")
    server = WeightServer().start()
    try:
        server.publish(3, {"lora_A": torch.arange(512, dtype=torch.float32)}, dtype=torch.float32)
        own = int(server.manifest(3).checksum)
        want = identity(own, spec)
        assert want != own and want == spec.version_checksum(own)
        got = WeightPuller(server.endpoint, timeout_s=10).pull(3, checksum=want, adapter=spec)
        assert got.checksum == own
        for wrong in (want ^ 1, identity(own, other_base), own):  # another lineage; another base; the bare adapter
            with pytest.raises(WeightTransferError, match="another trainer lineage") as e:
                WeightPuller(server.endpoint, timeout_s=10).pull(3, checksum=wrong, adapter=spec)
            assert e.value.phase == "manifest"
    finally:
        server.close()


# ---------------------------------------------------------------- end to end, real processes
@pytest.mark.integration
def test_a_rollout_job_holding_newer_versions_serves_the_trainer_resumed_two_versions_back(stories260k_hf_dir,
                                                                                           tmp_path):
    """The issue's test with real processes, in the order a resumed trainer job runs: its manager restores version
    4 from the work log and writes endpoints.json before the trainer has loaded its checkpoint; the rollout job (a
    worker process with ``--run-dir``, holding version 4) registers there and keeps its weights (the checksum is
    the restored version's). Then the trainer, resumed from its checkpoint of version 2, says hello from a new weight
    server and makes version 2 current. Before the fix the instance stayed routable with version 4, ignored version
    2 (a lower number), and would have pulled from the dead weight server anyway: stranded. Now it takes version 2
    from the new server, then the resumed trainer's own version 3, and both steps train on their own versions: no
    token refused, no instance fenced."""
    import subprocess
    import sys

    from _util import close_all, load_hf_dir
    from rlboost_hpc.manager.service import spawn_manager
    from rlboost_hpc.manager.settings import ManagerSettings
    from rlboost_hpc.rundir import RunDir
    from rlboost_hpc.trainer.client import ManagerClient
    from rlboost_hpc.weights.server import WeightServer

    arch, sd = load_hf_dir(stories260k_hf_dir)
    weights = {v: {k: t + 0.001 * v for k, t in sd.items()} for v in range(5)}  # version v of the first trainer
    params = ManagerSettings(pending_limit=32, heartbeat_s=0.1, heartbeat_timeout_s=2.0, max_attempts=3,
                             stream_every_tokens=2, stream_every_s=0.02)
    procs, clients, servers, w = [], [], [], None

    def start_job(restore: bool):  # a trainer job's services: manager (restored from the work log), weight server
        server = WeightServer(chunk_bytes=64 << 10).start()
        servers.append(server)
        mproc, endpoint, _ = spawn_manager(params, journal_path=str(tmp_path / "manager-journal.jsonl"),
                                           run_id="test", work_log=str(tmp_path / "work.log"), restore=restore)
        procs.append(mproc)
        client = ManagerClient(endpoint, alive=mproc.is_alive)
        clients.append(client)
        RunDir(tmp_path).write_endpoints(endpoint, server.endpoint, run_id="test")
        return mproc, client, server

    def hello(client, server, versions: dict[int, dict]) -> None:  # the trainer, once its checkpoint is loaded
        client.call(M.TrainerHello(weights_endpoint=server.endpoint, model_config=arch.to_hf_dict()))
        for v, sdv in versions.items():
            server.publish(v, sdv, dtype=torch.float32)
            client.call(M.SetVersion(version=v, checksum=int(server.manifest(v).checksum)))

    def wait(client, pred, timeout=90.0):
        deadline = time.monotonic() + timeout
        while True:
            st = client.stats()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"not reached; stats {st}"
            time.sleep(0.1)

    def serving(version: int):
        return lambda st: st.routable_preemptible == 1 and [i.version for i in st.instances.values()
                                                             if i.kind == "preemptible"] == [version]

    def step(client, step_no: int, version: int) -> None:
        spec = M.GroupSpec(gid=f"s{step_no}", prompt_ids=[1, 403, 407, 261, 378], n=2, max_new_tokens=8,
                           temperature=1.0, top_p=1.0, seed=step_no, stop_ids=[])
        client.call(M.SubmitStep(step=step_no, version=version, groups=[spec]))
        ev = client.next_event(90)
        assert isinstance(ev, M.GroupDone) and len(ev.responses) == 2, ev
        for r in ev.responses:
            assert set(M.expand_version_runs(r.version_runs).tolist()) == {version}
        client.send(M.AckGroup(gid=spec.gid))

    try:
        mproc, client, server = start_job(restore=False)
        hello(client, server, {v: weights[v] for v in range(5)})
        w = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.rollout.worker", "--run-dir", str(tmp_path),
                              "--job-id", "job7", "--manager-timeout", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait(client, serving(4))
        mproc.kill()  # the trainer job crashed: manager and weight server gone
        mproc.join(5)
        server.close()
        mproc2, client2, server2 = start_job(restore=True)
        wait(client2, serving(4))  # registered with the restored manager, its weights kept
        hello(client2, server2, {2: weights[2]})  # resumed from its checkpoint of version 2: two versions back
        st = wait(client2, serving(2))
        assert st.weight_load_failures == 0 and st.off_version_tokens_rejected == 0
        step(client2, 0, 2)
        third = {k: t - 0.002 for k, t in weights[2].items()}  # the resumed trainer's own version 3
        server2.publish(3, third, dtype=torch.float32)
        client2.call(M.SetVersion(version=3, checksum=int(server2.manifest(3).checksum)))
        wait(client2, serving(3))
        step(client2, 1, 3)
        st = client2.stats()
        assert st.off_version_tokens_rejected == 0 and st.instances_fenced == 0 and st.weight_checksum_mismatches == 0
        assert w.poll() is None
    finally:
        if w is not None:
            w.kill()
            out = w.communicate(timeout=10)[0]
            print(out[-3000:])
        close_all(clients, procs, servers)
