"""The emulated trainer (``trainer.backend = "emulated"``): a model-sized bf16 weight set whose versions change as
an RL step's do, the modelled trainer's time, real checkpoints — and the live system over it."""
from __future__ import annotations

import json

import pytest
import torch

from rlboost_hpc.config import ConfigError, load_config
from rlboost_hpc.manager.stats import VersionServingClock
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.trainer.backends.base import Sample
from rlboost_hpc.trainer.backends.emulated import EmulatedBackend, tensor_sizes
from rlboost_hpc.weights.delta import encode_chunk


def backend(weight_bytes=3 * 2**20 + 6, tensor_bytes=2**20, density=0.03, seed=0, sleep=lambda s: None):
    return EmulatedBackend(weight_bytes=weight_bytes, tensor_bytes=tensor_bytes, delta_density=density,
                           train_time=profile("8b").train_time, time_scale=4.0, seed=seed, sleep=sleep)


def test_the_weight_set_has_the_stated_bytes_in_tensors_of_at_most_the_stated_size():
    assert tensor_sizes(10, 4) == [2, 2, 1] and tensor_sizes(8, 4) == [2, 2]
    with pytest.raises(ValueError, match="weight_bytes"):
        tensor_sizes(1, 4)
    b = backend()
    assert b.nbytes == 3 * 2**20 + 6 and len(b.weights) == 4
    assert all(t.dtype == torch.bfloat16 and t.numel() * 2 <= 2**20 for t in b.weights.values())
    assert all(torch.isfinite(t.float()).all() for t in b.weights.values())


def test_a_step_changes_the_stated_share_by_one_ulp_the_same_way_in_every_incarnation():
    a, b = backend(), backend()
    before = {k: v.clone() for k, v in a.weights.items()}
    for m in (a.optimizer_step(), a.optimizer_step()):
        assert 0.028 < m["changed_share"] <= 0.03, m
    b.optimizer_step(), b.optimizer_step()
    changed = total = 0
    for k, t in a.weights.items():
        assert torch.equal(t.view(torch.int16), b.weights[k].view(torch.int16))  # deterministic per (seed, step)
        diff = (t.view(torch.int16).int() - before[k].view(torch.int16).int()).abs()
        assert int(diff.max()) <= 1  # flipped once or twice: one ulp at most, never a NaN
        changed += int((diff > 0).sum())
        total += t.numel()
        assert torch.isfinite(t.float()).all()
    assert 0.05 < changed / total < 0.06  # two steps' 3 %, a few changed twice back
    assert not torch.equal(backend(seed=1).weights["emulated.layers.0.weight"].view(torch.int16),
                           before["emulated.layers.0.weight"].view(torch.int16))


def test_the_delta_of_a_step_is_about_its_density_of_the_bytes():
    """What the weight server ships to an instance holding the previous version: the delta encoding of a 3 % step
    is a few % of the raw bytes, as on real RL steps (weights/delta.py)."""
    b = backend(weight_bytes=4 * 2**20, tensor_bytes=4 * 2**20)
    old = b.weights["emulated.layers.0.weight"].view(torch.uint8).numpy().copy()
    b.optimizer_step()
    new = b.weights["emulated.layers.0.weight"].view(torch.uint8).numpy()
    payload = encode_chunk(memoryview(new), memoryview(old))
    assert payload is not None and 0.01 < len(payload) / new.nbytes < 0.06, len(payload) / new.nbytes


def test_a_micro_batch_takes_the_profiles_training_time_divided_by_the_time_scale():
    slept = []
    b = backend(sleep=slept.append)
    batch = [Sample(prompt_ids=[1] * 100, response_ids=[2] * 300, behaviour_logprobs=[-1.0] * 300, advantage=0.5),
             Sample(prompt_ids=[1] * 50, response_ids=[2] * 150, behaviour_logprobs=[-1.0] * 150, advantage=-0.5)]
    m = b.accumulate(batch, 2)
    assert m["tokens"] == 450 and m["loss"] == 0.0
    assert slept == [pytest.approx(profile("8b").train_time(600.0, 400.0**2 + 200.0**2) / 4.0)]
    assert [t.tolist() for t in b.token_logprobs(batch)] == [[-1.0] * 300, [-1.0] * 150]
    with pytest.raises(RuntimeError, match="no model"):
        b.logits(torch.zeros(1, 3, dtype=torch.long))


def test_a_checkpoint_restores_the_bytes_and_the_next_step(tmp_path):
    a = backend()
    a.optimizer_step()
    a.save_checkpoint(tmp_path / "c", {"step": 1})
    a.optimizer_step()
    b = backend()
    assert b.load_checkpoint(tmp_path / "c") == {"step": 1}
    b.optimizer_step()
    assert all(torch.equal(t.view(torch.int16), b.weights[k].view(torch.int16)) for k, t in a.weights.items())
    with pytest.raises(ValueError, match="weight_bytes"):
        backend(weight_bytes=2**20).load_checkpoint(tmp_path / "c")


