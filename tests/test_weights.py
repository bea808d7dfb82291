"""Pull-based weight transfer over real loopback sockets (cases W1, W3; holder robustness).

Every test uses ephemeral 127.0.0.1 ports and small chunks so that many chunks move in little time.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import torch
import zmq

from _util import FlipBit
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import (
    MAX_REQUEST_BYTES,
    Chunk,
    Error,
    ErrorCode,
    GetChunk,
    GetManifest,
    Manifest,
    TensorSpec,
    TensorTable,
    combine_checksums,
    decode_reply,
    decode_request,
    encode,
    layout_checksum,
    validate_manifest,
)
from rlboost_hpc.weights import WeightPuller, WeightServer, WeightTransferError
from rlboost_hpc.weights import puller as puller_mod

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CHUNK = 64 << 10


def stories_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """~1 MB fp32 state dict shaped like a tiny llama (65 tensors) plus the awkward cases."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": torch.randn(512, 64, generator=g)}
    for layer in range(5):
        p = f"layers.{layer}."
        for name, shape in [
            ("attention.wq.weight", (64, 64)), ("attention.wk.weight", (32, 64)),
            ("attention.wv.weight", (32, 64)), ("attention.wo.weight", (64, 64)),
            ("feed_forward.w1.weight", (172, 64)), ("feed_forward.w2.weight", (64, 172)),
            ("feed_forward.w3.weight", (172, 64)), ("attention_norm.weight", (64,)),
            ("ffn_norm.weight", (64,)), ("attention.bias", (7,)), ("attention.scale", ()),
            ("feed_forward.gate", (3, 5)),
        ]:
            sd[p + name] = torch.randn(shape, generator=g) * 3
    sd["norm.weight"] = torch.randn(64, generator=g)
    sd["output.weight"] = torch.randn(512, 64, generator=g)
    sd["rope.position_ids"] = torch.arange(37, dtype=torch.int64)  # integer buffers keep their dtype
    sd["empty"] = torch.empty(0, 5)
    sd["mask"] = torch.tensor([True, False, True])
    assert len(sd) >= 65
    return sd


def expected(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        assert torch.equal(g, w), k


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    with WeightServer(chunk_bytes=CHUNK, keep_versions=2) as srv:
        yield srv
        assert srv.is_alive(), "the serving thread died"


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("streams,window", [(1, 1), (2, 3), (4, 4), (8, 2)])
def test_round_trip_exact(server, dtype, streams, window):
    sd = stories_state()
    m = server.publish(3, sd, dtype=dtype)
    assert len(m.chunk_checksums) > 8
    got = WeightPuller(server.endpoint, streams=streams, window=window, timeout_s=10).pull(3)
    assert got.version == 3 and got.nbytes == m.total_bytes and got.checksum == m.checksum
    assert_same(got.state_dict, expected(sd, dtype))
    assert_same(server.local_state_dict(3), expected(sd, dtype))
    assert set(got.phases) >= {"manifest_s", "transfer_s", "verify_s", "assemble_s"}
    assert got.seconds > 0
    # deterministic layout: tensors in sorted-name order, views of one buffer
    assert list(got.state_dict) == sorted(sd)
    base = got.buffer.data_ptr()
    for t, spec in zip(got.state_dict.values(), m.tensors.specs()):
        if t.numel():
            assert t.data_ptr() == base + spec.offset


def test_latest_version_and_history(server):
    server.publish(1, stories_state(1))
    server.publish(2, stories_state(2))
    p = WeightPuller(server.endpoint, streams=2, window=2)
    latest = p.pull()
    assert latest.version == 2
    assert_same(latest.state_dict, expected(stories_state(2), torch.bfloat16))
    older = p.pull(1)
    assert older.version == 1
    assert_same(older.state_dict, expected(stories_state(1), torch.bfloat16))
    assert server.versions == [1, 2] and server.latest == 2


def test_pull_into_reusable_buffer(server):
    server.publish(1, stories_state(1))
    staging = torch.zeros(4 << 20, dtype=torch.uint8)
    got = WeightPuller(server.endpoint).pull(into=staging)
    assert got.buffer.data_ptr() == staging.data_ptr()
    assert_same(got.state_dict, expected(stories_state(1), torch.bfloat16))
    with pytest.raises(ValueError, match="into must be"):
        WeightPuller(server.endpoint).pull(into=torch.zeros(10, dtype=torch.uint8))


def test_empty_state_dict(server):
    m = server.publish(0, {})
    assert m.total_bytes == 0 and m.chunk_checksums == []
    got = WeightPuller(server.endpoint).pull()
    assert got.state_dict == {} and got.version == 0


def test_versions_must_strictly_increase(server):
    server.publish(5, stories_state())
    for bad in (5, 4, -1):
        with pytest.raises(ValueError):
            server.publish(bad, stories_state())
    assert server.versions == [5]
    server.publish(6, stories_state())
    assert server.versions == [5, 6]


# ---------------------------------------------------------------------------------------------- refusals
def test_evicted_version_is_refused_by_name(server):
    for v in (1, 2, 3):
        server.publish(v, stories_state(v))
    assert server.versions == [2, 3]
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, timeout_s=5).pull(1)
    e = ei.value
    assert e.phase == "manifest" and e.code == ErrorCode.VERSION_GONE and e.version == 1
    assert "version 1" in str(e) and "no longer held" in str(e) and server.endpoint in str(e)
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, timeout_s=5).pull(9)
    assert ei.value.code == ErrorCode.UNKNOWN_VERSION
    with pytest.raises(KeyError):
        server.local_state_dict(1)


