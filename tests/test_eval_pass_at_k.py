"""Held-out evaluation with its own sampling and pass@k (issue 58 item 5: NeMo-RL #3401, prime-rl #1834)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rlboost_hpc.trainer.eval import pass_at_k


def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    """1 − C(n−c, k)/C(n, k) for every n ≤ 12, c ≤ n, k ≤ n, without its large binomials; bad arguments refused."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    for bad in [(4, 5, 1), (4, 1, 5), (4, -1, 1), (4, 1, 0)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


@pytest.mark.integration
def test_a_run_evaluates_with_its_own_temperature_and_reports_pass_at_k(repo_root, tmp_path):
    """Through ``rlboost-hpc run``: held-out evaluation at ``trainer.eval_temperature = 0`` samples greedily whatever
    the rollouts' temperature, so each prompt's samples all pass or all fail — pass@1 = pass@4 — and the sampled
    mean equals the greedy one; pass@k is in report.json (before and after) and the summary table."""
    from test_demo_run import diagnose, run_cli

    out = tmp_path / "run"
    p = run_cli(repo_root, out, "trainer.steps=1", "trainer.eval_temperature=0", "trainer.eval_pass_k=[1, 4]",
                "trainer.eval_correct_at=0.3", "task.heldout_prompts=8")
    assert p.returncode == 0, diagnose(p, out)
    rep = json.loads((out / "report.json").read_text())
    for when in ("before", "after"):
        got = rep[f"pass_at_k_heldout_{when}"]
        assert set(got) == {"1", "4"} and 0.0 <= got["1"] <= 1.0, got
        assert got["1"] == pytest.approx(got["4"]), got  # greedy samples: all pass or none
        assert got["1"] * 8 == pytest.approx(round(got["1"] * 8))  # a share of the 8 prompts
        assert rep[f"reward_heldout_{when}"] == pytest.approx(rep[f"reward_heldout_greedy_{when}"])
    assert "pass@1" in p.stdout and "pass@4" in p.stdout, p.stdout[-2000:]


def test_a_pass_k_above_the_samples_is_refused_naming_the_key(repo_root, tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(tmp_path / "r"), "--set",
                        "trainer.eval_pass_k=[8]"], capture_output=True, text=True, cwd=repo_root, timeout=120)
    assert p.returncode == 2 and "eval_pass_k" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "r" / "report.json").exists()