def test_the_emulated_trainer_needs_emulated_instances_and_sane_sizes():
    with pytest.raises(ConfigError, match="rollout.engine = emulated"):
        load_config(None, ["trainer.backend='emulated'"])
    for override, key in [("trainer.emulated.delta_density=0", "trainer.emulated.delta_density"),
                          ("trainer.emulated.delta_density=1.5", "trainer.emulated.delta_density"),
                          ("trainer.emulated.weight_bytes=1", "trainer.emulated.weight_bytes"),
                          ("trainer.emulated.size=2", "trainer.emulated.size")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ["trainer.backend='emulated'", "rollout.engine='emulated'", override])


def test_version_serving_counts_the_instances_live_at_the_set_version_only():
    c = VersionServingClock()
    c.set_version(0, 0.0, [])
    c.set_version(1, 10.0, ["a", "b", "c"])
    assert c.loaded("a", 0, 10.5) is None  # an old version
    assert c.loaded("a", 1, 11.0) == 1.0 and c.loaded("a", 1, 12.0) is None  # once
    assert c.loaded("late", 1, 11.5) is None  # joined after the SetVersion: a start-up, not a version change
    assert c.loaded("c", 1, 14.0) == 4.0
    c.set_version(2, 20.0, ["a"])
    s = c.last
    assert (s.version, s.live, s.served, s.first_s, s.median_s, s.last_s) == (1, 3, 2, 1.0, 4.0, 4.0)


@pytest.mark.integration
def test_a_run_with_the_emulated_trainer_ships_deltas_of_its_density_and_loses_nothing(repo_root, tmp_path):
    """The live system at a stated weight size: versions of 32 MiB changed 3 % per step travel as deltas of a few %
    of their bytes; every instance live at a version change reports when it served the new version. Ten steps at
    the profile's own speed: the reserved instance alone finishes a step in about a second, and the worker
    processes (torch imports) may take several seconds to join on a loaded machine."""
    from test_demo_run import diagnose, run_cli

    out = tmp_path / "emt"
    p = run_cli(repo_root, out, "trainer.steps=10", "rollout.engine='emulated'", "trainer.backend='emulated'",
                "rollout.emulated.response_median=24", "rollout.emulated.time_scale=1",
                "rollout.emulated.load_bytes_per_s=1e12", f"trainer.emulated.weight_bytes={32 * 2**20}",
                "cluster.max_workers=4", "policy.cap=false")
    assert p.returncode == 0, diagnose(p, out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 10 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["model_out"] is None
    assert rep["reward_heldout_after"] is None  # no model: nothing evaluated (null, not a number)
    assert rep["weight_bytes"] == 32 * 2**20
    assert 0.01 < rep["weight_update_bytes_mean"] / rep["weight_bytes"] < 0.06, rep["weight_update_bytes_mean"]
    assert rep["weight_full_pull_seconds_mean"] > 0  # every instance's first pull moved the whole version
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0.028 < s["changed_share"] <= 0.03 for s in steps)
    served = [s["version_serving"] for s in steps if s["version_serving"]["live"]]
    assert served and all(v["served"] <= v["live"] and v["first_s"] <= v["median_s"] <= v["last_s"] for v in served)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "backend" / "emulated.safetensors").stat().st_size > 32 * 2**20


@pytest.mark.integration
def test_a_lora_load_test_at_8b_shape_ships_the_adapter_and_emulates_the_base(repo_root, tmp_path):
    """Issue 49: ``trainer.lora`` with the emulated trainer and instances at Qwen3-8B's shape — a version is the rank-r
    adapter of PEFT's shapes on every linear (real bf16 bytes, every element moved each step), the base is the
    profile's (its load modelled, never pulled), and nothing is lost."""
    from test_demo_run import diagnose, run_cli

    from rlboost_hpc.models.lora import adapter_shapes
    from rlboost_hpc.sim.profiles import profile

    arch = profile("8b").model.arch()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = 2 * sum(r * c for r, c in adapter_shapes(arch, targets, 1).values())
    out = tmp_path / "lora8b"
    p = run_cli(repo_root, out, "trainer.steps=3", "rollout.engine='emulated'", "trainer.backend='emulated'",
                "trainer.lora.rank=1", "rollout.emulated.response_median=24", "rollout.emulated.time_scale=1",
                "rollout.emulated.load_bytes_per_s=1e12", "cluster.max_workers=2", "policy.cap=false",
                "trainer.checkpoint_every=0")
    assert p.returncode == 0, diagnose(p, out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 3 and rep["responses_lost"] == rep["responses_duplicated"] == 0
    assert rep["tokens_trained_off_version"] == 0 and rep["weight_checksum_mismatches"] == 0
    lo = rep["lora"]
    assert 0 <= lo["adapter_bytes"] - adapter < 64 * 36 * 14 and lo["base_bytes"] == int(2 * 8.19e9), lo
    assert lo["base_pulled_bytes"] == 0 and lo["base_loads"]["pulled"] == 0  # the base is never on the wire
    assert lo["base_loads"]["path"] + lo["base_loads"]["trainer"] >= 1, lo
    assert rep["weight_update_bytes_mean"] > 0.2 * lo["adapter_bytes"]  # every adapter element moves each step
