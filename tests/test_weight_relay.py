"""Peer relay: instances holding the latest version serve its bytes to others; the manifest always comes from the
trainer, so a peer that dies, stalls, changes version or lies costs a failover, never a wrong or mixed load.

Real weight servers (trainer and relay holders) and pullers on loopback sockets; the tree is the pure RelayTree.
"""
from __future__ import annotations

import random
import socket

import pytest
import torch
from _util import wait_for
from hypothesis import given, settings, strategies as st

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.policy.relay import TRAINER, RelayTree, Source
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.rollout.remote_weights import RemoteWeights
from rlboost_hpc.weights.puller import WeightPuller
from rlboost_hpc.weights.server import WeightServer

CHUNK = 1 << 14


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(128, 128, generator=g) for i in range(6)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.fixture
def trainer():
    with WeightServer(chunk_bytes=CHUNK) as s:
        yield s


def relay_of(trainer: WeightServer, version: int) -> WeightServer:
    """A relay holder that pulled ``version`` from the trainer and holds it (like an instance would)."""
    got = WeightPuller(trainer.endpoint, timeout_s=10).pull(version)
    r = WeightServer(keep_versions=1, delta=False).start()
    r.hold(got.manifest, got.buffer, got.delta_payloads)  # the held version keeps the buffer alive
    return r


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


def served_count(server: WeightServer, want: int, key: str = "bytes_served") -> int:
    """``server.stats[key]`` once it has reached ``want`` (a holder counts a chunk after its send returns, so a
    puller can hold the bytes a moment before the holder has counted them)."""
    wait_for(lambda: server.stats[key] >= want, 5, f"the holder's {key} to reach {want}", interval=0.01)
    return server.stats[key]


def test_a_peer_serves_the_bytes_and_the_trainer_only_the_manifest(trainer):
    trainer.publish(0, model())
    peer = relay_of(trainer, 0)
    try:
        served = served_count(trainer, trainer.manifest(0).total_bytes)  # the relay's own pull
        got = WeightPuller(trainer.endpoint, timeout_s=10).pull(0, peers=[peer.endpoint])
        assert equal(got.state_dict, trainer.local_state_dict(0))
        assert got.phases["peer_bytes"] == got.nbytes and got.phases["peer_failovers"] == 0
        assert served_count(peer, got.nbytes) == got.nbytes
        assert trainer.stats["bytes_served"] == served  # nothing more from the trainer
    finally:
        peer.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_holder_killed_at_a_random_chunk_the_pull_resumes_elsewhere_at_that_chunk(trainer, seed):
    trainer.publish(0, model())
    first, backup = relay_of(trainer, 0), relay_of(trainer, 0)
    n = len(trainer.manifest(0).chunk_checksums)
    kill_at = random.Random(seed).randrange(1, n - 1)
    calls = [0]

    def die(v, i, payload):  # the holder's process is SIGKILLed: after this chunk it never answers again
        calls[0] += 1
        if calls[0] == kill_at:
            first._stop.set()
        return payload

    first._payload_hook = die
    try:
        got = WeightPuller(trainer.endpoint, streams=1, window=1, timeout_s=10, peer_timeout_s=0.5).pull(
            0, peers=[first.endpoint, backup.endpoint])
        assert equal(got.state_dict, trainer.local_state_dict(0))
        assert got.phases["peer_failovers"] == 1
        assert got.phases["peer_bytes"] == got.nbytes  # the trainer sent no chunk: what first served was kept
        assert first.stats["chunks_served"] == kill_at
    finally:
        first.close()
        backup.close()


def test_a_holder_that_moves_to_a_newer_version_mid_serve_fails_the_pull_over_cleanly(trainer):
    trainer.publish(0, model(0))
    peer = relay_of(trainer, 0)
    trainer.publish(1, model(1))
    newer = WeightPuller(trainer.endpoint, timeout_s=10).pull(1)
    calls = [0]

    def move(v, i, payload):
        calls[0] += 1
        if calls[0] == 3:  # the instance pulled version 1 and serves that now
            peer.hold(newer.manifest, newer.buffer)
        return payload

    peer._payload_hook = move
    try:
        got = WeightPuller(trainer.endpoint, streams=1, window=1, timeout_s=10).pull(0, peers=[peer.endpoint])
        assert got.version == 0 and equal(got.state_dict, trainer.local_state_dict(0))  # never a mix
        assert got.phases["peer_failovers"] == 1
    finally:
        peer.close()