def test_nothing_published_yet(server):
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, timeout_s=5).pull()
    assert ei.value.code == ErrorCode.NO_VERSION and "published" in str(ei.value)


def test_version_evicted_during_transfer_fails_not_mixed(server):
    """W3: the holder moves on while we pull; we get an error, never a mix of two versions."""
    server.publish(1, stories_state(1))
    fired = []

    def hook(version, index, payload):
        if not fired and index >= 2:
            fired.append(index)
            server.publish(2, stories_state(2))
            server.publish(3, stories_state(3))
        return payload

    server._payload_hook = hook
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, streams=1, window=1, timeout_s=5).pull(1)
    assert ei.value.phase == "transfer" and ei.value.code == ErrorCode.VERSION_GONE
    assert "no longer held" in str(ei.value)


# ---------------------------------------------------------------------------------------------- deadlines (W1)
def test_no_server_listening_fails_within_deadline():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    before = threading.active_count()
    t0 = time.perf_counter()
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(endpoint, streams=4, timeout_s=0.5, label="instance job42.0").pull(7)
    took = time.perf_counter() - t0
    assert took < 3.0
    e = ei.value
    assert e.phase == "manifest" and "timeout" in e.cause and endpoint in str(e) and "version 7" in str(e)
    assert "instance job42.0" in str(e) and "holder" in str(e)  # both sides are named
    assert threading.active_count() == before  # nothing left behind


@pytest.mark.parametrize("endpoint", ["bogus://x", "tcp://127.0.0.1:notaport", "tcp://no-such-host.invalid:5"])
def test_bad_endpoint_fails_fast_without_leaks(endpoint):
    before = threading.active_count()
    t0 = time.perf_counter()
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(endpoint, timeout_s=0.3).pull()
    assert time.perf_counter() - t0 < 3.0
    assert ei.value.phase == "manifest" and endpoint in str(ei.value)
    assert threading.active_count() == before


