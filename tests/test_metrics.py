"""The manager's Prometheus endpoint serves the run's metrics (issue 7 §5)."""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import HeldOutEvaluation
from rlboost_hpc.trainer.client import ManagerClient

pytestmark = pytest.mark.integration


def test_metrics_endpoint_exposes_manager_state():
    proc, endpoint, url = spawn_manager(ManagerSettings(pending_limit=8), metrics_host="127.0.0.1")
    client = ManagerClient(endpoint)
    try:
        client.call(M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
        client.call(M.SetVersion(version=3))
        client.send(M.PolicyState(t_seed_s=1.5, n_prem_cap=4))
        client.send(M.Evaluation(when="before", result=HeldOutEvaluation(  # (issue 58 item 5: pass@k in Prometheus)
            version=0, reward_sampled=0.25, reward_greedy=0.5, pass_at_k={"1": 0.1875, "4": 0.4375})))
        time.sleep(1.0)  # one snapshot refresh
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        client.call(M.Shutdown(reason="test"), timeout_s=5)
        client.close()
        proc.join(5)
    for name in ["rlboost_tokens_received_total", "rlboost_responses_migrated_total", "rlboost_queued_requests",
                 "rlboost_instances_suspected_total", "rlboost_instances_lost", "rlboost_weight_pull_duration_seconds_count",
                 "rlboost_tokens_regenerated_total", "rlboost_balancer_moves_total"]:
        assert name in text, name
    assert 'rlboost_latest_weight_version{run=""} 3.0' in text
    assert 'rlboost_t_seed_seconds{run=""} 1.5' in text and 'rlboost_n_prem_cap{run=""} 4.0' in text
    assert 'rlboost_heldout_pass_at_k_ratio{k="1",run="",when="before"} 0.1875' in text
    assert 'rlboost_heldout_pass_at_k_ratio{k="4",run="",when="before"} 0.4375' in text
    assert 'rlboost_heldout_reward{decoding="greedy",run="",when="before"} 0.5' in text
    assert 'rlboost_heldout_weight_version{run="",when="before"} 0.0' in text and 'when="after"' not in text


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
    core = ManagerCore(clock=lambda: 0.0)  # a run under way: every series has a value
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0))
    core.on_message(b"t", M.PolicyState(t_seed_s=1.0, n_prem_cap=2))
    core.on_message(b"t", M.Evaluation(when="before", result=HeldOutEvaluation(
        version=0, reward_sampled=0.2, reward_greedy=0.3, pass_at_k={"1": 0.2})))
    core.on_message(b"t", M.StepTimes(step=0, wall_s=2.0, phases={"seeding": 2.0}, fixed_overhead_s=0.0,
                                      mismatch={k: 0.01 for k in ("logprob_diff", "logprob_diff_max", "mismatch_kl",
                                                                  "mismatch_outside_clip_share",
                                                                  "mismatch_capped_share")}))
    core.on_message(b"i", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
    core.on_message(b"i", M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.1, load_s=0.0))
    core.on_message(b"t", M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(
        gid="s0g0", prompt_ids=[1, 2], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0, stop_ids=[9])]))
    core.tick()  # dispatched to j#0, which is cut by its budget: one truncated response
    core.on_message(b"i", M.Tokens(rids=["s0g0/0"], offsets=[0], counts=[2], versions=[0], finish=[M.FINISH_LENGTH],
                                   ids=M.pack_i32([5, 6]), logprobs=M.pack_f32([-1.0, -1.0])))
    mm.refresh(core)
    sm = ScavengerMetrics(1.0, 2.0)
    res = SimpleNamespace(submitted=[], cancelled=[], signalled=[], ok=True, target=SimpleNamespace(n=2, active=True),
                          desired=2, live=2, pending=1, running=1, draining=0, free_slots=3, held=0)
    sm.refresh(res, SimpleNamespace(gpu_hours=1.0, tokens_produced=10, preemptions=0, requeues=0, attempts=2))
    exported = set()
    for c in (mm, sm):
        reg = CollectorRegistry()
        reg.register(c)
        exported |= set(re.findall(r"^(rlboost_\w+)", generate_latest(reg).decode(), flags=re.M))
    dash = json.loads((repo_root / "rlboost_hpc/observe/grafana/rlboost-manager.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"rlboost_\w+", t["expr"])}
    assert used and used <= exported, sorted(used - exported)


def test_scraped_metrics_follow_prometheus_conventions(tmp_path):
    """Issue 16: a running manager and a running scavenger scraped over HTTP and parsed with prometheus_client:
    base units in names, ``_total`` counters, a Histogram for pull durations, no sentinel values, the ``run``
    label on every series, no label named ``instance``; file_sd target files in the run directory."""
    import json
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    from rlboost_hpc.rundir import RunDir
    from scavenger.config import ScavengerConfig
    from scavenger.daemon import Scavenger

    sys.path.insert(0, str(Path(__file__).parent))
    from test_scavenger import FakeClock, FakeSlurm

    proc, endpoint, url = spawn_manager(ManagerSettings(pending_limit=8), metrics_host="127.0.0.1", run_id="r42")
    client = ManagerClient(endpoint)
    try:
        client.call(M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
        client.call(M.SetVersion(version=0))
        client.call(M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
        client.call(M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.3, load_s=0.0))
        client.send(M.StepTimes(step=0, wall_s=3.0, phases={"seeding": 2.0, "train": 1.0}, fixed_overhead_s=0.25,
                                mismatch={"logprob_diff": 0.046, "logprob_diff_max": 0.385, "mismatch_kl": 0.002,
                                          "mismatch_outside_clip_share": 0.013, "mismatch_capped_share": 0.001},
                                rewards={"correct": 0.25, "judge": 0.5}))
        time.sleep(1.0)  # one snapshot refresh
        manager_text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        client.call(M.Shutdown(reason="test"), timeout_s=5)
        client.close()
        proc.join(5)
    RunDir(tmp_path).write_file_sd("rlboost-manager", url, "r42")
    clock = FakeClock()
    run_dir = tmp_path / "r42"
    run_dir.mkdir()
    (run_dir / "target.json").write_text(json.dumps({"n_prem": 1, "active": True}))
    script = tmp_path / "rollout.sbatch"
    script.write_text("#!/bin/bash\n")
    sc = Scavenger(ScavengerConfig(metrics_port=0, run_id="r42"), run_dir, slurm=FakeSlurm(clock), clock=clock,
                   script=script)
    scav_url = sc.start_metrics()
    sc.run_forever(max_cycles=1)
    scav_text = urllib.request.urlopen(scav_url, timeout=10).read().decode()
    for text in (manager_text, scav_text):
        fams = list(text_string_to_metric_families(text))
        assert fams
        for fam in fams:
            assert "hours" not in fam.name and "dollar" not in fam.name.replace("_dollars", ""), fam.name
            for smp in fam.samples:
                assert "instance" not in smp.labels, (fam.name, smp.labels)
                assert smp.labels.get("run") == "r42", (fam.name, smp.labels)
                assert smp.value >= 0, (fam.name, smp)  # no -1 "no value" sentinels
                if fam.type == "counter":
                    assert smp.name.endswith(("_total", "_created")), smp.name
    for text in (manager_text, scav_text):  # the serving process's own resources (issue 28), with the run label
        assert 'process_resident_memory_bytes{run="r42"}' in text and 'process_cpu_seconds_total{run="r42"}' in text
    types = {f.name: f.type for f in text_string_to_metric_families(manager_text)}
    assert types["rlboost_weight_pull_duration_seconds"] == "histogram"
    assert 'rlboost_weight_pull_duration_seconds_bucket{le="0.5",run="r42"} 1.0' in manager_text
    # the step timeline: durations as a Histogram, phases as parts of the wall time, instance-seconds by activity
    assert types["rlboost_step_duration_seconds"] == "histogram"
    assert 'rlboost_step_duration_seconds_bucket{le="5.0",run="r42"} 1.0' in manager_text
    assert 'rlboost_step_phase_seconds_total{phase="seeding",run="r42"} 2.0' in manager_text
    assert 'rlboost_step_fixed_overhead_seconds_total{run="r42"} 0.25' in manager_text
    assert types["rlboost_rollout_instance_seconds"] == "counter"
    # the trainer's engine–trainer mismatch of its last step, as gauges in base units (nats, ratios)
    assert 'rlboost_step_logprob_diff_nats{run="r42"} 0.046' in manager_text
    assert 'rlboost_step_logprob_diff_max_nats{run="r42"} 0.385' in manager_text
    assert 'rlboost_step_mismatch_kl_nats{run="r42"} 0.002' in manager_text
    assert 'rlboost_step_mismatch_outside_clip_ratio{run="r42"} 0.013' in manager_text
    assert 'rlboost_step_mismatch_capped_ratio{run="r42"} 0.001' in manager_text
    # a user's task (issue 48): each reward function's mean over the last step
    assert 'rlboost_step_reward{function="correct",run="r42"} 0.25' in manager_text
    assert 'rlboost_step_reward{function="judge",run="r42"} 0.5' in manager_text
    assert 'rlboost_instance_activity_seconds_total{activity="idle",rollout_instance="j#0",run="r42"}' in manager_text
    for job in ("rlboost-manager", "rlboost-scavenger"):
        sd_dir = tmp_path if job == "rlboost-manager" else run_dir
        [entry] = json.loads((sd_dir / "prometheus" / f"{job}.json").read_text())
        assert entry["labels"]["run"] == "r42" and entry["labels"]["job"] == job and len(entry["targets"]) == 1


def test_grafana_dashboard_has_panel_ids_and_a_run_variable(repo_root):
    import json

    dash = json.loads((repo_root / "rlboost_hpc/observe/grafana/rlboost-manager.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    assert any(v["name"] == "run" for v in dash["templating"]["list"])
    assert all('run="$run"' in t["expr"] for p in dash["panels"] for t in p["targets"])

