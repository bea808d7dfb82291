"""RunServices: whatever start-up began is stopped, also when it fails half-way, and quickly."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from rlboost_hpc.config import load_config
from rlboost_hpc.run_setup import RunSetup
from rlboost_hpc.rundir import RunDir
from rlboost_hpc.services import RunServices

pytestmark = pytest.mark.integration


def _children() -> set[int]:
    """Child processes of this one, without multiprocessing's own helpers (the resource tracker lives as long as
    the test process)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if not any("resource_tracker" in a or "forkserver" in a for a in p.cmdline())}


def _services(tmp_path, cfg):
    setup = RunSetup.load(cfg)
    return RunServices(cfg, RunDir(tmp_path / "run"), "svc-test", setup.policy, setup.task, resuming=False,
                       train_device=torch.device("cpu"), train_dtype=torch.float32, t_origin=time.monotonic())


def test_a_start_up_that_fails_half_way_stops_what_it_started(tmp_path, monkeypatch):
    """The backend fails after the weight server and the manager process started: both are stopped, the manager
    (to which no trainer said hello, so it refuses Shutdown) by SIGTERM within seconds, not after a timeout."""
    (tmp_path / "run").mkdir()
    cfg = load_config(None, ["cluster.max_workers=0"])
    started: dict = {}

    def broken_backend(self):
        started["svc"] = self
        raise RuntimeError("backend cannot start")

    monkeypatch.setattr(RunServices, "_backend", broken_backend)
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="backend cannot start"):
        with _services(tmp_path, cfg):
            pass
    assert time.monotonic() - t0 < 15
    svc = started["svc"]
    assert not svc.manager.proc.is_alive() and svc.manager.proc.exitcode == 0  # left its loop on SIGTERM, not killed
    leaked = _children() - before
    assert not leaked, leaked


def test_services_start_hello_and_stop_in_reverse_order(tmp_path):
    """A full cycle without training: the first version published and current at the manager, the reserved
    engine registered; leaving the block stops every process (the manager by the trainer's Shutdown)."""
    (tmp_path / "run").mkdir()
    cfg = load_config(None, ["cluster.max_workers=0"])
    before = _children()
    t0 = time.monotonic()
    with _services(tmp_path, cfg) as svc:
        man = svc.hello(0)
        svc.start_reserved()
        svc.start_rollout()
        deadline = time.monotonic() + 30
        while svc.client.stats().instances.get("reserved#0") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        st = svc.client.stats()
        assert st.latest_version == 0 and man.version.checksum and "reserved#0" in st.instances
        assert RunDir(tmp_path / "run").endpoints.exists()
        pids, share = svc.reserved.pids(), svc.share_dir
        assert len(pids) == 1 and share.is_dir()
    assert not svc.manager.proc.is_alive() and svc.manager.proc.exitcode == 0
    assert time.monotonic() - t0 < 30
    assert not share.exists()  # the versions' shared memory goes with the run
    leaked = _children() - before
    assert not leaked, leaked


def test_a_reserved_engine_that_dies_is_started_again_as_the_next_attempt_and_all_stop_with_the_run(tmp_path):
    """The reserved engines are processes of their own (rollout/reserved.py): one SIGKILLed mid-run comes back as
    the next attempt (a new identity at the manager, never merged with the dead one), the other serves on; leaving
    the block stops both, draining, and leaves no process and no shared memory behind."""
    (tmp_path / "run").mkdir()
    cfg = load_config(None, ["cluster.max_workers=0", "rollout.reserved_engines=2", "rollout.reserved_threads=1"])
    before = _children()

    def wait_for(keys, deadline_s=60.0):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            inst = svc.client.stats().instances
            if all(k in inst and inst[k].state == "ready" for k in keys):
                return inst
            time.sleep(0.1)
        raise AssertionError(f"{keys} not ready: {svc.client.stats().instances}")

    with _services(tmp_path, cfg) as svc:
        svc.hello(0)
        svc.start_reserved()
        wait_for(["reserved#0", "reserved.1#0"])
        first = svc.reserved.pids()
        os.kill(first[0], signal.SIGKILL)
        inst = wait_for(["reserved#1", "reserved.1#0"])
        assert svc.reserved.restarts == 1 and first[0] not in svc.reserved.pids()
        assert inst["reserved#0"].state in ("suspect", "gone")
        logs = sorted(p.name for p in (tmp_path / "run" / "logs").glob("reserved-*.log"))
        assert logs == ["reserved-0-attempt0.log", "reserved-0-attempt1.log", "reserved-1-attempt0.log"]
        share = svc.share_dir
    assert not share.exists()
    leaked = _children() - before
    assert not leaked, leaked
