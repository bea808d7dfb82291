"""The simulator on a live run's own terms (``sim/calibrate.py``): the calibration bugs bench_live_vs_sim found
(issue 29 item 6)."""
from __future__ import annotations

import json

import pytest

from rlboost_hpc.events import append_event
from rlboost_hpc.sim.calibrate import _availability, measured_boot_s
from rlboost_hpc.sim.profiles import Workload
from rlboost_hpc.sim.workload import step_work


def _local(k: int) -> dict:
    from rlboost_hpc.config import load_config

    cfg = load_config(None, ["cluster.max_workers=8", f"cluster.instances_per_worker={k}",
                             "rollout.engine='emulated'", "cluster.min_changes=0", "cluster.min_removals=0",
                             "cluster.min_starts=0"])
    return json.loads(cfg.model_dump_json())


def test_a_slot_that_hosts_k_instances_adds_k_instances_to_the_simulated_pool():
    """Regression: with cluster.instances_per_worker = 4 each replayed slot is one worker process of 4 instances,
    but the simulator was given one instance per slot — N_prem and the instances serving a step came out 4× low
    (simulated ÷ live 0.25 and 0.28 at N = 16)."""
    from rlboost_hpc.cluster.local import replay_plan
    from rlboost_hpc.config import ClusterCfg

    cfg = _local(4)
    plan, _ = replay_plan(ClusterCfg(**cfg["cluster"]))
    avail = _availability(cfg, None)
    assert len(plan) > 0 and len(avail.events) == 4 * len(plan)
    for a, group in zip(plan, [avail.events[i:i + 4] for i in range(0, len(avail.events), 4)]):
        assert {e.instance for e in group} == {f"slot{a.slot}.{i}" for i in range(4)}
        assert {e.kind for e in group} == {"add" if a.action == "start" else "remove"}


def test_prompt_lengths_are_not_floored_at_32_tokens_for_a_calibrated_workload():
    """Regression: prompts were clipped to ≥ 32 tokens, so a run whose prompts are 1 token (the demo's stories)
    was simulated with twice its tokens per step, and twice its training time."""
    w = Workload(prompts=8, group=8, max_response=64, min_response=1, response_median=30, prompt_median=1.0,
                 min_prompt=1)
    assert int(step_work(w, 0, 0).prompt.max()) <= 2
    assert int(step_work(Workload(prompts=8, group=8, prompt_median=1.0), 0, 0).prompt.min()) == 32  # the paper's


def test_boot_time_is_the_runs_own_median_process_start_to_weights_loaded(tmp_path):
    phases = {"process_start->agent_start_s": 2.0, "agent_start->welcome_s": 0.1, "welcome->weights_loaded_s": 0.4,
              "weights_loaded->first_token_s": 1.0}
    for k, extra in enumerate((0.0, 1.0, 5.0)):
        append_event(tmp_path, {"event": "instance_ready", "job_id": f"j{k}", "attempt": 0,
                                **{**phases, "process_start->agent_start_s": 2.0 + extra}})
    append_event(tmp_path, {"event": "instance_ready", "job_id": "torn", "attempt": 0})  # no phases: skipped
    assert measured_boot_s(tmp_path) == pytest.approx(3.5)
    assert measured_boot_s(tmp_path / "none", default_s=1.0) == 1.0
