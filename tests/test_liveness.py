"""Busy is not dead, dead is not alive, identity survives reconnects — with real processes and sockets.

- A worker whose engine takes 6 s to build, 10 s for its first step and 30 s to load a new version stays
  routable under the default 4 s deadline: nothing migrates.
- A SIGKILLed worker leaves routing as soon as the kernel closes its connection (measured), not after the deadline.
- A TCP reset between a worker and the manager, and between the trainer's client and the manager: no response
  lost, nothing trained twice, no process exits.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _util import load_hf_dir
from test_rollout_integration import MAX_NEW, PROMPT, harness, reference, wait_stats  # noqa: F401 (fixture)

from rlboost_hpc.cluster.faults import TcpForwarder
from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.rundir import RunDir
from rlboost_hpc.trainer.client import ManagerClient
from rlboost_hpc.weights.server import WeightServer

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parent


def _group(client, n: int, gid: str, step: int = 0, version: int = 0, max_new: int = MAX_NEW):
    spec = M.GroupSpec(gid=gid, prompt_ids=PROMPT, n=n, max_new_tokens=max_new, temperature=0.0, top_p=1.0,
                       seed=100, stop_ids=[])
    client.call(M.SubmitStep(step=step, version=version, groups=[spec]))


@pytest.mark.slow
def test_slow_builds_first_steps_and_weight_loads_never_make_an_instance_look_dead(stories260k_hf_dir):
    """Default deadline (4 s, heartbeats every 0.25 s from the agent's I/O thread): a 6 s engine build, a 10 s
    first step and a 30 s load of version 1 — the instance is never suspected, nothing migrates, it serves both
    versions."""
    config, sd = load_hf_dir(stories260k_hf_dir)
    server = WeightServer().start()
    mproc, endpoint, _ = spawn_manager(ManagerSettings(pending_limit=32, heartbeat_s=0.25, heartbeat_timeout_s=4.0))
    client = ManagerClient(endpoint, alive=mproc.is_alive)
    worker = None
    try:
        client.call(M.TrainerHello(weights_endpoint=server.endpoint, model_config=config.to_hf_dict(),
                                   model_arch=config.to_json()))
        server.publish(0, sd, dtype=torch.float32)
        client.call(M.SetVersion(version=0))
        worker = subprocess.Popen([sys.executable, str(TESTS / "slow_worker.py"), endpoint, server.endpoint, "slow",
                                   "--build-s", "6", "--first-step-s", "10", "--load-s", "30"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_stats(client, lambda s: s.routable_preemptible == 1, timeout=60)
        _group(client, 4, "a", max_new=32)
        ev = client.next_event(60)
        assert isinstance(ev, M.GroupDone) and all(len(M.unpack_i32(r.ids)) == 32 for r in ev.responses)
        client.send(M.AckGroup(gid="a"))
        server.publish(1, {k: v * 1.01 for k, v in sd.items()}, dtype=torch.float32)
        client.call(M.SetVersion(version=1))
        t0 = time.monotonic()
        wait_stats(client, lambda s: s.routable_preemptible == 1 and s.instances["slow#0"].version == 1,
                   timeout=90)
        assert time.monotonic() - t0 >= 25  # the 30 s load really happened (on the agent's main thread)
        _group(client, 4, "b", step=1, version=1, max_new=32)
        ev = client.next_event(60)
        assert isinstance(ev, M.GroupDone) and ev.gid == "b"
        st = client.stats()
        assert st.instances_suspected == 0 and st.responses_migrated == 0, st
        assert worker.poll() is None
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(10)
        try:
            client.call(M.Shutdown(reason="test"), timeout_s=5)
        except Exception:  # noqa: BLE001
            pass
        client.close()
        mproc.join(5)
        server.close()


def test_a_killed_worker_leaves_routing_when_its_connection_closes(harness):  # noqa: F811
    """Dead is not alive: SIGKILL closes the worker's TCP connection; the manager takes the instance out of
    routing and its work back at once (measured; the heartbeat deadline is 2 s), and the work finishes on the
    other worker."""
    h = harness
    victim = h.worker("victim")
    h.worker("other")
    wait_stats(h.client, lambda s: s.routable_preemptible == 2)
    _group(h.client, 8, "g")
    wait_stats(h.client, lambda s: "victim#0" in s.instances and s.instances["victim#0"].partial > 0)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    st = wait_stats(h.client, lambda s: s.instances["victim#0"].state == "suspect", timeout=10)
    left = time.monotonic() - t0
    assert st.instances["victim#0"].inflight == 0 and st.connections_closed >= 1
    ev = h.client.next_event(120)
    assert isinstance(ev, M.GroupDone)
    ref = reference(h, 8, 0.0)
    for r in ev.responses:
        assert M.unpack_i32(r.ids).tolist() == ref[r.rid][0]
    print(f"time to leave routing after SIGKILL: {left * 1000:.0f} ms")
    assert left < 1.0, f"{left:.2f} s (heartbeat deadline 2 s): the closed connection was not noticed"


def test_a_tcp_reset_between_a_worker_and_the_manager_loses_nothing(harness):  # noqa: F811
    """The worker's connection goes through a forwarder that resets it mid-stream: the worker reconnects under
    the same identity (no exit, no re-registration), responses complete exactly, nothing is trained twice."""
    h = harness
    fwd = TcpForwarder(h.endpoint)
    run_dir = h.run_dir / "fwd"
    RunDir(run_dir).write_endpoints(fwd.endpoint, h.server.endpoint, run_id="test")
    w = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.rollout.worker", "--run-dir", str(run_dir), "--job-id",
                          "flaky", "--attempt", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    h.procs.append(w)
    try:
        wait_stats(h.client, lambda s: s.routable_preemptible == 1)
        _group(h.client, 4, "g")
        wait_stats(h.client, lambda s: s.tokens_received > 100)
        fwd.reset()
        ev = h.client.next_event(120)
        assert isinstance(ev, M.GroupDone)
        ref = reference(h, 4, 0.0)
        for r in ev.responses:
            assert M.unpack_i32(r.ids).tolist() == ref[r.rid][0]
        st = h.client.stats()
        assert w.poll() is None and st.registrations == 1 and st.rejected_registrations == 0, st
        assert st.instances["flaky#0"].state in ("ready", "pulling"), st
    finally:
        fwd.close()


def test_a_tcp_reset_between_the_trainer_and_the_manager_loses_nothing(harness):  # noqa: F811
    """The trainer's client goes through a forwarder reset while a step runs: calls are resent with their call
    id (answered idempotently), finished groups not yet acknowledged are delivered again; every group arrives."""
    h = harness
    h.worker("w")
    fwd = TcpForwarder(h.endpoint)
    client = ManagerClient(fwd.endpoint, resend_s=0.5)
    try:
        client.call(M.TrainerHello(weights_endpoint=h.server.endpoint, model_config=h.config.to_hf_dict()))
        wait_stats(client, lambda s: s.routable_preemptible == 1)
        specs = [M.GroupSpec(gid=f"g{i}", prompt_ids=PROMPT, n=2, max_new_tokens=64, temperature=0.0, top_p=1.0,
                             seed=100, stop_ids=[]) for i in range(4)]
        client.call(M.SubmitStep(step=0, version=0, groups=specs))
        got = {}
        deadline = time.monotonic() + 120
        while len(got) < 4 and time.monotonic() < deadline:
            if len(got) == 1 and fwd.resets == 0:
                fwd.reset()
            ev = client.next_event(5)
            if isinstance(ev, M.GroupDone):
                got.setdefault(ev.gid, ev)
                client.send(M.AckGroup(gid=ev.gid))
        assert sorted(got) == ["g0", "g1", "g2", "g3"]
        client.call(M.SetVersion(version=0))  # a call after the reset: answered (idempotent)
    finally:
        client.close()
        fwd.close()


@pytest.mark.slow
def test_every_worker_stopped_for_6_s_during_the_demo_comes_back_and_serves(repo_root, tmp_path):
    """Case L3: SIGSTOP every preemptible worker for 6 s (past the 4 s deadline) mid-run, then SIGCONT: they
    become suspect (their work finishes on the reserved engine), come back without re-registering, serve the
    following steps; nothing lost, duplicated or trained off-version; no worker exits."""
    import json
    import threading

    import psutil

    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n")  # two workers for the whole run: any return is the same process
    out = tmp_path / "run"
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(out), "--no-progress"]
    for s in ("trainer.steps=24", f"cluster.trace='{trace}'", "cluster.time_scale=1.0", "cluster.replay_s=600",
              "cluster.window_start_s=0", "policy.cap=false"):
        args += ["--set", s]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo_root)
    stalled: dict = {}

    def stall() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "rlboost_hpc.rollout.worker" in " ".join(c.cmdline())]
        stalled["pids"] = [w.pid for w in workers]
        stalled["at_step"] = len((out / "metrics.jsonl").read_text().splitlines())
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        time.sleep(6.0)
        for w in workers:
            w.send_signal(signal.SIGCONT)

    t = threading.Thread(target=stall, daemon=True)
    t.start()
    stdout, stderr = proc.communicate(timeout=600)
    t.join(10)
    assert proc.returncode == 0, stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert len(stalled["pids"]) == 2, stalled
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["instances_suspected"] >= 2 and rep["instances_recovered"] >= 2, rep
    assert rep["worker_starts"] == 2 and rep["preemptions"] == 0  # the same two processes throughout
    print("suspect cost:", {k: rep[k] for k in ("instances_suspected", "instances_recovered", "responses_migrated",
                                                  "tokens_migrated", "late_tokens_dropped", "tokens_regenerated")})
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    after = [m for m in steps[stalled["at_step"] + 3:] if m["preemptible_instances_served"] > 0]
    assert after, "the returned workers served no later step"