def test_a_holder_sending_wrong_bytes_is_abandoned(trainer):
    trainer.publish(0, model())
    peer = relay_of(trainer, 0)
    peer._payload_hook = lambda v, i, payload: bytes(len(payload))  # zeros instead of weights
    try:
        got = WeightPuller(trainer.endpoint, timeout_s=10).pull(0, peers=[peer.endpoint])
        assert equal(got.state_dict, trainer.local_state_dict(0))
        assert got.phases["peer_failovers"] == 1 and got.phases["peer_bytes"] > 0
    finally:
        peer.close()


def test_an_unreachable_peer_falls_back_to_the_trainer_within_its_deadline(trainer):
    trainer.publish(0, model())
    got = WeightPuller(trainer.endpoint, timeout_s=10, peer_timeout_s=0.3).pull(0, peers=[closed_port()])
    assert equal(got.state_dict, trainer.local_state_dict(0))
    assert got.phases["peer_failovers"] == 1 and got.seconds < 3


def test_a_peer_relays_the_delta_payloads_it_applied(trainer):
    sd = model()
    trainer.publish(0, sd)
    a, b = (RemoteWeights(2, 2, 10.0) for _ in range(2))
    ep_a = a.serve_relay("127.0.0.1", "127.0.0.1")
    try:
        a.pull(trainer.endpoint, 0)
        b.pull(trainer.endpoint, 0)
        sd = {k: v.clone() for k, v in sd.items()}
        sd["layers.2.w"][3, :50] += 0.5
        trainer.publish(1, sd)
        a.pull(trainer.endpoint, 1)  # a pulls the delta from the trainer and now relays version 1
        full = served_count(trainer, 2 * trainer.manifest(0).total_bytes)  # a's and b's first pulls
        delta = served_count(trainer, trainer.delta_nbytes(1), "delta_bytes_served")  # a's delta pull
        got = b.pull(trainer.endpoint, 1, peers=[ep_a])
        assert equal(dict(got.state_dict), trainer.local_state_dict(1))
        assert got.phases["peer_bytes"] == trainer.delta_nbytes(1)  # b got the delta, from a
        wait_for(lambda: a.relay_stats["delta_bytes_served"] >= trainer.delta_nbytes(1), 5, "the relay's count")
        assert a.relay_stats["delta_bytes_served"] == trainer.delta_nbytes(1)
        assert (trainer.stats["bytes_served"], trainer.stats["delta_bytes_served"]) == (full, delta)
    finally:
        a.close()
        b.close()


def test_remote_weights_withdraws_what_it_relays_before_the_buffer_changes(trainer):
    trainer.publish(0, model(0))
    w = RemoteWeights(2, 2, 10.0)
    ep = w.serve_relay("127.0.0.1", "127.0.0.1")
    try:
        w.pull(trainer.endpoint, 0)
        assert w._relay.versions == [0]
        trainer.publish(1, model(1))
        trainer._payload_hook = lambda v, i, p: (w._relay.versions == [] or pytest.fail("still relayed")) and p
        w.pull(trainer.endpoint, 1)
        assert w._relay.versions == [1]
        got = WeightPuller(trainer.endpoint, timeout_s=10).pull(1, peers=[ep])
        assert equal(got.state_dict, trainer.local_state_dict(1)) and got.phases["peer_bytes"] == got.nbytes
    finally:
        w.close()


# ---------------------------------------------------------------- the tree (pure)
def test_tree_fans_out_from_the_trainer_then_from_holders():
    t = RelayTree(fanout=4, trainer_fanout=2)
    srcs = {p: t.want(p) for p in "abcdefgh"}
    assert [p for p, s in srcs.items() if not s.wait] == ["a", "b"] and srcs["a"] == Source()
    assert t.waiting == list("cdefgh")
    handed = t.done("a", "tcp://a")
    assert [p for p, _ in handed] == ["c", "d", "e", "f"]  # 4 on a; the trainer already sent its 2 copies
    assert all(s.peers[0] == "tcp://a" for p, s in handed)
    assert t.waiting == ["g", "h"] and t.load("a") == 4 and t.load(TRAINER) == 1
    assert [p for p, _ in t.done("b", "tcp://b")] == ["g", "h"] and t.trainer_used == 2


