"""Your own task end to end (issue 48): real runs of ``rlboost-hpc run`` on the default local config.

* The GSM8K example (``examples/gsm8k_jsonl``: a JSONL file and a user's reward file) against the built-in ``gsm8k``
  task: the same prompts in the same order, the same rewards on the same completions, the same first steps.
* A user's task — JSONL prompts, two reward functions (TRL's and verl's signatures) and an LLM judge behind HTTP (a
  real server on 127.0.0.1, its API key from the environment) — finishes on ``configs/local.toml`` with preemptible
  workers: nothing lost, duplicated or off-version; each function's mean in metrics.jsonl and the report; the user's
  reward module imported only in the trainer's allocation (never by a rollout worker); and a resume against the
  changed prompt file is exit 2 naming it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlboost_hpc.config import load_config
from rlboost_hpc.tasks.math import GSM8KTask
from rlboost_hpc.tasks.stories import OPENINGS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples/gsm8k_jsonl/config.toml"


def _run(out: Path, config: Path, *sets: str, env: dict | None = None, timeout: float = 600):
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(config), "--out", str(out), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=e, timeout=timeout)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_gsm8k_jsonl_example_gives_the_builtin_tasks_prompts_rewards_and_first_steps(tmp_path):
    from rlboost_hpc.tasks.reward_pool import RewardPool
    from rlboost_hpc.tasks.user_task import make_task
    from rlboost_hpc.trainer.loop import DataFrontier

    cache = f"task.data.cache_dir='{tmp_path / 'cache'}'"
    only_correct = ["task.rewards.functions=['rewards.py:correct']", "task.rewards.weights=[1.0]"]
    cfg = load_config(EXAMPLE, [cache, *only_correct])
    user, builtin = make_task(cfg.task), GSM8KTask(n_train=256, n_heldout=32)
    # the same prompts (text as the model sees it, gold columns), in the same order from the data frontier
    u_train, b_train = list(user.train_prompts()), builtin.train_prompts()
    assert [user.format_prompt(p) for p in u_train] == [builtin.format_prompt(p) for p in b_train]
    assert [p.meta for p in u_train] == [p.meta for p in b_train]
    assert [user.format_prompt(p) for p in user.heldout_prompts()] == [
        builtin.format_prompt(p) for p in builtin.heldout_prompts()]
    fu, fb = DataFrontier(u_train, 0), DataFrontier(b_train, 0)
    assert [user.format_prompt(p) for p in fu.take(600)] == [builtin.format_prompt(p) for p in fb.take(600)]
    # the same rewards on the same completions: gold solutions, other problems' solutions, boxed, empty, junk
    completions = [(i, p.meta["solution"]) for i, p in enumerate(b_train[:24])]
    completions += [(i, b_train[i + 1].meta["solution"]) for i in range(24)]
    completions += [(i, f"so \\boxed{{{b_train[i].meta['answer']}}}") for i in range(8)]
    completions += [(i, "") for i in range(4)] + [(i, "The answer is 3/0 ####") for i in range(4)]
    want = [builtin.reward(b_train[i], c) for i, c in completions]
    with RewardPool(user, workers=1, timeout_s=10.0) as pool:
        got = pool.score([(u_train[i], c) for i, c in completions]).rewards
    assert got == want and 0 < sum(want) < len(want)
    # the same first steps (the reserved engine only: sampling is then a function of the seeds alone)
    common = ["trainer.steps=2", "trainer.export_model=false", "cluster.max_workers=0", "trainer.eval_samples=1"]
    a = _run(tmp_path / "builtin", REPO / "configs/local.toml", *common, "task.name=gsm8k", "task.train_prompts=256",
             "task.heldout_prompts=8")
    assert a.returncode == 0, a.stderr[-3000:]
    b = _run(tmp_path / "user", EXAMPLE, *common, cache, *only_correct, "task.heldout_prompts=8")
    assert b.returncode == 0, b.stderr[-3000:]
    keys = ("step", "reward_mean", "response_len_mean", "tokens", "responses", "turns_mean", "truncated_share")
    ma, mb = _metrics(tmp_path / "builtin"), _metrics(tmp_path / "user")
    assert [{k: m[k] for k in keys} for m in ma] == [{k: m[k] for k in keys} for m in mb]
    assert [m["reward_functions"] for m in mb] == [{"correct": m["reward_mean"]} for m in ma]
    ra, rb = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("builtin", "user"))
    for k in ("reward_heldout_before", "reward_heldout_after", "responses_trained", "tokens_trained"):
        assert ra[k] == rb[k], k


REWARDS = '''
"""A user's reward file: a TRL batched function and a verl compute_score (and a marker of who imports it)."""
import json, os

