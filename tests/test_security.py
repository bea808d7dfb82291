"""Every socket refuses clients without the run's keys (ZeroMQ CURVE + ZAP allow-list), issue 7 §1."""
from __future__ import annotations

import os

import pytest
import torch
import zmq

from rlboost_hpc.manager.service import spawn_manager
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
    proc, endpoint, _ = spawn_manager(dict(pending_limit=8), keys_dir=str(tmp_path))
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
