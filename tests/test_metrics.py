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
                 "rlboost_instances_lost_total", "rlboost_weight_pulls_total", "rlboost_tokens_regenerated_total"]:
        assert name in text, name
    assert "rlboost_latest_weight_version 3.0" in text
    assert "rlboost_t_seed_seconds 1.5" in text and "rlboost_n_prem_cap 4.0" in text
