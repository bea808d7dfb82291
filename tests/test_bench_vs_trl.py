"""Unit tests of one side: the TRL worker of ``benchmarks/bench_vs_trl.py`` runs in the precision its row names
(issue 46: TRL 1.16 defaults to ``bf16 = True``, so a baseline built without ``bf16=False`` trained under bf16
autocast on a CPU while this project trains in fp32 — 1.55× slower than TRL really is)."""
from __future__ import annotations

import importlib.util
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


def test_every_row_states_its_threads_and_the_ratio_baselines_are_the_fp32_rows(bench):
    assert set(bench.OURS_THREADS) == set(bench.OURS) and all(bench.OURS_THREADS.values())
    assert {"trl_t1", "trl_t2", "trl_t2_bf16"} <= set(bench.ROWS)


def test_our_phases_come_from_the_trainers_timeline_and_add_up_to_the_training_wall_time(bench):
    recs = [{"phase_s": {"submit": 0.01, "seeding": 0.2, "handoff": 0.01, "remote_generation": 0.3, "reward": 0.02,
                         "train": 0.25, "optimizer": 0.01, "publish": 0.02}}] * 3
    got = bench.ours_phases(recs, 2.5)
    assert set(got) == set(bench.PHASES)
    assert got["generation"] == pytest.approx(3 * 0.51) and got["train"] == pytest.approx(0.75)
    assert got["rest"] == pytest.approx(2.5 - 3 * (0.51 + 0.02 + 0.25 + 0.01))  # submit, publish, between steps
    assert sum(got.values()) == pytest.approx(2.5)