with open(os.environ["RLBOOST_TEST_MARKER"], "a") as f:
    f.write(json.dumps(open("/proc/self/cmdline").read().split("\\0")) + "\\n")


def has_quote(prompts, completions, completion_ids, **columns):
    return [1.0 if '"' in c else 0.0 for c in completions]


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return {"score": 1.0 if ground_truth in solution_str and extra_info["strict"] is False else 0.0}
'''


def test_a_user_task_with_two_reward_functions_and_a_judge_trains_on_the_local_config(tmp_path):
    data = tmp_path / "stories.jsonl"
    rows = [{"prompt": o, "data_source": "stories", "reward_model": {"ground_truth": '"'},
             "extra_info": {"strict": False}} for o in OPENINGS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    marker = tmp_path / "imported-by.jsonl"
    judge = subprocess.Popen([sys.executable, str(REPO / "tests/_judge_server.py"), "--key-env", "JUDGE_KEY"],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "JUDGE_KEY": "k3y"})
    try:
        port = int(judge.stdout.readline().split()[1])
        sets = [f"task.data.path='{data}'", f"task.data.cache_dir='{tmp_path / 'cache'}'",
                "task.data.heldout_fraction=0.25", "task.heldout_prompts=8",
                f"task.rewards.functions=['{tmp_path}/rewards.py:has_quote', '{tmp_path}/rewards.py:compute_score']",
                "task.rewards.weights=[0.5, 0.25, 0.25]",
                f"task.rewards.model.url='http://127.0.0.1:{port}/v1/chat/completions'",
                "task.rewards.model.api_key_env='JUDGE_KEY'", "trainer.steps=3", "trainer.export_model=false",
                "cluster.preempt_when_busy=true"]
        env = {"JUDGE_KEY": "k3y", "RLBOOST_TEST_MARKER": str(marker)}
        p = _run(tmp_path / "run", REPO / "configs/local.toml", *sets, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        rep = json.loads((tmp_path / "run/report.json").read_text())
        assert rep["steps"] == 3 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
        assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
        funcs = rep["reward_functions"]
        assert set(funcs) == {"has_quote", "compute_score", "reward_model"}
        assert all(f["failed"] == 0 and f["timed_out"] == 0 and f["calls"] > 0 for f in funcs.values()), funcs
        for m in _metrics(tmp_path / "run"):  # the three terms agree (each rewards a double quote)
            per = m["reward_functions"]
            assert per["has_quote"] == per["compute_score"] == per["reward_model"]
            assert abs(m["reward_mean"] - per["has_quote"]) < 1e-9
        who = [json.loads(x) for x in marker.read_text().splitlines()]
        assert who and not any("worker" in arg for argv in who for arg in argv), who  # no rollout worker imported it
        assert rep["worker_starts"] >= 2  # (rollout workers did run)
        # the prompt file changes: resuming against it is refused, naming it
        data.write_text(data.read_text() + json.dumps({**rows[0], "prompt": "A new opening"}) + "\n")
        p = _run(tmp_path / "run", REPO / "configs/local.toml", *sets[:-3], "trainer.steps=5",
                 "trainer.export_model=false", env=env)
        assert p.returncode == 2 and "task.data.path" in p.stderr and str(data) in p.stderr, p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    finally:
        judge.kill()
        judge.wait()


def test_the_tools_example_runs_its_two_tools_in_the_tool_processes(tmp_path, stories260k_hf_dir):
    """examples/tools: two tools of the user's own answer JSON calls in the environment; the run (stories260K,
    whose turns are no JSON calls, so the tools answer with error observations) finishes with multi-turn
    trajectories, tool calls made, nothing lost."""
    from rlboost_hpc.tasks.tools import ToolEnvironment, ToolSyntax

    ex = REPO / "examples/tools"
    env = ToolEnvironment(str(stories260k_hf_dir), use_chat=False, syntax=ToolSyntax("", "."),
                          tools=(f"{ex}/tools.py:dictionary", f"{ex}/tools.py:count_letters"))
    env.setup()
    step = lambda text: env(("step", env._hf(text, add_special_tokens=False)["input_ids"]))  # noqa: E731
    assert step('{"name": "dictionary", "arguments": {"word": "Castle"}}.').text.startswith("a large stone house")
    assert step('{"name": "count_letters", "arguments": {"word": "banana", "letter": "a"}}.').text == "3"
    p = _run(tmp_path / "run", ex / "config.toml", f"task.data.cache_dir='{tmp_path / 'cache'}'",
             "trainer.steps=2", "trainer.export_model=false", "task.heldout_prompts=2", "trainer.eval_samples=1",
             "rollout.max_new_tokens=16")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "run/report.json").read_text())
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0 and rep["environment_calls"] > 0
    assert rep["turns_per_trajectory_mean"] > 1.0 and set(rep["reward_functions"]) == {"dialogue", "mentions_topic"}


def _quoted_and_failing(tmp_path: Path, name: str, fail: str, values: str, *sets: str) -> tuple[dict, list[dict]]:
    """(report, metrics lines) of a run (``sets``) of a task on the stories openings (a quarter of the rows
    ``broken``) with two functions: ``quoted`` (1 for a double quote) and ``name``, which runs ``fail`` on a broken
    row, else returns ``values``."""
    data = tmp_path / "stories.jsonl"
    rows = [{"prompt": o, "broken": i % 4 == 0} for i, o in enumerate(OPENINGS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def quoted(prompts, completions, **columns):\n"
        "    return [1.0 if '\"' in c else 0.0 for c in completions]\n\n\n"
        f"def {name}(prompts, completions, broken, **columns):\n"
        "    if broken[0]:\n"
        f"        {fail}\n"
        f"    return {values}\n")
    p = _run(tmp_path / "run", REPO / "configs/local.toml", f"task.data.path='{data}'",
             f"task.data.cache_dir='{tmp_path / 'cache'}'", "task.data.heldout_fraction=0.25", "task.heldout_prompts=4",
             f"task.rewards.functions=['{tmp_path}/rewards.py:quoted', '{tmp_path}/rewards.py:{name}']", *sets)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp_path / "run/report.json").read_text()), _metrics(tmp_path / "run")


def test_a_group_whose_judge_failed_is_left_out_not_trained_on_the_terms_left(tmp_path):
    """Issue 57 (verl-omni #366, NeMo-RL #2479): a failed component scored 0 and the group's advantages were built
    from the components left — a 0.1-weight format reward became a full ±1 advantage — and the judge's mean in the
    step's metrics included the failures. Through ``rlboost-hpc run``: a judge-like function that fails on a quarter
    of the rows (raises) beside a 0.1-weight format reward; those groups are left out (counted, none lost), the
    judge's mean is over its successful calls only (it gives 1.0 wherever it answers)."""
    rep, metrics = _quoted_and_failing(tmp_path, "judged", "raise RuntimeError('the judge is down for this row')",
                                       "[1.0] * len(completions)", "task.rewards.weights=[0.1, 1.0]", "trainer.steps=3",
                                       "trainer.export_model=false", "trainer.eval_samples=1")
    judged = rep["reward_functions"]["judged"]
    assert judged["failed"] > 0 and judged["mean"] == 1.0, judged  # failures counted, not averaged in as zeros
    left = sum(m["responses_left_out"] for m in metrics)
    assert left > 0 and rep["responses_left_out"] == left and left % 8 == 0  # whole groups (G = 8), never a part
    assert rep["responses_lost"] == 0 and rep["prompts_not_trained_exactly_once"] == 0
    assert rep["responses_trained"] == sum(m["responses"] for m in metrics)  # (the groups left out: not trained)
    for m in metrics:
        assert m["reward_functions"].get("judged", 1.0) == 1.0  # the step's mean: successful calls only


def test_a_reward_function_gets_trls_trainer_state_with_the_runs_step(tmp_path):
    """Issue 57 (trl #3668 / PR #3669): ``trainer_state`` was accepted in a reward function's signature and never
    passed — such a function failed every call and the run trained on nothing it said. Through ``rlboost-hpc run``:
    a function naming it, and one taking ``**kwargs`` (TRL passes it to every function), get a state whose
    ``global_step`` is the step (0-based, optimizer steps done), ``max_steps`` is ``trainer.steps`` and ``epoch`` the
    passes over the prompts — ``transformers.TrainerState``'s names."""
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": o}) + "\n" for o in OPENINGS))
    (tmp_path / "rewards.py").write_text(
        "def by_step(prompts, completions, trainer_state, **columns):\n"
        "    assert 0.0 <= trainer_state.epoch < 1.0\n"
        "    return [trainer_state.global_step / 100.0] * len(completions)\n\n\n"
        "def any_kwargs(prompts, completions, **kwargs):\n"
        "    return [float(kwargs['trainer_state'].max_steps)] * len(completions)\n")
    sets = [f"task.data.path='{data}'", f"task.data.cache_dir='{tmp_path / 'cache'}'",
            "task.data.heldout_fraction=0.25", "task.heldout_prompts=4",
            f"task.rewards.functions=['{tmp_path}/rewards.py:by_step', '{tmp_path}/rewards.py:any_kwargs']",
            "task.rewards.weights=[1.0, 0.0]", "trainer.steps=3",
            "trainer.export_model=false", "trainer.eval_samples=1", "task.rewards.errors='fail'"]
    p = _run(tmp_path / "run", REPO / "configs/local.toml", *sets)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = _metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [m["reward_functions"]["by_step"] for m in metrics] == pytest.approx([0.0, 0.01, 0.02])
    assert all(m["reward_functions"]["any_kwargs"] == 3.0 for m in metrics)


def test_a_short_prompt_of_many_tokens_is_refused_before_the_run_starts(tmp_path):
    """Issue 57 (verl #6239, Trinity-RFT #197): the run tokenised only the prompts longest by characters (the 64 the
    prepared file's statistics keep), so a short prompt of many tokens passed and ended the run at its step. Through
    ``rlboost-hpc run``: 80 long English prompts and one of 200 CJK characters (three byte tokens each on the
    stories260K tokenizer) — exit 2 naming that prompt, before the model is served; and the same data without it runs
    the check from the cache the first run left."""
    rows = [{"prompt": f"{o} " + "and then they walked on " * 20} for o in OPENINGS * 2][:80]
    short = {"prompt": "雨" * 200}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + [short]))
    (tmp_path / "rewards.py").write_text(
        "def quoted(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    sets = [f"task.data.path='{data}'", f"task.data.cache_dir='{tmp_path / 'cache'}'", "task.data.heldout_fraction=0.1",
            f"task.rewards.functions=['{tmp_path}/rewards.py:quoted']", "trainer.steps=1", "trainer.export_model=false"]
    assert max(len(r["prompt"]) for r in rows) > 2 * len(short["prompt"])  # (far from the longest by characters)
    p = _run(tmp_path / "run", REPO / "configs/local.toml", *sets)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "exceeds the model's context" in p.stderr and "雨雨雨" in p.stderr, p.stderr[-2000:]
    assert list((tmp_path / "cache").glob("*-prompt-tokens-*.json"))  # every row tokenised once, the result kept


def test_a_hub_dataset_that_cannot_be_read_is_refused_before_the_model_loads(tmp_path, stories260k_hf_dir):
    """Issue 57: every input check of a run before the model loads, a hub dataset id too (it is fetched when the task
    is made, which came after the model load). Through ``rlboost-hpc run``: a model directory whose config.json is
    there (the file checks pass) and whose weights are not a model, and a hub id the offline hub cannot give — exit 2
    naming ``task.data.path``, not the model."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(stories260k_hf_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not a model")
    (tmp_path / "rewards.py").write_text("def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    p = _run(tmp_path / "run", REPO / "configs/local.toml", f"model.path='{model}'",
             "task.data.path='nobody-here/no-such-dataset'", f"task.data.cache_dir='{tmp_path / 'cache'}'",
             f"task.rewards.functions=['{tmp_path}/rewards.py:zero']", env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "task.data.path = nobody-here/no-such-dataset" in p.stderr, p.stderr[-2000:]
    assert "safetensors" not in p.stderr, p.stderr[-2000:]


def test_a_run_whose_every_group_was_left_out_is_a_failed_run(tmp_path):
    """Issue 57: with ``task.rewards.errors = skip`` a run whose judge failed every call left every GRPO group out,
    trained nothing and exited 0. Through ``rlboost-hpc run``: exit 1 naming the responses left out and the
    function's failed calls, its report written (the counts are there to read)."""
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": o}) + "\n" for o in OPENINGS))
    (tmp_path / "rewards.py").write_text(
        "def judged(prompts, completions, **columns):\n    raise RuntimeError('the judge is down')\n")
    sets = [f"task.data.path='{data}'", f"task.data.cache_dir='{tmp_path / 'cache'}'",
            "task.data.heldout_fraction=0.25", "task.heldout_prompts=2",
            f"task.rewards.functions=['{tmp_path}/rewards.py:judged']", "trainer.steps=1", "trainer.export_model=false",
            "trainer.eval_samples=1"]
    p = _run(tmp_path / "run", REPO / "configs/local.toml", *sets)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    rep = json.loads((tmp_path / "run/report.json").read_text())
    assert rep["responses_trained"] == 0 and rep["responses_left_out"] > 0, rep
    assert f"the run trained no response in 1 step: {rep['responses_left_out']} were left out" in p.stderr
    assert "judged: " in p.stderr and " calls failed" in p.stderr, p.stderr[-2000:]


def test_a_weight_0_function_is_a_task_metric_logged_apart_from_the_reward(tmp_path):
    """Issue 58 item 5 (trl #5787): a function of weight 0 is a task metric — its step means and held-out mean are
    logged (metrics.jsonl, report) and it never enters the reward; when it fails, the failure is counted but no
    group is left out (it is no reward term). Through ``rlboost-hpc run``."""
    rep, metrics = _quoted_and_failing(tmp_path, "words", "raise RuntimeError('the metric fails on this row')",
                                       "[float(len(c.split())) for c in completions]",
                                       "task.rewards.weights=[1.0, 0.0]",
                                       "trainer.steps=2", "trainer.export_model=false", "trainer.eval_samples=2")
    assert rep["reward_functions"]["words"]["failed"] > 0 and rep["responses_left_out"] == 0, rep["reward_functions"]
    assert rep["responses_trained"] == 2 * 64 and rep["responses_lost"] == 0
    for m in metrics:
        per = m["reward_functions"]
        assert per["words"] > 1.0 and abs(m["reward_mean"] - per["quoted"]) < 1e-9, per  # not in the reward
    held = rep["reward_functions_heldout_after"]
    assert set(held) == {"quoted", "words"} and held["words"] > 1.0, held
