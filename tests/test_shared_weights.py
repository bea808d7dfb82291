"""Weight versions shared with engine processes of the trainer's node through /dev/shm (weights/shared.py,
rollout/shared_weights.py): real processes on both sides, real flock(2) locks.

What must hold: a reader maps a complete version and it stays unchanged while held, however many versions the
trainer publishes meanwhile (the trainer never waits: it maps another buffer); a version that is not there, or of
another checksum, is pulled over the network instead; a killed reader leaves no lock and a dead trainer's directory is
reclaimed; nothing of a sealed version's key lands in shared memory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlboost_hpc.procutil import reclaim_leftovers
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.rollout.shared_weights import SharedVersions
from rlboost_hpc.weights.server import WeightServer
from rlboost_hpc.weights.shared import new_share_dir, remove_share_dir

ROOT = Path(__file__).resolve().parent.parent


def _state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(1000, generator=g)}


class _Fallback:
    """A fallback that records what it was asked (the network pull itself is tested in test_weights.py)."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, str, int]] = []

    def pull(self, endpoint, version, *, peers=(), keys=None, shards="", checksum=0, adapter=None):
        self.asked.append((version, shards, checksum))
        return "pulled"


@pytest.fixture
def share(tmp_path):
    d = new_share_dir(tmp_path)
    yield d
    remove_share_dir(d)


#: A reader process: maps the version it is told on stdin, holds it, and answers with the sum of its tensors'
#: elements (in the wire dtype) — before and after whatever the test publishes meanwhile.
_READER = textwrap.dedent("""
    import sys, json
    from pathlib import Path
    from rlboost_hpc.rollout.shared_weights import SharedVersions
    class NoFallback:
        def pull(self, *a, **kw): raise RuntimeError("fallback")
    sv = SharedVersions(Path(sys.argv[1]), NoFallback())
    held = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "map":
            held = sv.pull("", cmd["version"])
        elif cmd["do"] == "release":
            sv.release(); held = None
        out = {"sum": None if held is None else float(sum(t.double().sum() for t in held.state_dict.values())),
               "checksum": None if held is None else held.checksum}
        print(json.dumps(out), flush=True)
""")


