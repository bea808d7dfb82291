"""The main job with SGLang preemptible workers (issue 5 acceptance): real SGLang servers on CPU, real preemptions;
and a LoRA run whose versions reach an SGLang worker as adapters (issue 57).

Each preemptible worker starts its own SGLang server (``rollout.engine = "sglang"``; start-up 30–45 s on this
box, off the agent's heartbeat loop); the reserved seeding engine stays torch. Responses therefore migrate
torch → SGLang (seeding hand-off) and SGLang → torch/SGLang (warned preemptions), and the walking skeleton's
report contract must hold. CPU route only: the import-time stand-ins go into the servers' environment through
``rollout.sglang.env`` (test tooling, tests/sglang_cpu).
"""
from __future__ import annotations

import json
import re

import psutil
import pytest

from sglang_cpu import stub_env
from test_demo_run import CONTRACT_KEYS, MARGIN, diagnose, run_cli

# 40 steps take ≈ 2.5 min on an idle 2-core machine and several times that under load: the run is waited for as
# long as it makes progress (run_cli), the pytest timeout is only the last resort
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(2400)]

# Two slots from the start, preempted by progress, not by the clock: a warned preemption is due at every 15th step
# (cluster.faults.every_steps) and fires at the first moment a worker holds a partial response at the manager
# (cluster.preempt_when_busy: a preemption that finds its server idle hands nothing off). A worker's start-up (its
# SGLang server boots, then loads the pulled weights) takes 30–45 s on this 2-core box while the run goes on, so
# the preemptions come as early as start-ups allow, whatever the machine's load: the two slots boot at once, the
# first preemption fires once one of them serves (step ≈ 20 here), the second on the other (or a replacement) from
# step 30, after ≥ 10 steps of seeding hand-offs into it. A trace with removals at fixed seconds needed 90 steps (the
# run had to outlast three removals held for busy workers: 240–427 s); 60 steps by progress took 251 s (two SGLang
# servers on 2 cores slow a step from ≈ 3 to ≈ 4.5 s), all three preemptions with tokens handed off.
TRACE = "0,add,a0\n0,add,a1\n"


def test_demo_with_sglang_workers_meets_the_report_contract(repo_root, tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE)
    env = stub_env()
    p = run_cli(repo_root, tmp_path / "run", 'rollout.engine="sglang"', 'rollout.device="cpu"',
                *[f'rollout.sglang.env.{k}="{v}"' for k, v in env.items()],
                f'cluster.trace="{tmp_path / "trace.csv"}"', "cluster.time_scale=1.0", "cluster.replay_s=300",
                "cluster.window_start_s=0", "cluster.max_workers=2", "policy.cap=false", "trainer.steps=40",
                "cluster.preempt_when_busy=true", "cluster.faults.every_steps=15", 'cluster.faults.kinds=["preempt"]',
                # steps long enough (128 responses × 96 tokens) that the reserved engine cannot finish one
                # alone within a fixed seeding window that outlasts the server's per-step weight load
                # (pull + load ≈ 0.3 s): its partial responses are then handed over to the SGLang server
                "rollout.prompts_per_step=16", "rollout.max_new_tokens=96",
                # the window closes at T_seed, not once a group is ready (by then the reserved engine has
                # finished its batch and has little partial left to hand over)
                "policy.t_seed_initial_s=0.6", "policy.adaptive_seeding=false", "policy.seed_until_trainable=false")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "run/report.json").read_text())
    for k in CONTRACT_KEYS:
        assert isinstance(rep[k], (int, float)), k
    assert rep["rollout_engine"] == "sglang"
    assert rep["reward_heldout_after"] > rep["reward_heldout_before"] + MARGIN
    why = diagnose(p, tmp_path / "run")
    assert rep["preemptions_with_warning"] >= 2, why
    mig = rep["migrations_by_engine"]
    assert mig["into"].get("sglang", 0) >= 1, why  # partial responses resumed on an SGLang server
    assert mig["out_of"].get("sglang", 0) >= 1, why  # ... and handed off by a preempted one
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["tokens_regenerated"] == 0  # warned preemptions only: every produced token was handed over
    # every worker started its server and no server outlived its worker
    logs = sorted((tmp_path / "run/workers").glob("slot*-attempt*.log"))
    pids = [int(m) for f in logs for m in re.findall(r"sglang server pid (\d+)", f.read_text())]
    assert len(pids) >= 3, [f.name for f in logs]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_multi_turn_trajectories_on_sglang_workers(repo_root, tmp_path):
    """Issue 17 with SGLang: every turn an SGLang server generates is the current turn only (its prompt holds the
    earlier turns and observations as ids); trajectories resume on the server after the reserved engine's seeding
    and after a warned preemption (due from step 15, fired once the worker serves); nothing lost, duplicated or
    off-version."""
    # one slot, preempted by progress as in the demo above (a wall-clock removal at 60 s needed 40 steps): a warned
    # preemption is due from step 15 and fires once the worker serves (its server boots in 30–45 s meanwhile)
    (tmp_path / "trace.csv").write_text("0,add,a0\n")
    env = stub_env()
    out = tmp_path / "run"
    p = run_cli(repo_root, out, 'rollout.engine="sglang"', 'rollout.device="cpu"',
                *[f'rollout.sglang.env.{k}="{v}"' for k, v in env.items()],
                f'cluster.trace="{tmp_path / "trace.csv"}"', "cluster.time_scale=1.0", "cluster.replay_s=300",
                "cluster.window_start_s=0", "cluster.max_workers=1", "policy.cap=false", "trainer.steps=30",
                "cluster.preempt_when_busy=true", "cluster.faults.every_steps=15", 'cluster.faults.kinds=["preempt"]',
                "task.turns.max=3",
                "task.turns.tool_call_open=''", "task.turns.tool_call_close='.'", "task.heldout_prompts=8",
                "rollout.prompts_per_step=16", "rollout.max_new_tokens=32", "policy.t_seed_initial_s=0.6",
                "policy.adaptive_seeding=false")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    why = diagnose(p, out)
    assert rep["rollout_engine"] == "sglang" and rep["environment_calls"] > 0, why
    assert rep["turns_per_trajectory_mean"] > 1.0, why
    assert rep["migrations_by_engine"]["into"].get("sglang", 0) >= 1, why
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, why
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0, why