def _fake_holder(manifest_frame: bytes | None):
    """A ROUTER that answers GetManifest with ``manifest_frame`` and ignores (or never gets) chunks."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def run():
        while not stop.is_set():
            if sock.poll(20):
                ident, frame = sock.recv_multipart()
                req = decode_request(frame)
                if isinstance(req, GetManifest) and manifest_frame is not None:
                    sock.send_multipart([ident, manifest_frame])

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def close():
        stop.set()
        th.join()
        sock.close(0)
        ctx.term()

    return f"tcp://127.0.0.1:{port}", close


def test_stalled_transfer_times_out():
    """Holder agrees on the manifest and then sends nothing: the transfer phase has its own deadline."""
    digests = [1, 2]
    m = Manifest(version=4, total_bytes=CHUNK + 10, chunk_bytes=CHUNK, tensors=TensorTable.from_specs([]),
                 chunk_checksums=digests, checksum=combine_checksums(digests))
    endpoint, close = _fake_holder(encode(m))
    try:
        before = threading.active_count()
        t0 = time.perf_counter()
        with pytest.raises(WeightTransferError) as ei:
            WeightPuller(endpoint, streams=2, timeout_s=0.4).pull(4)
        assert time.perf_counter() - t0 < 3.0
        assert ei.value.phase == "transfer" and "timeout" in ei.value.cause
        assert threading.active_count() == before
    finally:
        close()


def test_overall_deadline():
    digests = [1]
    m = Manifest(version=4, total_bytes=10, chunk_bytes=CHUNK, tensors=TensorTable.from_specs([]),
                 chunk_checksums=digests, checksum=combine_checksums(digests))
    endpoint, close = _fake_holder(encode(m))
    try:
        with pytest.raises(WeightTransferError) as ei:
            WeightPuller(endpoint, timeout_s=30, deadline_s=0.3).pull()
        assert "deadline" in ei.value.cause
    finally:
        close()


def test_invalid_manifest_from_holder_is_rejected():
    digests = [1]
    bad = Manifest(version=1, total_bytes=16, chunk_bytes=CHUNK,
                   tensors=TensorTable.from_specs([TensorSpec("w", "float32", (8,), 0, 32)]),  # outside the buffer
                   chunk_checksums=digests, checksum=combine_checksums(digests))
    endpoint, close = _fake_holder(encode(bad))
    try:
        with pytest.raises(WeightTransferError) as ei:
            WeightPuller(endpoint, timeout_s=2).pull()
        assert ei.value.phase == "manifest" and "invalid manifest" in ei.value.cause
    finally:
        close()


def _ask_manifest(endpoint: str, req: GetManifest) -> tuple[Manifest, int]:
    """One raw GetManifest exchange: the decoded reply and its frame's size in bytes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode(req))
        assert sock.poll(5000)
        frame = sock.recv()
        return decode_reply(frame), len(frame)
    finally:
        sock.close(0)
        ctx.term()


def test_a_manifest_leaves_out_the_table_a_puller_holds_and_only_that_one(server):
    """Layouts change only when the model does: a puller that says which table it holds gets the manifest without
    it (a 10,000-tensor table is ~330 KB per pull), uses its own copy, and still gets every byte right; after a
    layout change it gets the new table."""
    sd = stories_state(1)
    server.publish(1, sd)
    m1 = server.manifest(1)
    assert m1.layout == layout_checksum(m1.tensors)
    whole, n_whole = _ask_manifest(server.endpoint, GetManifest(version=1))
    lean, n_lean = _ask_manifest(server.endpoint, GetManifest(version=1, layout=m1.layout))
    stranger, _ = _ask_manifest(server.endpoint, GetManifest(version=1, layout=m1.layout ^ 1))
    assert whole.tensors == m1.tensors and stranger.tensors == m1.tensors
    assert lean.tensors is None and lean.layout == m1.layout and n_lean < n_whole // 4
    first = WeightPuller(server.endpoint).pull()
    server.publish(2, stories_state(2))
    second = WeightPuller(server.endpoint).pull(base=first)
    assert second.manifest.tensors is first.manifest.tensors  # the base's table stood in for the left-out one
    assert_same(second.state_dict, expected(stories_state(2), torch.bfloat16))
    changed = dict(stories_state(3), extra=torch.ones(3))
    server.publish(3, changed)
    third = WeightPuller(server.endpoint).pull(base=second)
    assert "extra" in third.manifest.tensors.names
    assert_same(third.state_dict, expected(changed, torch.bfloat16))


