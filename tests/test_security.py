"""Every socket refuses clients without the run's keys (ZeroMQ CURVE + ZAP allow-list), issue 7 §1."""
from __future__ import annotations

import os

import pytest
import torch
import zmq

from _util import FlipBit, wait_for
from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import AuthError, RunKeys
from rlboost_hpc.trainer.client import ManagerClient, ManagerError
from rlboost_hpc.weights.puller import WeightPuller, WeightTransferError
from rlboost_hpc.weights.server import WeightServer

pytestmark = pytest.mark.integration


def test_keys_are_owner_only_and_checked(tmp_path):
    keys = RunKeys.generate()
    path = keys.save(tmp_path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert RunKeys.load(tmp_path) == keys
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match="owner only"):
        RunKeys.load(tmp_path)
    with pytest.raises(AuthError, match="not found"):
        RunKeys.load(tmp_path / "elsewhere")
    path.unlink()
    path.write_text('{"server_public": 1}')
    os.chmod(path, 0o600)
    with pytest.raises(AuthError, match="malformed"):
        RunKeys.load(tmp_path)


def _stranger(endpoint: str, keys: RunKeys | None):
    """A DEALER with no CURVE at all (keys None) or with a key pair that is not the run's."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_serverkey = keys.server_public
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.connect(endpoint)
    return s


@pytest.fixture
def secured(tmp_path):
    keys = RunKeys.generate()
    keys.save(tmp_path)
    proc, endpoint, _ = spawn_manager(ManagerSettings(pending_limit=8), keys_dir=str(tmp_path))
    server = WeightServer(keys=keys).start()
    server.publish(0, {"w": torch.arange(1000, dtype=torch.float32)}, dtype=torch.float32)
    yield keys, endpoint, server
    client = ManagerClient(endpoint, keys=keys)
    try:  # only the trainer may shut the manager down: this client becomes it first
        client.call(M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}), timeout_s=3)
        client.call(M.Shutdown(reason="test"), timeout_s=3)
    except ManagerError:
        pass
    client.close()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
    server.close()


@pytest.mark.parametrize("who", ["plain", "wrong-key"])
def test_manager_refuses_clients_without_the_run_key(secured, who):
    keys, endpoint, _ = secured
    s = _stranger(endpoint, None if who == "plain" else keys)
    s.send(M.encode(M.Register(job_id="evil", attempt=0, kind="preemptible", max_batch=8)))
    s.send(M.encode(M.TrainerHello(weights_endpoint="tcp://evil:1", model_config={})))
    s.send(M.encode(M.SetVersion(version=99)))
    assert not s.poll(1500), "an unauthenticated client got an answer"
    s.close()
    client = ManagerClient(endpoint, keys=keys)  # the run's own client still works
    client.call(M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    st = client.stats()
    assert st.registrations == 0 and st.latest_version == -1
    client.close()


@pytest.mark.parametrize("who", ["plain", "wrong-key"])
def test_weight_server_refuses_pullers_without_the_run_key(secured, who):
    keys, _, server = secured
    bad = None
    if who == "wrong-key":
        pub, sec = zmq.curve_keypair()
        bad = RunKeys(keys.server_public, b"", pub, sec)
    with pytest.raises(WeightTransferError, match="manifest"):
        WeightPuller(server.endpoint, timeout_s=1.5, keys=bad).pull()
    got = WeightPuller(server.endpoint, timeout_s=5, keys=keys.client_view()).pull()
    assert torch.equal(got.state_dict["w"], torch.arange(1000, dtype=torch.float32))


def test_curve_pull_of_full_size_chunks():
    """Regression (found by benchmarks/bench_curve.py): with CURVE on, libzmq applies MAXMSGSIZE to the encrypted
    frame (payload + 33 bytes), so a puller whose limit equalled chunk_bytes dropped every full-size chunk and
    stalled ("no chunk for 10s, 0/17 chunks received") — only versions smaller than one chunk ever worked."""
    keys = RunKeys.generate()
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(1 << 17, generator=g) for i in range(8)}  # 8 × 256 KiB in bf16 = 8 full chunks
    with WeightServer(chunk_bytes=256 << 10, keys=keys) as srv:
        man = srv.publish(0, sd, dtype=torch.bfloat16)
        assert man.total_bytes >= 8 * (256 << 10)
        got = WeightPuller(srv.endpoint, streams=2, window=2, timeout_s=10, keys=keys.client_view()).pull()
    for k, v in sd.items():
        assert torch.equal(got.state_dict[k], v.to(torch.bfloat16)), k


# ---------------------------------------------------------------------------------------------- sealed chunks
def _sealed_holder(keys: RunKeys):
    srv = WeightServer(chunk_bytes=64 << 10, keys=keys).start()
    g = torch.Generator().manual_seed(1)
    man = srv.publish(3, {"w": torch.randn(100_000, generator=g)}, dtype=torch.bfloat16)
    return srv, man


def _ask(sock: zmq.Socket, msg) -> list[bytes]:
    from rlboost_hpc.protocol.weight_msgs import encode

    sock.send(encode(msg))
    assert sock.poll(5000), "no answer"
    return sock.recv_multipart()


def test_the_sealed_port_gives_nothing_without_the_ticket_and_never_a_manifest():
    """The sealed port is plain TCP: anyone can connect, but without the version's ticket (which travels only in
    the manifest, over CURVE) it answers errors only, and it never serves a manifest (the key is in it)."""
    from rlboost_hpc.protocol.weight_msgs import Error, ErrorCode, GetChunk, GetManifest, decode_reply

    keys = RunKeys.generate()
    srv, man = _sealed_holder(keys)
    try:
        assert man.sealed is not None and "key" in repr(man.sealed) and repr(man.sealed.key) not in repr(man)
        s = _stranger(srv.endpoint.rsplit(":", 1)[0] + f":{man.sealed.port}", None)
        for msg, code in ((GetManifest(version=3), ErrorCode.BAD_REQUEST), (GetManifest(), ErrorCode.BAD_REQUEST),
                          (GetChunk(version=3, index=0), ErrorCode.UNAUTHORIZED),
                          (GetChunk(version=3, index=0, ticket=b"\0" * 16), ErrorCode.UNAUTHORIZED),
                          (GetChunk(version=3, index=0, ticket=man.sealed.ticket[:8]), ErrorCode.UNAUTHORIZED)):
            frames = _ask(s, msg)
            reply = decode_reply(frames[0])
            assert len(frames) == 1 and isinstance(reply, Error) and reply.code == code, (msg, reply)
        s.close()
        assert srv.stats["sealed_chunks_served"] == 0 and srv.stats["manifests_served"] == 0
    finally:
        srv.close()


def test_a_sealed_chunk_is_ciphertext_that_opens_only_in_its_place():
    """Even a peer that saw a ticket on the wire receives ciphertext only; a sealed frame opens only under the
    version's key and for its own version, chunk and delta base; one flipped bit and it does not open."""
    from rlboost_hpc.protocol.weight_msgs import Chunk, GetChunk, decode_reply
    from rlboost_hpc.weights.sealed import TAG_BYTES, SealError, Sealer

    keys = RunKeys.generate()
    srv, man = _sealed_holder(keys)
    try:
        s = _stranger(srv.endpoint.rsplit(":", 1)[0] + f":{man.sealed.port}", None)
        header, frame = _ask(s, GetChunk(version=3, index=1, ticket=man.sealed.ticket))
        s.close()
        chunk = decode_reply(header)
        assert isinstance(chunk, Chunk) and chunk.nonce is not None and chunk.nbytes == len(frame)
        plain = bytes(srv.local_state_dict(3)["w"].view(torch.uint8).numpy().tobytes()[64 << 10: 128 << 10])
        assert len(frame) == len(plain) + TAG_BYTES and plain not in frame and frame[:64] != plain[:64]
        dest = memoryview(bytearray(len(plain)))
        Sealer(man.sealed.key).open_into(chunk.nonce, frame, 3, 1, None, dest)
        assert bytes(dest) == plain
        for key, version, index, base in ((os.urandom(32), 3, 1, None), (man.sealed.key, 4, 1, None),
                                          (man.sealed.key, 3, 2, None), (man.sealed.key, 3, 1, 2)):
            with pytest.raises(SealError):
                Sealer(key).open_into(chunk.nonce, frame, version, index, base, dest)
        flipped = bytearray(frame)
        flipped[len(flipped) // 2] ^= 1
        with pytest.raises(SealError):
            Sealer(man.sealed.key).open_into(chunk.nonce, bytes(flipped), 3, 1, None, dest)
    finally:
        srv.close()


def test_pulls_are_sealed_by_default_and_a_tampered_frame_never_reaches_the_weights():
    """A puller with the run's keys fetches every chunk sealed (CURVE only for the manifest); ``sealed=False``
    pulls over CURVE. A frame altered on the wire is fetched once more; altered every time, the pull fails
    naming it — never a version with foreign bytes."""
    keys = RunKeys.generate()
    srv, man = _sealed_holder(keys)
    try:
        want = srv.local_state_dict(3)["w"].clone()
        got = WeightPuller(srv.endpoint, streams=2, window=2, timeout_s=10, keys=keys.client_view()).pull()
        assert got.phases["sealed_bytes"] > got.nbytes and torch.equal(got.state_dict["w"], want)
        # the holder counts a chunk after handing it to libzmq: the pull can finish a moment before the count
        wait_for(lambda: srv.stats["sealed_chunks_served"] == len(man.chunk_checksums), 5, "the holder's count",
                 interval=0.01, state=lambda: str(srv.stats))
        over_curve = WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view(), sealed=False).pull()
        assert over_curve.phases["sealed_bytes"] == 0 and torch.equal(over_curve.state_dict["w"], want)
        srv._payload_hook = flip = FlipBit(1, byte=7)
        again = WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view()).pull()
        assert flip.hits == 1 and again.phases["chunk_retries"] == 1 and torch.equal(again.state_dict["w"], want)
        srv._payload_hook = FlipBit(1, always=True, byte=7)
        with pytest.raises(WeightTransferError, match="did not open under the version's key"):
            WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view()).pull()
    finally:
        srv.close()