def test_a_lora_run_serves_each_adapter_version_from_sglang_workers(repo_root, tmp_path):
    """Issue 57 (second list: SGLang with LoRA was shown on an engine built by hand with a made-up base checksum):
    ``rlboost-hpc run`` of the tiny Qwen3 with ``trainer.lora`` on an SGLang worker. The worker loads the base once
    (from model.path, which it sees) and every version after as an adapter through SGLang's adapter API; the steps it
    serves hold its tokens, and the logprobs it served equal the trainer's with that step's adapter (a server serving
    the base or another version would not: the adapter trains at lr 5e-3). No preemption here (the demo's test above
    has them): the run is sized for one server's start-up (≈ 40 s) plus ≥ 5 steps of service."""
    from _models import make_model_dir

    model = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False, seed=3)
    (tmp_path / "trace.csv").write_text("0,add,a0\n")
    out = tmp_path / "run"
    p = run_cli(repo_root, out, f"model.path='{model}'", "task.name=gsm8k", "trainer.steps=40",
                "task.train_prompts=320", "task.heldout_prompts=4", "trainer.eval_samples=1",
                "rollout.prompts_per_step=8", "rollout.max_new_tokens=48", "weights.dtype=float32",
                'rollout.engine="sglang"', 'rollout.device="cpu"',
                *[f'rollout.sglang.env.{k}="{v}"' for k, v in stub_env().items()],
                f'cluster.trace="{tmp_path / "trace.csv"}"', "cluster.time_scale=1.0", "cluster.replay_s=600",
                "cluster.window_start_s=0", "cluster.max_workers=1", "policy.cap=false",
                "trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lr=5e-3",
                'trainer.lora.target_modules=["all-linear"]', "policy.t_seed_initial_s=0.3",
                "policy.adaptive_seeding=false", "policy.seed_until_trainable=false")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    why = diagnose(p, out)
    assert rep["rollout_engine"] == "sglang" and rep["steps"] == 40, why
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0, why
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["weight_checksum_mismatches"] == 0, why
    assert rep["lora"]["base_loads"]["path"] == 1 and rep["lora"]["base_pulled_bytes"] == 0, rep["lora"]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    served = [m for m in steps if m["rollout_by_kind"]["preemptible"]["tokens"] > 0]
    assert len({m["version"] for m in served}) >= 5, ([m["step"] for m in served], why)
    # the behaviour logprobs (SGLang's on those steps) are the trainer's under the step's adapter
    assert all(m["logprob_diff_max"] < 1e-3 for m in served), [(m["step"], m["logprob_diff_max"]) for m in served]
    assert max(m["logprob_diff_max"] for m in steps) < 1e-3
    from safetensors.torch import load_file  # ... and the adapter trained: it is not the base
    adapter = load_file(out / "adapter/adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