def _reader(share: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _READER, str(share)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _ask(p: subprocess.Popen, **cmd) -> dict:
    p.stdin.write(json.dumps(cmd) + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def _wire_sum(v: int) -> float:
    return float(sum(t.to(torch.bfloat16).double().sum() for t in _state(v).values()))


def test_a_held_version_stays_unchanged_while_the_trainer_publishes_on_and_never_waits(share):
    with WeightServer(share_dir=share, keep_versions=2) as srv:
        m0 = srv.publish(0, _state(0))
        reader = _reader(share)
        try:
            got = _ask(reader, do="map", version=0)
            assert got == {"sum": pytest.approx(_wire_sum(0)), "checksum": m0.checksum}
            t0 = time.monotonic()
            for v in range(1, 6):  # every buffer rotates through the pool several times
                srv.publish(v, _state(v))
            assert time.monotonic() - t0 < 10  # never waited on the reader
            assert srv.store._buffers.held_by_readers > 0  # the held buffer was skipped, another one mapped
            assert _ask(reader, do="noop")["sum"] == pytest.approx(_wire_sum(0))  # unchanged under the reader
            got = _ask(reader, do="map", version=5)  # the next pull releases version 0 and maps the latest
            assert got["sum"] == pytest.approx(_wire_sum(5)) and got["checksum"] == srv.manifest(5).checksum
        finally:
            reader.kill()
            reader.wait()


def test_a_version_not_shared_or_of_another_checksum_or_sharded_is_pulled_instead(share):
    with WeightServer(share_dir=share, keep_versions=2) as srv:
        m = srv.publish(3, _state(3))
        fb = _Fallback()
        sv = SharedVersions(share, fb)
        assert sv.pull("tcp://x", 4) == "pulled"  # not published (yet, or evicted)
        assert sv.pull("tcp://x", 3, checksum=m.checksum + 1) == "pulled"  # another lineage's version 3
        assert sv.pull("tcp://x", 3, shards="{}") == "pulled"  # a sharded version: pulled from its holders
        got = sv.pull("tcp://x", 3, checksum=m.checksum)
        assert got.wire_bytes == 0 and got.checksum == m.checksum
        for k, t in _state(3).items():
            assert torch.equal(got.state_dict[k], t.to(torch.bfloat16))
        assert fb.asked == [(4, "", 0), (3, "", m.checksum + 1), (3, "{}", 0)]
        assert (sv.shared, sv.fallbacks) == (1, 3)
        sv.close()


def test_a_lora_base_the_trainer_shares_is_mapped_for_the_readers_life_and_another_base_is_loaded_as_a_node_does(
        share):
    """A LoRA run's base server keeps the base in the share's ``base`` subdirectory: a reader maps it (source
    "trainer", no bytes moved) and holds it while versions come and go; a base of another checksum, or none shared,
    goes to the fallback (the node's model.path, its cache, or the base server)."""
    from rlboost_hpc.protocol.adapter import AdapterSpec
    from rlboost_hpc.weights.shared import base_share_dir

    class BaseFallback(_Fallback):
        def base(self, spec, arch, *, keys=None, label=""):
            self.asked.append(("base", "", spec.base_checksum))
            return "loaded"

    fb = BaseFallback()
    sv = SharedVersions(share, fb)
    spec = AdapterSpec(rank=4, alpha=8.0, targets=["q_proj"], base_checksum=1, base_bytes=0)
    assert sv.base(spec, None) == "loaded"  # nothing shared yet
    with WeightServer(share_dir=base_share_dir(share), keep_versions=1) as base_srv, \
            WeightServer(share_dir=share, keep_versions=1) as srv:
        m = base_srv.publish(0, _state(7))
        assert sv.base(spec, None) == "loaded"  # another base's checksum: never mapped
        got = sv.base(AdapterSpec(rank=4, alpha=8.0, targets=["q_proj"], base_checksum=m.checksum,
                                  base_bytes=m.total_bytes), None)
        assert (got.source, got.checksum, got.nbytes, got.wire_bytes) == ("trainer", m.checksum, m.total_bytes, 0)
        for v in range(3):  # the versions are released pull by pull; the base stays held
            srv.publish(v, _state(v))
            sv.pull("tcp://x", v, checksum=srv.manifest(v).checksum)
        for k, t in _state(7).items():
            assert torch.equal(got.state_dict[k], t.to(torch.bfloat16))
        assert fb.asked == [("base", "", 1), ("base", "", 1)] and sv.shared == 3
        sv.close()


def test_a_killed_reader_leaves_no_lock_and_the_buffer_is_reused(share):
    with WeightServer(share_dir=share, keep_versions=1) as srv:
        srv.publish(0, _state(0))
        reader = _reader(share)
        _ask(reader, do="map", version=0)
        srv.publish(1, _state(1))  # version 0's buffer is held: a new one
        mapped = srv.store._buffers.mapped
        reader.send_signal(signal.SIGKILL)
        reader.wait()
        for v in range(2, 5):
            srv.publish(v, _state(v))
        assert srv.store._buffers.mapped == mapped  # the dead reader's buffer came back into use
        assert len(list(share.glob("buffer-*[0-9]"))) <= 2


def test_shared_manifests_carry_no_key_and_files_are_private(share, tmp_path):
    keys = RunKeys.generate()
    with WeightServer(share_dir=share, keys=keys, sealed=True) as srv:
        srv.publish(0, _state(0))
        assert srv.manifest(0).sealed is not None  # the served manifest gives access to sealed chunks ...
        sides = list(share.glob("*.manifest"))
        assert len(sides) == 1
        from rlboost_hpc.protocol.weight_msgs import decode_reply

        assert decode_reply(sides[0].read_bytes()).sealed is None  # ... the shared one does not
        for p in share.iterdir():
            assert p.stat().st_mode & 0o077 == 0, p
        assert share.stat().st_mode & 0o077 == 0


def test_a_dead_trainers_share_directory_is_reclaimed_and_a_live_ones_kept(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (shm / f"rlboost-weights-{dead}-abcd").mkdir()
    (shm / f"rlboost-weights-{dead}-abcd" / "buffer-1").write_bytes(b"\0" * 100)
    live = new_share_dir(shm)
    assert reclaim_leftovers(shm, tmp_path)["dirs"] == 1
    assert [p.name for p in shm.iterdir()] == [live.name]