@pytest.mark.parametrize("relay_seals", [True, False])
def test_a_relay_peer_seals_under_the_trainers_key_or_serves_over_curve(relay_seals):
    """A relay holder adopts the trainer's key and ticket for the version it holds and seals on its own port; a
    relay that does not seal is used over CURVE. Either way the puller gets the trainer's bytes from the peer."""
    keys = RunKeys.generate()
    srv, man = _sealed_holder(keys)
    relay = WeightServer(keep_versions=1, delta=False, keys=keys, sealed=relay_seals).start()
    try:
        first = WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view()).pull()
        relay.hold(first.manifest, first.buffer)
        assert (relay.manifest().sealed is not None) == relay_seals
        if relay_seals:
            assert relay.manifest().sealed.key == man.sealed.key and relay.manifest().sealed.port != man.sealed.port
        got = WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view()).pull(peers=[relay.endpoint])
        assert got.checksum == man.checksum and got.phases["peer_bytes"] >= got.nbytes
        assert (got.phases["sealed_bytes"] > 0) == relay_seals
        want = len(man.chunk_checksums) if relay_seals else 0  # (counted after the send: see above)
        wait_for(lambda: relay.stats["sealed_chunks_served"] == want, 5, "the relay's count", interval=0.01,
                 state=lambda: str(relay.stats))
        assert srv.stats["sealed_chunks_served"] == len(man.chunk_checksums)  # the first pull only
    finally:
        relay.close()
        srv.close()


