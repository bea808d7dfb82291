"""megatron_bridge across processes: ``python -m megatron_bridge.launch --nproc-per-node 2`` (gloo, CPU) at TP=2,
PP=2 (stories260K's 5 layers split 3 + 2, tied embeddings across stages, 1F1B over several micro-batches) and
DP=2 with the distributed optimizer, in leader mode (rank 0 runs the program, rank 1 follows); and the
ordinary RL run with the Megatron backend at TP=1 and TP=2.

Each 2-process job runs ``tests/megatron_scenarios.py parallel`` on rank 0: the same checks as the TP=1 tests
(logits vs ``transformers``, gathered export round trip, sharded publish → parallel pull → assembly, GRPO step
numbers vs the torch backend on the same batches, exact resume from ``dist_checkpointing``). The launcher
picks a free rendezvous port per job (``torchrun --standalone``), so jobs never share a MASTER_PORT.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_megatron_bridge import check_parity

from _util import SCENARIOS  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.integration]

CONTRACT_KEYS = ["steps", "reward_heldout_before", "reward_heldout_after", "responses_trained", "responses_lost",
                 "responses_duplicated", "preemptions", "responses_migrated", "tokens_regenerated",
                 "tokens_trained_off_version", "weight_pulls", "throughput_tokens_per_s", "wall_s"]


def _env(repo_root) -> dict:
    return dict(os.environ, PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")


def _launch(repo_root, layout: list[str], program: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_bridge.launch", "--nproc-per-node", "2", *layout, *program]
    return subprocess.run(cmd, cwd=repo_root, env=_env(repo_root), capture_output=True, text=True, timeout=timeout)


def demo_tp2_killing_the_manager(repo_root, out, sets: list[str], after_steps: int, delay_s: float,
                                 timeout: float) -> tuple[int, str, list[int]]:
    """The demo through ``megatron_bridge.launch`` at TP = 2 (two ranks) with ``--set`` overrides ``sets``, its
    manager SIGKILLed ``delay_s`` after step ``after_steps`` while the next rollout is in flight
    (``test_manager_restart._kill_manager_at``); (exit code, stderr, the killed pids)."""
    from test_manager_restart import _kill_manager_at

    cmd = [sys.executable, "-m", "megatron_bridge.launch", "--nproc-per-node", "2", "--tp", "2", SCENARIOS, "demo",
           "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, cwd=repo_root, env=_env(repo_root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        killed = _kill_manager_at(out, [after_steps], delay_s, proc)
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err, killed


def _parallel(repo_root, models, out, layout, extra=()):
    p = _launch(repo_root, layout, [SCENARIOS, "parallel", "--models", str(models),
                                    "--out", str(out), *extra])
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp2(repo_root, stories260k_hf_dir, tmp_path_factory):
    return _parallel(repo_root, stories260k_hf_dir.parent, tmp_path_factory.mktemp("tp2") / "r.json", ["--tp", "2"])


@pytest.fixture(scope="module")
def pp2(repo_root, stories260k_hf_dir, tmp_path_factory):
    return _parallel(repo_root, stories260k_hf_dir.parent, tmp_path_factory.mktemp("pp2") / "r.json", ["--pp", "2"])


@pytest.fixture(scope="module")
def dp2(repo_root, stories260k_hf_dir, tmp_path_factory):
    return _parallel(repo_root, stories260k_hf_dir.parent, tmp_path_factory.mktemp("dp2") / "r.json", [],
                     ["--distributed-optimizer"])


@pytest.mark.parametrize("model", ["stories", "qwen3"])
def test_tp2_matches_the_reference(tp2, model):
    r = tp2[model]
    assert r["layout"] == {"tp": 2, "pp": 1, "dp": 1, "world": 2}
    check_parity(r)
    if model == "qwen3":  # vocab 301 padded to 302: the padded logit is masked, never exported
        assert r["logits_shape_ok"] and r["shards"]["names_ok"]


@pytest.mark.parametrize("model", ["stories", "qwen3"])
def test_pp2_matches_the_reference(pp2, model):
    r = pp2[model]
    assert r["layout"] == {"tp": 1, "pp": 2, "dp": 1, "world": 2}
    check_parity(r)


@pytest.mark.parametrize("model", ["stories", "qwen3"])
def test_dp2_distributed_optimizer_matches_the_reference(dp2, model):
    r = dp2[model]
    assert r["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2} and r["options"] == {"distributed_optimizer": "True"}
    check_parity(r)


def test_lora_with_tp_sharded_a_and_b_matches_peft_at_every_layout(tp2, pp2, dp2):
    """Issue 49: LoRA on the column/row-parallel linears at TP=2 (A or B sharded per layer kind), PP=2 (each stage its
    layers' adapters) and DP=2 with the distributed optimizer, against PEFT on the torch backend."""
    from test_megatron_bridge import check_lora_parity

    for r in (tp2["lora"], pp2["lora"], dp2["lora"]):
        check_lora_parity(r)
    assert tp2["lora"]["layout"]["tp"] == 2 and pp2["lora"]["layout"]["pp"] == 2 and dp2["lora"]["layout"]["dp"] == 2


def test_resume_is_exact_at_every_layout(tp2, pp2, dp2):
    for r in (tp2["stories"], pp2["stories"], dp2["stories"]):
        assert r["resume"]["exact"] and r["resume"]["weights_maxabs"] == 0.0, (r["layout"], r["resume"])


@pytest.mark.slow
def test_default_demo_with_the_megatron_backend_meets_the_report_contract(repo_root, tmp_path):
    """The walking skeleton's default demo (60 steps, real workers and preemptions) with MegatronBackend (TP=1)
    constructed where run.py constructs the torch backend."""
    out = tmp_path / "demo"
    # a warned preemption waits until a worker holds a partial response (cluster.preempt_when_busy): one that finds
    # the worker idle between versions migrates nothing, and the migration is what this test needs to see
    p = subprocess.run([sys.executable, SCENARIOS, "demo", "--out", str(out),
                        "--set", "cluster.preempt_when_busy=true"],
                       cwd=repo_root, env=_env(repo_root), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.loads((out / "report.json").read_text())
    for k in CONTRACT_KEYS:
        assert isinstance(rep[k], (int, float)), k
    assert rep["reward_heldout_after"] > rep["reward_heldout_before"] + 0.3
    # How many of the replayed removals land inside the run depends on its wall time (the demo's own test, with
    # the torch backend, asks for 2); the backend is not what is tested here, so one is enough.
    assert rep["preemptions"] >= 1 and rep["responses_migrated"] >= 1
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0


def test_rl_run_at_tp2_through_the_launcher(repo_root, tmp_path):
    """Rank 0 runs the ordinary RL program (manager, workers); rank 1 follows its backend calls. Both TP ranks serve
    their own weight shards; instances pull from both and assemble HF tensors."""
    out = tmp_path / "demo-tp2"
    p = _launch(repo_root, ["--tp", "2"], [SCENARIOS, "demo", "--out", str(out),
                                           "--set", "trainer.steps=4", "--set", "task.heldout_prompts=8",
                                           "--set", "trainer.eval_samples=1"], timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 4 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["responses_trained"] == 4 * 64
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(m["logprob_diff"]) < 0.05 for m in lines)  # trainer logprobs agree with the engine's
    # sharded serving (issue 14): each TP rank served its own pieces to the instances; nothing was gathered
    shards = rep["weight_shards"]
    assert shards["gathered_exports"] == 0
    assert sorted(h["position"] for h in shards["holders"]) == ["tp0-pp0", "tp1-pp0"]
    assert all(h["bytes_served"] > 0 and h["publishes"] == 5 for h in shards["holders"]), shards
    assert all(h["sealed_bytes_served"] == h["bytes_served"] + h["delta_bytes_served"] for h in shards["holders"])
    assert rep["weight_update_bytes_mean"] < rep["weight_bytes"] / 2  # deltas per holder
    assert rep["weight_checksum_mismatches"] == 0 and rep["weight_pull_failures"] == 0


@pytest.mark.chaos
def test_a_manager_killed_mid_step_under_tp2_is_restarted_without_touching_the_ranks(repo_root, tmp_path):
    """Issue 33 item 5: rank 0's manager is SIGKILLed while a step's rollout is in flight; the trainer restarts it
    and the step continues from the work log. The distributed group (rank 1 following rank 0's backend calls) is
    never touched: the run ends normally with nothing lost, duplicated or trained off-version."""
    out = tmp_path / "demo-tp2"
    rc, err, killed = demo_tp2_killing_the_manager(
        repo_root, out, ["trainer.steps=4", "task.heldout_prompts=8", "trainer.eval_samples=1"], 2, 0.2, 300)
    assert rc == 0, err[-4000:]
    rep = json.loads((out / "report.json").read_text())
    assert len(killed) == 1 and rep["manager_restarts"] == 1 and rep["resumes"] == 0
    assert rep["steps"] == 4 and rep["responses_trained"] == 4 * 64
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0


def test_followers_waiting_past_the_collective_timeout_stay_alive(repo_root):
    """Regression (issue 16): ranks other than 0 waited for the next call in a gloo collective whose timeout was
    fixed (1,800 s) and unrelated to how long a step's rollout takes; scaled down (5 s timeout, the leader idle
    12 s) rank 1 died. The leader's keepalive broadcasts a no-op every timeout/4 while it is idle."""
    cmd = [sys.executable, "-m", "megatron_bridge.launch", "--nproc-per-node", "2", "--tp", "2",
           str(repo_root / "tests" / "megatron_idle.py"), "12"]
    p = subprocess.run(cmd, cwd=repo_root, env=dict(_env(repo_root), MEGATRON_BRIDGE_TIMEOUT_S="5"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]

