"""Unit tests of one side: the TRL worker of ``benchmarks/bench_vs_trl.py`` runs in the precision its row names
(issue 46: TRL 1.16 defaults to ``bf16 = True``, so a baseline built without ``bf16=False`` trained under bf16
autocast on a CPU while this project trains in fp32 — 1.55× slower than TRL really is)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_fp32_rows_turn_trls_bf16_default_off_and_the_default_row_keeps_it(bench):
    fp32 = bench.trl_config_kwargs(30, "fp32", "/tmp/o")
    assert fp32["bf16"] is False and fp32["fp16"] is False  # the regression: the fair baseline sets both
    default = bench.trl_config_kwargs(30, "default", "/tmp/o")
    assert "bf16" not in default and "fp16" not in default  # TRL's own default: what a user who keeps it gets
    assert {k: v for k, v in fp32.items() if k not in ("bf16", "fp16")} == default  # otherwise the same run
    assert fp32["max_steps"] == 30 and fp32["per_device_train_batch_size"] == 64 and fp32["num_generations"] == 8
    with pytest.raises(ValueError, match="fp32 or default"):
        bench.trl_config_kwargs(30, "bf16", "/tmp/o")


def test_a_trl_row_that_ran_in_another_precision_than_its_name_is_refused(bench):
    fp32 = {"bf16": False, "fp16": False, "param_dtype": "float32"}
    assert bench.check_precision("trl_t1", fp32) == "fp32"
    assert bench.check_precision("trl_t2_bf16", {**fp32, "bf16": True}) == "bf16 autocast"
    for row, ran in [("trl_t1", {**fp32, "bf16": True}), ("trl_t2", {**fp32, "fp16": True}),
                     ("trl_t2", {**fp32, "param_dtype": "bfloat16"}), ("trl_t2_bf16", fp32)]:
        with pytest.raises(RuntimeError, match="not this row's baseline"):
            bench.check_precision(row, ran)


def test_every_row_states_its_threads_and_framing_and_the_baselines_are_trls_fp32_rows(bench):
    assert set(bench.WHERE) == set(bench.ROWS) and all(bench.WHERE.values())
    assert set(bench.OURS) | set(bench.TRL_ROWS) == set(bench.ROWS)
    assert {b for bs in bench.BASELINE.values() for b in bs} == set(bench.TRL_ROWS)
    assert {bench.framing(r) for r in bench.ROWS} == {"same", "harvested"}
    for row, (frame, sets, cpus) in bench.OURS.items():  # the harvested rows run on CPU 0, their workers on CPU 1
        assert (cpus == "0") == (frame == "harvested") == ("cluster.worker_cpus=[1]" in sets), row


def test_our_phases_come_from_the_trainers_timeline_and_add_up_to_the_training_wall_time(bench):
    """One definition per phase: generation = seeding + handoff + remote generation + tail; the rest of the wall
    time (submit, publish, …, between steps) is overhead."""
    recs = [{"phase_s": {"submit": 0.01, "seeding": 0.2, "handoff": 0.01, "remote_generation": 0.3, "tail": 0.05,
                         "reward": 0.02, "train": 0.25, "optimizer": 0.01, "publish": 0.02}}] * 3
    got = bench.ours_phases(recs, 2.7)
    assert set(got) == set(bench.PHASES)
    assert got["generation"] == pytest.approx(3 * 0.56) and got["train"] == pytest.approx(0.75)
    assert got["overhead"] == pytest.approx(2.7 - 3 * (0.56 + 0.02 + 0.25 + 0.01))
    assert sum(got.values()) == pytest.approx(2.7)


def test_each_rows_limit_is_the_best_schedule_its_constraints_allow(bench):
    """Issue 55: same cores and k ≥ 1, every phase over both cores; harvested k = 0, generation over both cores and
    the rest on the reserved one; TRL's from its own one-thread phases."""
    cal = {"phases": {"generation": 0.3, "reward": 0.01, "train": 0.25, "optimizer": 0.04}, "completion_tokens": 3000}
    assert bench.limit_rate("ours_colocated", cal, None) == pytest.approx(3000 / 0.3)
    assert bench.limit_rate("ours_k1", cal, None) == pytest.approx(3000 / 0.3)
    assert bench.limit_rate("ours_harvested_k1", cal, None) == pytest.approx(3000 / 0.3)
    assert bench.limit_rate("ours_harvested_k0", cal, None) == pytest.approx(3000 / (0.15 + 0.3))
    trl1 = {"steps": 10, "completion_tokens": 30000,
            "phases": {"generation": 4.0, "reward": 0.0, "train": 5.0, "optimizer": 0.0, "overhead": 1.0}}
    assert bench.limit_rate("trl_t1", cal, trl1) == pytest.approx(3000 / 0.9)
    assert bench.limit_rate("trl_core0", cal, trl1) == pytest.approx(3000 / 0.9)
    assert bench.limit_rate("trl_t2", cal, trl1) == pytest.approx(3000 / 0.45)
    assert bench.limit_rate("trl_t2", cal, None) is None


@pytest.mark.integration
def test_the_trl_worker_reports_the_precision_it_ran_in_by_running_it(bench, tmp_path):
    """Issue 55: the precision check runs TRL itself (one step of the demo's shape) instead of checking dicts by
    hand: the fp32 row runs in fp32, TRL's default in bf16 autocast — each refused as the other's baseline."""
    pytest.importorskip("trl", reason="pip install '.[trl]'")  # in the test extras: CI has it
    got = {}
    for precision in ("fp32", "default"):
        out = tmp_path / f"{precision}.json"
        bench.trl_worker(1, 1, precision, out, max_new_tokens=8)
        got[precision] = json.loads(out.read_text())
    assert bench.check_precision("trl_t1", got["fp32"]["precision"]) == "fp32"
    assert bench.check_precision("trl_t2_bf16", got["default"]["precision"]) == "bf16 autocast"
    with pytest.raises(RuntimeError, match="not this row's baseline"):
        bench.check_precision("trl_t1", got["default"]["precision"])
    assert got["fp32"]["steps"] == 1 and got["fp32"]["completion_tokens"] > 0