@pytest.mark.fuzz
def test_the_sealed_port_survives_garbage_from_anyone(caplog):
    """The sealed port is the one weight surface without CURVE: random frames, multi-part messages, oversized
    frames and well-formed requests with guessed tickets get errors or a disconnect — never a payload — and the
    holder keeps serving the run's pullers; rejections are counted, not logged (strangers cannot flood logs)."""
    import random

    from rlboost_hpc.protocol.weight_msgs import Chunk, GetChunk, decode_reply, encode

    keys = RunKeys.generate()
    srv, man = _sealed_holder(keys)
    rng = random.Random(7)
    try:
        s = _stranger(srv.endpoint.rsplit(":", 1)[0] + f":{man.sealed.port}", None)
        for _ in range(300):
            kind = rng.randrange(4)
            if kind == 0:
                s.send(rng.randbytes(rng.randrange(0, 200)))
            elif kind == 1:
                s.send_multipart([rng.randbytes(8) for _ in range(rng.randrange(2, 5))])
            elif kind == 2:
                s.send(encode(GetChunk(version=rng.choice([3, 4, 0]), index=rng.randrange(0, 10),
                                       base=rng.choice([None, 2]), ticket=rng.randbytes(rng.choice([0, 15, 16, 64])))))
            else:
                s.send(bytes([0x81, 0xa1, 0x74]) + rng.randbytes(rng.randrange(1, 40)))  # a msgpack map, cut short
        big = _stranger(srv.endpoint.rsplit(":", 1)[0] + f":{man.sealed.port}", None)
        big.send(b"\0" * (2 << 20))  # above the port's MAXMSGSIZE: libzmq drops the connection
        replies = 0
        while s.poll(1000):
            frames = s.recv_multipart()
            assert not isinstance(decode_reply(frames[0]), Chunk), "a stranger got a chunk"
            replies += 1
        s.close()
        big.close()
        assert replies > 0 and srv.is_alive() and srv.stats["sealed_chunks_served"] == 0
        assert srv.stats["rejected"] > 0 and not [r for r in caplog.records if "rejected" in r.getMessage()]
        got = WeightPuller(srv.endpoint, timeout_s=10, keys=keys.client_view()).pull()
        assert got.checksum == man.checksum and got.phases["sealed_bytes"] > 0
    finally:
        srv.close()
