"""reasoning-gym procedural tasks (issue 58 item 3): ``task.reasoning_gym = {name, size, seed, config}``, the
generator's own ``score_answer`` as the reward, no glue code."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from rlboost_hpc.config_task import ReasoningGymCfg
from rlboost_hpc.errors import BadInput
from rlboost_hpc.tasks.procedural import ProceduralTask

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples/reasoning_gym_arithmetic/config.toml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def test_the_generators_questions_split_and_its_scorer_is_the_reward_one_side():
    """Entries are the generator's (the same on every construction), the last ``n_heldout`` held out; the reward is
    ``score_answer`` on the answer inside the tag (the whole completion with ``answer_tag = ""``), in the reward
    processes too (the task pickled without its data set)."""
    cfg = ReasoningGymCfg(name="basic_arithmetic", size=20, seed=7, config={"min_terms": 2, "max_terms": 2})
    t, again = ProceduralTask(cfg, 5), ProceduralTask(cfg, 5)
    assert len(t.train_prompts()) == 15 and len(t.heldout_prompts()) == 5
    assert [p.text for p in t.train_prompts()] == [p.text for p in again.train_prompts()]
    assert not {p.pid for p in t.train_prompts()} & {p.pid for p in t.heldout_prompts()}
    p = t.train_prompts()[0]
    gold = p.meta["answer"]
    assert "<answer>" in p.text and p.text.rstrip().endswith(t._dataset()[0]["question"])
    assert t.reward(p, f"thinking... <answer>{gold}</answer>") == 1.0
    assert t.reward(p, f"<answer>{int(gold) + 1}</answer>") == 0.0
    assert t.reward(p, f"{gold}") == 0.0  # no answer tag: no answer
    shipped = pickle.loads(pickle.dumps(t))
    assert shipped._ds is None and shipped.reward(p, f"<answer>{gold}</answer>") == 1.0
    whole = ProceduralTask(cfg.model_copy(update={"answer_tag": ""}), 5)
    assert whole.reward(p, f" {gold}\n") == 1.0 and "<answer>" not in whole.train_prompts()[0].text
    final = ProceduralTask(cfg.model_copy(update={"answer_tag": "final"}), 5)  # the prompt asks for the tag read
    asked = final.train_prompts()[0].text
    assert "<final>answer here</final>" in asked and "<answer>" not in asked
    assert final.reward(p, f"<final>{gold}</final>") == 1.0 and final.reward(p, f"<answer>{gold}</answer>") == 0.0


def test_a_bad_data_set_or_option_is_refused_naming_the_key():
    with pytest.raises(BadInput, match=r"task.reasoning_gym.name = 'no_such_set'.*known"):
        ProceduralTask(ReasoningGymCfg(name="no_such_set"), 4)
    with pytest.raises(BadInput, match=r"task.reasoning_gym.config = \{'bogus': 3\}"):
        ProceduralTask(ReasoningGymCfg(name="basic_arithmetic", config={"bogus": 3}), 4)


@pytest.mark.integration
def test_task_check_passes_the_example_and_a_run_refuses_an_unknown_data_set_naming_the_key(tmp_path):
    ok = _cli("task", "check", "--config", str(EXAMPLE))
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "gold answer [1.0, 1.0, 1.0, 1.0], empty completion [0.0, 0.0, 0.0, 0.0]" in ok.stdout
    assert "task check: OK" in ok.stdout and "Calculate" in ok.stdout
    bad = _cli("run", "--config", str(EXAMPLE), "--out", str(tmp_path / "bad"), "--set",
               "task.reasoning_gym.name='no_such_set'")
    assert bad.returncode == 2 and "task.reasoning_gym.name = 'no_such_set'" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad" / "report.json").exists()


@pytest.mark.integration
def test_the_example_trains_through_rlboost_hpc_run(repo_root, tmp_path):
    """The example's run as a user starts it (2 steps): every response trained once, the held-out evaluation on the
    generator's held-out questions, pass@k reported."""
    out = tmp_path / "run"
    p = _cli("run", "--config", str(EXAMPLE), "--out", str(out), "--no-progress", "--set", "trainer.steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 2 and rep["responses_trained"] == 2 * 64 and rep["responses_lost"] == 0, rep
    assert rep["responses_duplicated"] == 0 and rep["tokens_trained_off_version"] == 0
    assert set(rep["pass_at_k_heldout_after"]) == {"1"}