# ---------------------------------------------------------------------------------------------- checksums (W3)
def test_corrupt_chunk_is_named_and_never_returned(server):
    m = server.publish(1, stories_state())
    bad_chunk = 5
    server.store._held[1].buffer[bad_chunk * CHUNK + 17] ^= 0xFF  # after the checksums were computed
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, streams=3, window=2).pull(1)
    e = ei.value
    assert e.phase == "transfer" and f"checksum mismatch at chunk {bad_chunk}" in e.cause
    assert len(m.chunk_checksums) > bad_chunk


def test_transient_corruption_is_retried_once(server):
    server.publish(1, stories_state())
    server._payload_hook = flip = FlipBit(3)
    got = WeightPuller(server.endpoint, streams=2, window=2).pull()
    assert got.phases["chunk_retries"] == 1 and flip.hits == 1
    assert_same(got.state_dict, expected(stories_state(), torch.bfloat16))


def test_truncated_payload_is_an_error(server):
    server.publish(1, stories_state())
    server._payload_hook = lambda v, i, p: p[:-1] if i == 2 else p
    with pytest.raises(WeightTransferError, match="chunk 2"):
        WeightPuller(server.endpoint, streams=1).pull()


# ---------------------------------------------------------------------------------------------- holder robustness
CHILD = textwrap.dedent(
    """
    import sys, time
    from rlboost_hpc.weights import pull_streams, puller
    real = pull_streams.chunk_checksum
    def slow(buf):
        time.sleep(0.02)
        return real(buf)
    pull_streams.chunk_checksum = slow
    print("ready", flush=True)
    puller.WeightPuller(sys.argv[1], streams=2, window=4, timeout_s=30).pull()
    print("finished", flush=True)
    """
)


@pytest.mark.chaos
def test_puller_killed_mid_transfer_server_keeps_serving(server):
    sd = {f"w{i}": torch.randn(64 << 10) for i in range(16)}  # 16 × 256 KiB fp32 → 2 MiB bf16 = 32 chunks
    m = server.publish(1, sd)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", CHILD, server.endpoint], stdout=subprocess.PIPE, env=env)
    try:
        served0 = server.stats["chunks_served"]
        deadline = time.monotonic() + 40
        while server.stats["chunks_served"] < served0 + 4:
            assert child.poll() is None, "child exited before it was killed"
            assert time.monotonic() < deadline, "child never started pulling"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert server.stats["chunks_served"] < served0 + len(m.chunk_checksums)  # it really died mid-transfer
    got = WeightPuller(server.endpoint, streams=2, window=2, timeout_s=10).pull()
    assert_same(got.state_dict, expected(sd, torch.bfloat16))
    assert server.is_alive()


def test_slow_puller_never_blocks_the_server(server):
    """A peer that floods requests and never reads costs the holder nothing but queued frames."""
    server.publish(1, stories_state())
    ctx = zmq.Context()
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.connect(server.endpoint)
    try:
        n = len(server.manifest(1).chunk_checksums)
        for i in range(2000):
            slow.send(encode(GetChunk(version=1, index=i % n)))
        t0 = time.perf_counter()
        got = WeightPuller(server.endpoint, streams=2, timeout_s=10).pull()
        assert time.perf_counter() - t0 < 10
        assert_same(got.state_dict, expected(stories_state(), torch.bfloat16))
    finally:
        slow.close(0)
        ctx.term()
    assert server.is_alive()


