"""Chaos and fuzz tests across real processes and sockets (issue 7 §3–4)."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch
import zmq

from rlboost_hpc.chaos import chaos_main, kill_steps, synthetic_trace
from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys, secure_client
from rlboost_hpc.trainer.client import ManagerClient
from rlboost_hpc.weights.puller import WeightPuller
from rlboost_hpc.weights.server import WeightServer


def test_synthetic_trace_is_valid_and_seeded(tmp_path):
    from rlboost_hpc.cluster.traces import load_trace

    n = synthetic_trace(tmp_path / "t.csv", duration_s=60, instances=3, mean_lifetime_s=2, mean_downtime_s=1, seed=4)
    ev = load_trace(str(tmp_path / "t.csv"))
    assert sum(e.kind == "remove" for e in ev) == n > 10
    synthetic_trace(tmp_path / "u.csv", duration_s=60, instances=3, mean_lifetime_s=2, mean_downtime_s=1, seed=4)
    assert (tmp_path / "t.csv").read_text() == (tmp_path / "u.csv").read_text()


def test_kill_steps_spread_kills_over_checkpoints_with_steps_left_to_resume_into():
    assert kill_steps(20, 3) == [5, 10, 15]
    assert kill_steps(400, 5) == [67, 133, 200, 267, 333]
    assert kill_steps(2, 1) == [1] and kill_steps(5, 0) == []
    with pytest.raises(ValueError, match="need at least 4 steps"):
        kill_steps(3, 3)


@pytest.mark.chaos
@pytest.mark.slow
def test_chaos_short(tmp_path, capsys):
    """Workers preempted with warning, killed without warning (some while pulling weights), restarted,
    many times per step: nothing lost, nothing duplicated, nothing trained off-version, every prompt once."""
    rc = chaos_main(["--out", str(tmp_path / "chaos"), "--steps", "28", "--lifetime-s", "1.0",
                     "--downtime-s", "0.5", "--seed", "1"])
    rep = json.loads((tmp_path / "chaos/report.json").read_text())
    assert rc == 0
    assert rep["preemptions_with_warning"] + rep["kills_without_warning"] >= 10
    assert rep["kills_without_warning"] >= 3
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0


@pytest.mark.chaos
@pytest.mark.slow
def test_chaos_with_stalls_resets_and_slow_loads_loses_nothing(tmp_path, capsys):
    """Every liveness fault next to warned preemptions: workers stopped past the heartbeat deadline (5 s against
    4 s), every worker's TCP connection reset through a forwarder, weight loads 5 s slower than the deadline.
    Stalled and reset workers are suspected and come back; nothing lost, duplicated or trained off-version."""
    rc = chaos_main(["--out", str(tmp_path / "chaos"), "--steps", "24", "--lifetime-s", "8", "--downtime-s", "1",
                     "--seed", "2", "--kill-fraction", "0.3", "--stall-every-s", "2.5", "--stall-s", "5",
                     "--reset-every-s", "2.5", "--slow-load-s", "5", "--set", "cluster.faults.slow_load_fraction=0.8"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0, summary
    f, live = summary["faults"], summary["liveness"]
    assert f["stalls"] >= 1 and f["link_resets"] >= 1 and f["slow_weight_loads"] >= 1, f
    assert live["instances_suspected"] >= 1 and live["instances_recovered"] >= 1, live
    assert all(v == 0 for v in summary["checks"].values()), summary["checks"]


@pytest.mark.chaos
@pytest.mark.slow
def test_chaos_trainer_and_manager_kills_resume_exactly_once(tmp_path, capsys):
    """Case C1: on top of worker churn, SIGKILL the trainer or the rollout manager three times, each after a
    checkpoint (by progress, not by the clock: a slow machine once had every kill land before the first
    checkpoint, so nothing resumed); a trainer restart resumes from the last checkpoint, a killed manager is
    restarted by its trainer and continues the step from its work log (issue 33). Across all incarnations:
    nothing lost or duplicated, nothing trained off-version, every prompt of the data frontier trained once."""
    out = tmp_path / "chaos"
    rc = chaos_main(["--out", str(out), "--steps", "20", "--lifetime-s", "1.0", "--downtime-s", "0.5",
                     "--seed", "3", "--trainer-kills", "3"])
    summary = json.loads(capsys.readouterr().out)
    rep = json.loads((out / "report.json").read_text())
    assert rc == 0, summary
    f = summary["faults"]
    # a killed trainer resumes from its checkpoint; a killed manager is restarted by the trainer (no resume)
    assert f["trainer_kills"] + f["manager_kills"] == 3 and f["resumes"] == f["trainer_kills"], f
    # (a manager killed before it wrote its work log's first record is restarted but not counted by the next one)
    assert (rep["manager_restarts"] > 0) == (f["manager_kills"] > 0) and rep["manager_restarts"] <= f["manager_kills"]
    assert rep["steps"] == 20 and rep["resumes"] == f["resumes"]
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["responses_trained"] == 20 * 8 * 8  # every step's 8 groups × G=8, once
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 20


@pytest.mark.chaos
@pytest.mark.slow
def test_chaos_repeated_manager_kills_restart_it_and_lose_nothing(tmp_path, capsys):
    """Issue 33: on top of worker churn, the rollout manager is SIGKILLed every ~2 s at random moments (during
    rollout, a commit, a compaction or its own restart); the trainer restarts it each time within the same
    incarnation, and the run ends with nothing lost, duplicated, off-version or trained twice."""
    out = tmp_path / "chaos"
    rc = chaos_main(["--out", str(out), "--steps", "12", "--lifetime-s", "2.0", "--downtime-s", "0.5",
                     "--seed", "5", "--manager-kill-every-s", "2.0"])
    summary = json.loads(capsys.readouterr().out)
    rep = json.loads((out / "report.json").read_text())
    assert rc == 0, summary
    f = summary["faults"]
    assert f["manager_kills"] >= 4 and f["trainer_kills"] == 0 and f["resumes"] == 0, f
    assert 0 < rep["manager_restarts"] <= f["manager_kills"], (rep["manager_restarts"], f)
    assert all(v == 0 for v in summary["checks"].values()), summary["checks"]
    assert rep["steps"] == 12 and rep["responses_trained"] == 12 * 8 * 8


def _fuzz_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    valid = [M.encode(m) for m in [
        M.Register(job_id="fz", attempt=0, kind="preemptible", max_batch=4),
        M.Heartbeat(version=0, active=0, tokens_generated=10**9),
        M.Tokens(rids=["g/0"], offsets=[5], counts=[1], versions=[7], finish=[1], ids=M.pack_i32([3]),
                 logprobs=M.pack_f32([0.0])),
        M.SetVersion(version=10**6), M.AckGroup(gid="g"), M.Released(rids=["g/0"], tokens_generated=0),
        M.WeightsLoaded(version=0, checksum=0, nbytes=0, pull_s=0, load_s=0)]]
    out = []
    for i in range(n):
        k = i % 5
        if k == 0:
            out.append([bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 80)))])
        elif k == 1:
            v = rng.choice(valid)
            out.append([v[: rng.randint(0, len(v))]])
        elif k == 2:
            v = bytearray(rng.choice(valid))
            v[rng.randrange(len(v))] ^= 0xFF
            out.append([bytes(v)])
        elif k == 3:
            out.append([rng.choice(valid)])  # replayed / out-of-order valid messages
        else:
            out.append([rng.choice(valid), b"extra"])  # wrong framing
    out.append([b"\x00" * (M.MAX_FRAME_BYTES + 10)])  # oversized
    return out


@pytest.mark.fuzz
def test_fuzz_every_listening_socket_with_an_authenticated_peer(tmp_path):
    """≥ 10,000 random, truncated, corrupted, replayed, out-of-order and oversized frames to the manager and to
    the weight server from a peer holding the run's keys (the worst case: a buggy or compromised job). Both
    stay up and afterwards serve a clean client exactly as before."""
    keys = RunKeys.generate()
    keys.save(tmp_path)
    proc, endpoint, _ = spawn_manager(ManagerSettings(pending_limit=8), keys_dir=str(tmp_path))
    server = WeightServer(keys=keys).start()
    weights = {"w": torch.randn(5000), "b": torch.arange(10, dtype=torch.float32)}
    server.publish(0, weights, dtype=torch.float32)
    client = ManagerClient(endpoint, keys=keys)
    client.call(M.TrainerHello(weights_endpoint=server.endpoint, model_config={}))
    client.call(M.SetVersion(version=0))
    rng = random.Random(7)
    ctx = zmq.Context.instance()
    sent = 0
    try:
        for target in (endpoint, server.endpoint):
            socks = []
            for _ in range(4):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 2000)
                s.setsockopt(zmq.SNDHWM, 0)
                secure_client(s, keys.client_view())
                s.connect(target)
                socks.append(s)
            for frames in _fuzz_frames(rng, 6000):
                rng.choice(socks).send_multipart(frames)
                sent += 1
            time.sleep(1.0)
            for s in socks:
                while s.poll(0):
                    s.recv_multipart()
                s.close()
        assert sent >= 10_000
        assert proc.is_alive() and server.is_alive()
        st = client.stats()
        assert st.latest_version == 0  # the fuzzer's SetVersion was refused (not the trainer)
        got = WeightPuller(server.endpoint, timeout_s=10, keys=keys.client_view()).pull()
        assert all(torch.equal(got.state_dict[k], v) for k, v in weights.items())
        assert server.stats["rejected"] > 1000
    finally:
        client.call(M.Shutdown(reason="test"), timeout_s=5)
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        server.close()
