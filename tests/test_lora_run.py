"""LoRA through the whole system (issue 49): the demo and the tiny Qwen3 train an adapter with ``trainer.lora`` on the
torch and the Megatron backends (CPU), with preemptions, migration and a manager kill losing nothing; nodes that do not
see ``model.path`` pull the base once and keep it; the exported adapter loads with PEFT and the merged model with
transformers, both giving the trained logprobs; a checkpoint of the other kind is refused on resume."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _util import fp32_atol, preempted_run, preempting_cluster
from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.rundir import RunDir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
LORA = ["trainer.lora.rank=4", "trainer.lr=1e-3"]


def _exactly_once(rep: dict, steps: int, responses_per_step: int, why: str, preempted: bool = False) -> None:
    """Every response trained once, none off-version, no instance on other weights; ``preempted``: and at least one
    warned preemption handed partial responses over."""
    assert rep["steps"] == steps and rep["responses_trained"] == steps * responses_per_step, why
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0, why
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["weight_checksum_mismatches"] == 0, why
    if preempted:
        assert rep["preemptions_with_warning"] >= 1 and rep["responses_migrated"] >= 1, why


def _run_killing_the_manager(out: Path, sets: list[str], after_steps: int, *, after_a_preemption: bool = False
                             ) -> tuple[subprocess.CompletedProcess, list[int]]:
    """``rlboost-hpc run`` (the demo's config) with ``sets``, its manager SIGKILLed once while the rollout of the step
    after ``after_steps`` is in flight — with ``after_a_preemption``, not before the step after the first warned
    preemption ended (a worker warned while its manager is down hands its partial responses to no one: they are
    generated again, not migrated) and not after the step before the last; the finished process and the killed
    pids."""
    from test_manager_restart import _kill_manager_at

    from rlboost_hpc.rundir import read_jsonl

    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        rd = RunDir(out)
        while after_a_preemption and proc.poll() is None and not any(
                e.get("event") == "finished" and e.get("state") == "PREEMPTED" and e.get("cause") == "preempt"
                for e in (read_jsonl(rd.events) if rd.events.exists() else [])):
            time.sleep(0.05)
        if after_a_preemption and rd.metrics.exists():
            steps = next(int(s.split("=")[1]) for s in sets if s.startswith("trainer.steps="))
            after_steps = min(max(after_steps, len(rd.metrics.read_text().splitlines()) + 1), steps - 1)
        killed = _kill_manager_at(out, [after_steps], 0.05, proc)
        _, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, "", err), killed


def test_the_demo_trains_an_adapter_with_preemptions_and_a_manager_kill_and_nodes_pull_the_base_once(tmp_path):
    """The demo with ``trainer.lora``: workers that may not read model.path (``base_source = pull``) pull the base once
    and the node's next workers load it from the node cache; a warned preemption hands over partial responses; the
    manager is SIGKILLed while a step's rollout is in flight; nothing is lost, duplicated or off-version; versions are
    the adapter (46 KB, not the model); a resume of this LoRA run without ``trainer.lora`` is refused naming the file."""
    from test_demo_run import diagnose

    out, cache = tmp_path / "run", tmp_path / "node-cache"
    p, killed = _run_killing_the_manager(out, [*LORA, "trainer.steps=5", "trainer.lora.base_source=pull",
                                               f"trainer.lora.node_cache_dir='{cache}'", "cluster.preempt_when_busy=true",
                                               "rollout.max_new_tokens=96"], 2, after_a_preemption=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(RunDir(out).report.read_text())
    why = diagnose(p, out)
    _exactly_once(rep, 5, 64, why, preempted=True)
    assert len(killed) == 1 and rep["manager_restarts"] == 1, why
    lo = rep["lora"]
    # the version is the adapter: 23,120 bf16 parameters (+ the layout's 64-byte alignment), not the model
    assert lo["rank"] == 4 and lo["adapter_bytes"] == rep["weight_bytes"], lo
    assert 0 <= rep["weight_bytes"] - 2 * 23120 < 64 * 70, lo
    assert lo["base_loads"]["pulled"] >= 1 and lo["base_loads"]["trainer"] >= 1, lo  # (the reserved engine)
    assert lo["base_pulled_bytes"] >= lo["base_loads"]["pulled"] * lo["base_bytes"], lo
    # every version pulled moved the adapter's bytes, never the model's (issue 57: shown before on a fake source
    # only; + 4 KiB of framing a pull)
    moved = rep["weight_pulled_bytes"] - lo["base_pulled_bytes"]
    assert 0 < moved <= rep["weight_pulls"] * (lo["adapter_bytes"] + 4096), (moved, rep["weight_pulls"], lo)
    assert lo["base_loads"]["path"] == 0, lo  # base_source = pull: model.path is never read on a node
    # A node's later workers load the base from its cache: the first two workers start together (both pull), every
    # later one finds the cache. Counted as the report counts (a worker that loads its base after the trainer's last
    # stats, in the run's last seconds, is in worker_starts but not in base_loads: a CI run once had 3 starts, the
    # third's cache load after the last step) and as the workers' own logs say.
    counted = lo["base_loads"]["pulled"] + lo["base_loads"]["cache"]
    if counted > 2:
        assert lo["base_loads"]["cache"] >= counted - 2, lo
    loads = [re.search(r"base [0-9a-f]+ loaded from (\w+)", line).group(1)
             for log in sorted((out / "workers").glob("slot*.log")) for line in log.read_text().splitlines()
             if re.search(r"base [0-9a-f]+ loaded from", line)]
    assert 1 <= loads.count("pull") <= 2, loads
    assert loads.count("cache") >= len(loads) - 2, loads
    assert len(list(cache.glob("base-*.bin"))) == 1  # one base kept on the node
    assert rep["reward_heldout_after"] > rep["reward_heldout_before"], why
    # the exported adapter is the last version (PEFT's format), and checkpoints hold the adapter only
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "model").exists()
    ck = torch.load(out / "checkpoints" / "step-000005" / "backend" / "torch_backend.pt", weights_only=True)
    assert "model" not in ck and len(ck["adapter"]) == 5 * 7 * 2
    # a LoRA checkpoint resumed by a config that trains every weight: refused before anything starts
    p2 = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress", "--set",
                         "trainer.steps=6"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p2.returncode == 2 and "trainer.json: a checkpoint of a run that trained a LoRA adapter" in p2.stderr, \
        p2.stderr[-2000:]


def test_the_tiny_qwen3_trains_an_adapter_and_its_exports_load_with_peft_and_transformers(tmp_path):
    """The tiny Qwen3 (chat template, two stop ids) with LoRA on q/v/down, local workers reading model.path, a warned
    preemption: the exported adapter on the HF model (PEFT) and the merged model (transformers) give the trainer's
    logits of the final adapter; the engine's logprobs of the trained version are not the base's."""
    import peft

    from _models import hf_model, make_model_dir
    from test_demo_run import diagnose, run_cli

    d = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False, seed=3)
    out = tmp_path / "run"
    p = run_cli(REPO, out, *preempted_run(d, tmp_path, max_new_tokens=64, eval_samples=1), "trainer.lora.rank=8",
                "trainer.lora.alpha=16", "trainer.lr=5e-3", 'trainer.lora.target_modules=["q_proj","v_proj","down_proj"]',
                "trainer.lora.export_merged=true")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    _exactly_once(rep, 3, 64, diagnose(p, out), preempted=True)
    assert rep["lora"]["base_loads"]["path"] >= 1 and rep["lora"]["base_pulled_bytes"] == 0, rep["lora"]
    assert rep["lora"]["merged_out"] == str(out / "model")
    # the trained adapter as the last checkpoint holds it, in the trainer's own model (PEFT), fp32
    from rlboost_hpc.trainer.lora import PeftAdapter

    pol = load_model_dir(d)
    adapter = torch.load(out / "checkpoints/step-000003/backend/torch_backend.pt", weights_only=True)["adapter"]
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # it trained
    m = LlamaModel.from_state_dict(pol.arch, dict(pol.state_dict)).eval()
    PeftAdapter(m, pol.arch, rank=8, alpha=16.0, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"), init=adapter)
    ids = torch.randint(0, pol.arch.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        trained = m(ids)
        exported = peft.PeftModel.from_pretrained(hf_model(d), out / "adapter").eval()(input_ids=ids).logits
        merged = hf_model(out / "model")(input_ids=ids).logits
        base = hf_model(d)(input_ids=ids).logits
    assert (exported - trained).abs().max().item() <= fp32_atol(trained)
    assert (merged - trained).abs().max().item() <= 10 * fp32_atol(trained)
    assert (base - trained).abs().max().item() > 100 * fp32_atol(trained)  # the trained version is not the base
    # what the engines served: their behaviour logprobs match the trainer's (with the adapter), every step
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m_["logprob_diff"] < 1e-3 for m_ in lines), [m_["logprob_diff"] for m_ in lines]
    # a new run started from the exported adapter (trainer.lora.adapter_path) begins where this one ended: its
    # held-out evaluation before training is this run's after (same draws, same adapter bytes)
    out2 = tmp_path / "continued"
    p2 = run_cli(REPO, out2, *preempted_run(d, tmp_path, max_new_tokens=64, eval_samples=1), "trainer.lora.rank=8",
                 "trainer.lora.alpha=16", 'trainer.lora.target_modules=["q_proj","v_proj","down_proj"]',
                 f"trainer.lora.adapter_path='{out / 'adapter'}'", "trainer.steps=1", "cluster.max_workers=0")
    assert p2.returncode == 0, p2.stderr[-3000:]
    rep2 = json.loads((out2 / "report.json").read_text())
    assert rep2["reward_heldout_before"] == rep["reward_heldout_after"], (rep2["reward_heldout_before"],
                                                                          rep["reward_heldout_after"])


@pytest.mark.megatron
def test_the_demo_trains_an_adapter_with_the_megatron_backend_preemptions_and_a_manager_kill(tmp_path):
    """``trainer.backend = "megatron"`` (TP = 1, in the run's process) with ``trainer.lora``: the adapter is the version,
    the instances' logprobs are the Megatron policy's (adapter included; fp32 on the wire, so to 1e-3), nothing lost
    through a warned preemption and a manager SIGKILLed mid-step."""
    from test_demo_run import diagnose

    out = tmp_path / "run"
    p, killed = _run_killing_the_manager(out, [*LORA, "trainer.backend=megatron", "trainer.steps=3",
                                               "rollout.max_new_tokens=96", "weights.dtype=float32",
                                               *preempting_cluster(tmp_path)], 1)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    _exactly_once(rep, 3, 64, diagnose(p, out), preempted=True)
    assert len(killed) == 1 and rep["manager_restarts"] == 1
    assert rep["lora"]["adapter_bytes"] == rep["weight_bytes"] and 0 <= rep["weight_bytes"] - 4 * 23120 < 64 * 70
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["logprob_diff"] < 1e-3 for m in lines), [m["logprob_diff"] for m in lines]


@pytest.mark.megatron
def test_the_tiny_qwen3_trains_an_adapter_with_the_megatron_backend_at_tp2_through_a_preemption_and_a_manager_kill(
        tmp_path):
    """The tiny Qwen3 through Megatron at TP = 2 (two gloo ranks; A/B sharded per layer kind) with ``trainer.lora``: the
    ranks serve their shares of the adapter, instances assemble it, and their logprobs are Megatron's — through a
    warned preemption and the manager SIGKILLed while a step's rollout is in flight (issue 57, second list: this
    model ran on Megatron with LoRA only unfaulted), nothing lost, duplicated or off-version."""
    from _models import make_model_dir
    from test_megatron_parallel import demo_tp2_killing_the_manager

    d = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False, seed=1)
    out = tmp_path / "tp2"
    sets = [f"model.path='{d}'", "task.name=gsm8k", "trainer.steps=3", "task.train_prompts=16",
            "task.heldout_prompts=4", "trainer.eval_samples=1", "rollout.max_new_tokens=32", *LORA,
            *preempting_cluster(tmp_path)]
    rc, err, killed = demo_tp2_killing_the_manager(REPO, out, sets, 1, 0.05, 900)
    assert rc == 0, err[-4000:]
    rep = json.loads((out / "report.json").read_text())
    assert len(killed) == 1 and rep["manager_restarts"] == 1, (killed, rep)
    assert rep["steps"] == 3 and rep["responses_trained"] == 3 * 64 and rep["responses_lost"] == 0
    assert rep["responses_duplicated"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["weight_checksum_mismatches"] == 0
    assert rep["preemptions_with_warning"] >= 1, rep
    holders = rep["weight_shards"]["holders"]
    assert len(holders) == 2 and rep["weight_shards"]["gathered_exports"] == 0
    assert rep["weight_bytes"] == rep["lora"]["adapter_bytes"] < 0.2 * rep["lora"]["base_bytes"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(m["logprob_diff"]) < 1e-3 for m in lines)


@pytest.mark.chaos
@pytest.mark.parametrize("k, mode", [(1, "finish"), (2, "continue")])
def test_adapters_under_bounded_staleness_and_preemptions_keep_the_window(tmp_path, k, mode):
    """The staleness window holds for adapter versions: instances keep k + 1 servable (finish: older responses end
    under their own adapter while new work gets the newest; continue: they go on under the newest), every token is
    stamped with the version that produced it, none older than k is trained, nothing lost."""
    from rlboost_hpc.chaos import chaos_main

    out = tmp_path / "run"
    rc = chaos_main(["--out", str(out), "--steps", "6", "--seed", str(k), "--lifetime-s", "3.0",
                     "--set", f"rollout.max_staleness={k}", "--set", f"rollout.on_new_version={mode}",
                     "--set", "trainer.behaviour_correction=tis", *[a for s in LORA for a in ("--set", s)]])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0
    assert rep["tokens_masked_too_stale"] == 0 and rep["weight_checksum_mismatches"] == 0
    assert rep["lora"]["adapter_bytes"] == rep["weight_bytes"] and rep["max_staleness"] == k
    stale = {int(j): n for j, n in rep["tokens_by_staleness"].items()}
    assert max(stale) <= k and sum(stale.values()) > 0