@pytest.mark.fuzz
def test_garbage_frames_are_rejected_counted_and_logged_once(server, caplog):
    server.publish(1, stories_state(1))
    server.publish(2, stories_state(2))
    server.publish(3, stories_state(3))  # 1 is evicted
    rng = random.Random(0)
    valid = encode(GetChunk(version=3, index=0))
    garbage_single = [
        bytes(rng.getrandbits(8) for _ in range(64)),  # random bytes
        valid[:-3],  # truncated msgpack
        b"\xdb\xff\xff\xff\xff",  # str32 declaring 4 GiB
        b"\xc6\x7f\xff\xff\xff",  # bin32 declaring 2 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 declaring 4G items
        msgspec.msgpack.encode({"t": "get_chunk", "version": "3", "index": 0}),  # wrong type
        msgspec.msgpack.encode({"t": "get_chunk", "version": 3, "index": -1}),  # out of range
        msgspec.msgpack.encode({"t": "get_chunk", "version": 3, "index": 2**64 - 1}),  # beyond int64
        msgspec.msgpack.encode({"t": "get_chunk", "version": 3}),  # missing field
        msgspec.msgpack.encode({"t": "get_chunk", "version": 3, "index": 0, "extra": 1}),  # unknown field
        msgspec.msgpack.encode({"t": "launch_missiles"}),  # unknown tag
        msgspec.msgpack.encode({"version": 3}),  # no tag
        msgspec.msgpack.encode([1, 2, 3]),  # wrong container
        encode(Chunk(version=3, index=0, nbytes=10)),  # a reply sent to the holder
        encode(Error(code="x", message="y")),
        b"\x00" * (MAX_REQUEST_BYTES + 1),  # oversized
        b"",  # empty
    ]
    garbage_multi = [[valid, b"extra"], [b"a", b"b", b"c"]]
    # well-formed requests for versions/indices the holder cannot serve: answered, not rejected
    refused = [
        (encode(GetChunk(version=1, index=0)), ErrorCode.VERSION_GONE),  # replayed, evicted
        (encode(GetChunk(version=99, index=0)), ErrorCode.UNKNOWN_VERSION),  # from the future
        (encode(GetChunk(version=3, index=10**9)), ErrorCode.BAD_INDEX),
        (encode(GetManifest(version=1)), ErrorCode.VERSION_GONE),
    ]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(server.endpoint)
    caplog.set_level(logging.WARNING, logger="rlboost_hpc.weights.server")
    try:
        codes = []
        for frame in garbage_single:
            peer.send(frame)
        for parts in garbage_multi:
            peer.send_multipart(parts)
        for frame, _ in refused:
            peer.send(frame)
        # out-of-order but valid chunk requests of the held versions are simply served
        peer.send(encode(GetChunk(version=2, index=4)))
        peer.send(encode(GetChunk(version=3, index=1)))
        n_replies = len(garbage_single) + len(garbage_multi) + len(refused) + 2
        for _ in range(n_replies):
            assert peer.poll(5000), "the holder stopped answering"
            frames = peer.recv_multipart()
            reply = decode_reply(frames[0])
            codes.append(reply.code if isinstance(reply, Error) else ("chunk", reply.version, reply.index))
    finally:
        peer.close(0)
        ctx.term()
    n_bad = len(garbage_single) + len(garbage_multi)
    assert codes[:n_bad] == [ErrorCode.BAD_REQUEST] * n_bad
    assert codes[n_bad : n_bad + len(refused)] == [c for _, c in refused]
    assert codes[-2:] == [("chunk", 2, 4), ("chunk", 3, 1)]
    st = server.stats
    assert st["rejected"] == n_bad
    assert sum(st["rejected_by_reason"].values()) == n_bad
    assert st["rejected_by_reason"]["oversized"] == 1 and st["rejected_by_reason"]["framing"] == 2
    warnings = [r for r in caplog.records if r.name == "rlboost_hpc.weights.server"]
    assert len(warnings) == 1, "one log line per bad peer"

    # a raw TCP client speaking no ZMTP at all, and a huge frame above libzmq's limit
    with socket.create_connection(("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]))) as s:
        s.sendall(os.urandom(4096))
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(server.endpoint)
    big.send(b"\x00" * (2 << 20))
    time.sleep(0.1)
    big.close(0)
    ctx.term()

    got = WeightPuller(server.endpoint, streams=2, window=2).pull()
    assert got.version == 3
    assert_same(got.state_dict, expected(stories_state(3), torch.bfloat16))
    assert server.is_alive()


# ---------------------------------------------------------------------------------------------- protocol unit
@pytest.mark.fuzz
def test_decoders_raise_protocol_error_only():
    rng = random.Random(1)
    assert issubclass(ProtocolError, ValueError)
    samples = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 80))) for _ in range(2000)]
    valid_req = encode(GetChunk(version=3, index=9))
    samples += [valid_req[:k] for k in range(len(valid_req))]
    for data in samples:
        for decode in (decode_request, decode_reply):
            try:
                decode(data)
            except ProtocolError:
                pass
    assert decode_request(valid_req) == GetChunk(version=3, index=9)
    with pytest.raises(ProtocolError) as ei:
        decode_request(b"\x00" * 5000)
    assert ei.value.reason == "oversized"
    with pytest.raises(ProtocolError) as ei:
        decode_request(encode(Chunk(version=1, index=0, nbytes=1)))
    assert ei.value.reason == "invalid"
    with pytest.raises(ProtocolError):
        decode_request(12345)


