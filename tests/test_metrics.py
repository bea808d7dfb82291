"""The manager's Prometheus endpoint serves the run's metrics (issue 7 §5)."""
from __future__ import annotations

import time
import urllib.request

import pytest

from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.trainer.client import ManagerClient

pytestmark = pytest.mark.integration


def test_metrics_endpoint_exposes_manager_state():
    proc, endpoint, url = spawn_manager(dict(pending_limit=8), metrics_host="127.0.0.1")
    client = ManagerClient(endpoint)
    try:
        client.call(M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
        client.call(M.SetVersion(version=3))
        client.send(M.PolicyState(t_seed_s=1.5, n_prem_cap=4))
        time.sleep(1.0)  # one snapshot refresh
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        client.call(M.Shutdown(reason="test"), timeout_s=5)
        client.close()
        proc.join(5)
    for name in ["rlboost_tokens_received_total", "rlboost_responses_migrated_total", "rlboost_queue_depth",
                 "rlboost_instances_suspected_total", "rlboost_instances_lost", "rlboost_weight_pulls_total", "rlboost_tokens_regenerated_total",
                 "rlboost_balancer_moves_total"]:
        assert name in text, name
    assert "rlboost_latest_weight_version 3.0" in text
    assert "rlboost_t_seed_seconds 1.5" in text and "rlboost_n_prem_cap 4.0" in text


def test_grafana_dashboard_queries_only_metrics_that_exist(repo_root):
    """Every ``rlboost_*`` series the dashboard plots is exported by the manager's or the scavenger's collector."""
    import json
    import re
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from rlboost_hpc.manager.core import ManagerCore
    from rlboost_hpc.observe.metrics import ManagerMetrics
    from scavenger.metrics import ScavengerMetrics

    mm = ManagerMetrics()
    core = ManagerCore(clock=lambda: 0.0)
    core.on_message(b"i", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
    mm.refresh(core)
    sm = ScavengerMetrics(1.0, 2.0)
    res = SimpleNamespace(submitted=[], cancelled=[], signalled=[], ok=True, target=None, desired=0, live=0,
                          pending=0, running=0, draining=0, free_slots=None)
    sm.refresh(res, SimpleNamespace(gpu_hours=0.0, tokens_produced=0, preemptions=0, requeues=0, attempts=0))
    exported = set()
    for c in (mm, sm):
        reg = CollectorRegistry()
        reg.register(c)
        exported |= set(re.findall(r"^(rlboost_\w+)", generate_latest(reg).decode(), flags=re.M))
    dash = json.loads((repo_root / "rlboost_hpc/observe/grafana/rlboost-manager.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"rlboost_\w+", t["expr"])}
    assert used and used <= exported, sorted(used - exported)
