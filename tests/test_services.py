"""RunServices: whatever start-up began is stopped, also when it fails half-way, and quickly."""
from __future__ import annotations

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
        svc.start_rollout()
        deadline = time.monotonic() + 30
        while svc.client.stats().instances.get("reserved#0") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        st = svc.client.stats()
        assert st.latest_version == 0 and man["weight_checksum"] and "reserved#0" in st.instances
        assert RunDir(tmp_path / "run").endpoints.exists()
    assert not svc.manager.proc.is_alive() and svc.manager.proc.exitcode == 0
    assert time.monotonic() - t0 < 30
    leaked = _children() - before
    assert not leaked, leaked