def test_validate_manifest_catches_inconsistencies():
    d = [7, 8]
    ok = Manifest(version=1, total_bytes=CHUNK + 4, chunk_bytes=CHUNK,
                  tensors=TensorTable.from_specs([TensorSpec("a", "bfloat16", (2, 3), 0, 12),
                                                  TensorSpec("b", "int64", (), 64, 8)]),
                  chunk_checksums=d, checksum=combine_checksums(d))
    validate_manifest(ok)
    assert ok.tensors.specs() == [TensorSpec("a", "bfloat16", (2, 3), 0, 12), TensorSpec("b", "int64", (), 64, 8)]

    def table(*specs):
        return msgspec.structs.replace(ok, tensors=TensorTable.from_specs(list(specs)))

    def columns(**kw):
        return msgspec.structs.replace(ok, tensors=msgspec.structs.replace(ok.tensors, **kw))

    bad = [
        msgspec.structs.replace(ok, chunk_checksums=[7]),
        msgspec.structs.replace(ok, checksum=ok.checksum ^ 1),
        table(TensorSpec("a", "complex64", (1,), 0, 8)),
        table(TensorSpec("a", "float32", (1,), 2, 4)),  # misaligned
        table(TensorSpec("a", "uint8", (1,), CHUNK + 4, 1)),  # outside the buffer
        table(TensorSpec("a", "uint8", (1,), 0, 1), TensorSpec("a", "uint8", (1,), 0, 1)),  # twice
        table(TensorSpec("a", "uint8", (-1,), 0, 1)),  # negative dimension
        table(TensorSpec("a", "uint8", (1 << 30, 1 << 30, 1 << 30), 0, 1)),  # astronomically large
        columns(ndim=bytes([17, 0])),  # more dimensions than the shape matrix has
        columns(dtype_index=bytes([0, 9])),  # no such dtype
        columns(offsets=ok.tensors.offsets[:8]),  # column shorter than the names
        columns(shapes=ok.tensors.shapes[:-8]),  # ragged shape matrix
        columns(shapes=(2).to_bytes(8, "little") * 2 + (3).to_bytes(8, "little") * 2),  # padding of a scalar is 3
        msgspec.structs.replace(ok, tensors=None),  # no table: only a puller holding its layout may accept it
        msgspec.structs.replace(ok, layout=layout_checksum(ok.tensors) ^ 1),  # layout claim of another table
    ]
    validate_manifest(msgspec.structs.replace(ok, layout=layout_checksum(ok.tensors)))
    for m in bad:
        with pytest.raises(ProtocolError):
            validate_manifest(m)


