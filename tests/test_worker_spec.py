"""The worker spec (rollout/spec.py): one translation from the run config, strict parsing with named keys."""
from __future__ import annotations

import pytest

from rlboost_hpc.config import load_config
from rlboost_hpc.rollout.spec import WorkerSpec, WorkerSpecError


def test_every_rollout_setting_of_the_config_reaches_the_spec_and_survives_json():
    cfg = load_config(None, ["rollout.max_batch=24", "rollout.torch_threads=2", "weights.streams=2",
                             "weights.window=3", "weights.pull_timeout_s=45", "rollout.engine=sglang"])
    spec = WorkerSpec.from_config(cfg)
    assert (spec.max_batch, spec.torch_threads, spec.weight_streams, spec.weight_window, spec.pull_timeout_s) == (
        24, 2, 2, 3, 45.0)
    assert spec.engine["kind"] == "sglang" and "sglang" in spec.engine
    assert WorkerSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("data,key", [({"max_batch": "many"}, "max_batch"), ({"max_batch": 0}, "worker.max_batch"),
                                      ({"weight_streams": 2, "streams": 2}, "streams"),
                                      ({"pull_timeout_s": -1.0}, "worker.pull_timeout_s")])
def test_a_malformed_spec_names_the_file_and_key(data, key):
    with pytest.raises(WorkerSpecError, match=key) as e:
        WorkerSpec.from_json(data, where="/run/endpoints.json")
    assert "/run/endpoints.json" in str(e.value)


def test_a_worker_with_a_malformed_spec_exits_2_naming_the_key(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "endpoints.json").write_text(json.dumps({"manager": "tcp://127.0.0.1:1", "weights": "tcp://x:1",
                                                         "worker": {"max_batch": 0}}))
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.rollout.worker", "--run-dir", str(tmp_path), "--job-id",
                        "j"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "worker.max_batch" in p.stderr and "Traceback" not in p.stderr


def test_a_worker_asked_to_host_several_instances_of_a_real_engine_exits_2(tmp_path):
    """Only emulated instances share a process (``--instances K``): a real engine's K copies would share one device."""
    import json
    import subprocess
    import sys

    spec = WorkerSpec.from_config(load_config(None)).to_json()
    (tmp_path / "endpoints.json").write_text(json.dumps({"manager": "tcp://127.0.0.1:1", "weights": "tcp://x:1",
                                                         "worker": spec}))
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.rollout.worker", "--run-dir", str(tmp_path), "--job-id",
                        "j", "--instances", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--instances 2: only emulated instances" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