def test_tree_gives_a_backup_holder_and_drops_a_holder_that_leaves():
    t = RelayTree(fanout=1, trainer_fanout=1)
    t.want("a")
    t.done("a", "tcp://a")
    t.want("b")
    t.done("b", "tcp://b")
    s = t.want("c")
    assert s.peers == ("tcp://a", "tcp://b")
    handed = t.gone("a")  # c fails over by itself; a's slot is gone with it
    assert handed == [] and "a" not in t.holders and "c" not in t.source_of
    assert t.want("d").peers == ("tcp://b",)


def test_a_holder_that_wants_the_version_again_is_not_its_own_source():
    """Found by the fuzz test below: the only holder restarts and wants the version again; it used to wait for
    itself (no other holder, no pull in flight) forever. It holds nothing now: the trainer serves it."""
    t = RelayTree(fanout=1, trainer_fanout=1)
    t.want("i0")
    t.done("i0", "tcp://i0")
    assert t.want("i0") == Source() and t.source_of["i0"] == TRAINER and "i0" not in t.holders
    assert not t.waiting


def test_relay_off_sends_everyone_to_the_trainer_at_once():
    t = RelayTree(fanout=0)
    assert all(t.want(p) == Source() for p in "abcdefgh") and not t.waiting


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["want", "done", "gone"]), st.integers(0, 11)), max_size=80),
       fanout=st.integers(1, 4), trainer_fanout=st.integers(1, 3))
def test_tree_never_exceeds_its_fanouts_and_never_strands_a_waiting_puller(ops, fanout, trainer_fanout):
    t = RelayTree(fanout=fanout, trainer_fanout=trainer_fanout)
    for op, k in ops:
        key = f"i{k}"
        if op == "want":
            t.want(key)
        elif op == "done":
            t.done(key, f"tcp://{key}")
        else:
            t.gone(key)
        assert all(t.load(h) <= fanout for h in t.holders)
        assert all(p in t.serving[s] for p, s in t.source_of.items())
        assert not (set(t.waiting) & set(t.source_of))
        assert t.trainer_used >= t.load(TRAINER)
        if t.waiting:  # someone waits only while a pull is in flight (its end hands capacity out) ...
            assert any(t.serving.values())
            assert all(t.load(h) == fanout for h in t.holders if h != t.waiting[0])  # ... and holders are full


def test_the_trainer_serves_beyond_its_share_only_when_nothing_else_can_progress():
    t = RelayTree(fanout=4, trainer_fanout=1)
    t.want("a")
    assert t.want("b").wait
    t.done("a", "")  # a finished but cannot relay (its relay failed to bind): b would wait forever
    assert t.source_of["b"] == TRAINER and t.trainer_used == 2
    assert t.gone("b") == [] and t.trainer_used == 1  # left unfinished: its share comes back


def test_manager_hands_waiting_instances_to_holders_as_they_finish():
    core = ManagerCore(clock=lambda: 0.0, settings=ManagerSettings(
            heartbeat_s=0.25, heartbeat_timeout_s=2.0, relay_fanout=4, relay_trainer_fanout=2))
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0, checksum=7))
    for i in range(5):
        core.on_message(b"p%d" % i, M.Register(job_id=f"j{i}", attempt=0, kind="preemptible", max_batch=4,
                                               relay_endpoint=f"tcp://h{i}"))
    welcomes = {p: m for p, m in core.outbox if isinstance(m, M.Welcome)}
    assert [welcomes[b"p%d" % i].wait for i in range(5)] == [False, False, True, True, True]
    core.outbox.clear()
    core.on_message(b"p0", M.WeightsLoaded(version=0, checksum=7, nbytes=8, pull_s=0.1, load_s=0.0, wire_bytes=8))
    pulls = {p: m for p, m in core.outbox if isinstance(m, M.PullFrom)}
    assert set(pulls) == {b"p2", b"p3", b"p4"}
    assert all(m.peers == ["tcp://h0"] for m in pulls.values())  # all on the new holder; the trainer slot stays free
    assert core.relay.load("") == 1
    core.outbox.clear()
    core.on_message(b"t", M.SetVersion(version=1, checksum=8))  # a new version: a new tree
    news = [m for p, m in core.outbox if isinstance(m, M.NewVersion)]
    assert sum(not m.wait for m in news) == 2 and all(m.peers == [] for m in news)