def test_puller_module_exports():
    assert issubclass(WeightTransferError, RuntimeError)
    assert puller_mod.WeightPuller is WeightPuller


def test_publish_with_copy_threads_restores_torch_threads():
    before = torch.get_num_threads()
    with WeightServer(chunk_bytes=CHUNK, copy_threads=1) as srv:
        srv.publish(1, stories_state())
        assert torch.get_num_threads() == before
        got = WeightPuller(srv.endpoint, streams=2).pull()
    assert_same(got.state_dict, expected(stories_state(), torch.bfloat16))


def test_failing_hook_is_an_internal_error_not_a_crash(server):
    """A bug while serving one request must not take the holder down for everyone."""
    server.publish(1, stories_state())

    def boom(version, index, payload):
        if index == 1:
            raise RuntimeError("injected")
        return payload

    server._payload_hook = boom
    with pytest.raises(WeightTransferError) as ei:
        WeightPuller(server.endpoint, streams=1, timeout_s=5).pull()
    assert ei.value.phase == "transfer" and ei.value.code == ErrorCode.INTERNAL and "injected" in str(ei.value)
    assert server.stats["internal_errors"] >= 1 and server.is_alive()
    server._payload_hook = None
    assert WeightPuller(server.endpoint).pull().version == 1


def test_automatic_streams_follow_the_usable_cores():
    """``weights.streams = 0`` (the default): one stream per two usable cores, 1 to 4 — on the 2-core machine one
    stream is what reaches the socket's ceiling (bench_weights); explicit counts are kept; negative ones refused."""
    from rlboost_hpc.config import load_config
    from rlboost_hpc.weights.pull_streams import auto_streams, usable_cores

    assert [auto_streams(c) for c in (1, 2, 3, 4, 8, 16, 128)] == [1, 1, 1, 2, 4, 4, 4]
    assert load_config(None, []).weights.streams == 0
    assert WeightPuller("tcp://127.0.0.1:1").streams == auto_streams(usable_cores())
    assert WeightPuller("tcp://127.0.0.1:1", streams=3).streams == 3
    with pytest.raises(ValueError, match="streams"):
        WeightPuller("tcp://127.0.0.1:1", streams=-1)


def test_a_pull_into_a_reused_buffer_faults_no_pages_back_in():
    """Regression: libzmq mallocs each received frame and glibc trimmed the freed frames of a pull's window, so
    every pull faulted its first ``window`` chunks back in page by page (4,096 minor faults per pull here)."""
    import resource
    import statistics

    chunk, window = 4 << 20, 4
    with WeightServer(chunk_bytes=chunk, keep_versions=1) as srv:
        m = srv.publish(1, {"w": torch.randn(8 << 20)}, dtype=torch.bfloat16)  # 16 MiB: one window of chunks
        pages = m.total_bytes // resource.getpagesize()
        p = WeightPuller(srv.endpoint, streams=1, window=window, timeout_s=10)
        staging = torch.ones(m.total_bytes, dtype=torch.uint8)
        for _ in range(2):
            p.pull(into=staging)
        faults = []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            got = p.pull(into=staging)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            assert got.checksum == m.checksum
    assert statistics.median(faults) < pages / 8, (faults, pages)


def test_retain_frame_buffers_only_raises_the_thresholds():
    from rlboost_hpc.models import layout

    assert layout.retain_frame_buffers(64 << 20, 4) is False  # mmapped whatever the threshold
    layout.retain_frame_buffers(4 << 20, 4)
    assert layout.retain_frame_buffers(1 << 20, 1) is False  # already at least that
