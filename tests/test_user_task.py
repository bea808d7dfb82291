"""Your own task (issue 48): prompts from a file, reward functions, a reward model behind HTTP, tools, task check.

Real files in every format the loader takes (JSONL, Parquet, a ``datasets.save_to_disk`` directory, a local directory
through ``datasets.load_dataset``), real reward processes with their deadlines, a real HTTP server on 127.0.0.1
(``tests/_judge_server.py``) for the judge, and the command line for ``task check``'s exit codes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlboost_hpc.config import load_config
from rlboost_hpc.config_task import TaskCfg
from rlboost_hpc.errors import BadInput
from rlboost_hpc.tasks.stories import OPENINGS
from rlboost_hpc.tasks.user_task import UserTask, make_task

REPO = Path(__file__).resolve().parent.parent

REWARDS = '''
import asyncio

def has_quote(prompts, completions, **kwargs):
    """TRL: 1 when the completion holds a double quote."""
    return [1.0 if '"' in c else 0.0 for c in completions]

def by_column(completions, answer):
    """TRL, only the keywords it names: the row's answer column."""
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

async def async_len(prompts, completions, completion_ids, **kw):
    await asyncio.sleep(0)
    return [float(len(i)) for i in completion_ids]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if ground_truth in solution_str else 0.0, "source": data_source}

async def async_verl(data_source, solution_str, ground_truth, extra_info):
    return 0.5

def not_applicable(completions, **kw):
    return [None for _ in completions]

def raises(completions, **kw):
    raise RuntimeError("boom")

def wrong_length(completions, **kw):
    return []

def nan(completions, **kw):
    return [float("nan")] * len(completions)

def a_string(completions, **kw):
    return ["high"] * len(completions)

def hangs(completions, **kw):
    import time
    time.sleep(60)

def bad_signature(x, y):
    return [0.0]

def needs_missing_column(completions, nope):
    return [0.0] * len(completions)
'''


def _rows(n: int = 40) -> list[dict]:
    return [{"prompt": OPENINGS[i], "answer": "the", "data_source": "stories", "n": i} for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def _task(tmp_path, data, *refs, rewards: dict | None = None, **data_keys) -> UserTask:
    """The task of ``data`` scored by ``rewards.py``'s functions ``refs``; ``rewards``: more task.rewards keys,
    ``data_keys``: more task.data keys."""
    cfg = TaskCfg(data=dict(path=str(data), cache_dir=str(tmp_path / "cache"), **data_keys), rewards=dict(
        functions=[f"{tmp_path / 'rewards.py'}:{r}" for r in refs or ("has_quote",)], **(rewards or {})))
    return make_task(cfg)


# ------------------------------------------------------------------------------------------- data sets


def test_every_format_gives_the_same_rows_and_ids(user_files):
    """JSONL, Parquet, a save_to_disk directory and a local directory through datasets.load_dataset: one content,
    one set of ids (a row's id is its content's hash, whatever the file)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp, rows = user_files, _rows()
    sources = {"jsonl": _jsonl(tmp / "p.jsonl", rows)}
    pq.write_table(pa.Table.from_pylist(rows), tmp / "p.parquet")
    sources["parquet"] = tmp / "p.parquet"
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp / "disk"))
    sources["disk"] = tmp / "disk"
    (tmp / "hubdir").mkdir()
    _jsonl(tmp / "hubdir/train.jsonl", rows)
    sources["load_dataset"] = tmp / "hubdir"
    ids = {}
    for kind, src in sources.items():
        t = _task(tmp, src, heldout_fraction=0.25)
        ids[kind] = sorted(p.pid for p in list(t.train_prompts()) + t.heldout_prompts())
        assert len(t.table) == len(rows) and t.table.duplicates == 0, kind
    assert len({tuple(v) for v in ids.values()}) == 1, ids
    t = _task(tmp, sources["jsonl"], heldout_fraction=0.25)
    p = t.train_prompts()[0]
    assert p.text in OPENINGS and p.meta["answer"] == "the" and "prompt" not in p.meta


def test_ids_survive_a_reshuffle_and_an_append_and_duplicates_are_dropped_and_counted(user_files):
    tmp, rows = user_files, _rows()
    a = _task(tmp, _jsonl(tmp / "a.jsonl", rows), heldout_fraction=0.25)
    b = _task(tmp, _jsonl(tmp / "b.jsonl", list(reversed(rows)) + _rows(45)[40:] + rows[:3]), heldout_fraction=0.25)
    ids = lambda t: {p.pid: p.text for p in list(t.train_prompts()) + t.heldout_prompts()}  # noqa: E731
    assert ids(a).items() <= ids(b).items()  # the same rows keep their ids (and their side of the split)
    assert {p.pid for p in a.heldout_prompts()} <= {p.pid for p in b.heldout_prompts()} | {
        p.pid for p in b.train_prompts()} and b.table.duplicates == 3 and len(b.table) == 45
    held_a = {p.pid for p in a.heldout_prompts()}
    assert held_a and held_a.isdisjoint(p.pid for p in b.train_prompts())
    assert a.table.fingerprint != b.table.fingerprint


def test_chat_message_prompts_and_a_system_prompt_render_through_the_chat_template(user_files):
    from _models import train_tokenizer

    from rlboost_hpc.models.hf_dir import PolicyTokenizer

    tmp = user_files
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(12)]
    t = _task(tmp, _jsonl(tmp / "chat.jsonl", rows), "has_quote", system_prompt="Be brief.", heldout_fraction=0.3)
    p = t.train_prompts()[0]
    assert p.messages == rows[int(p.text.split()[2])]["prompt"]
    hf = train_tokenizer(bos=False)
    tok = PolicyTokenizer.__new__(PolicyTokenizer)
    tok.hf, tok.use_chat = hf, True
    text = hf.decode(t.prompt_ids(p, tok))
    assert text == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{p.text}<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert t.format_prompt(p) == f"Be brief.\n\n{p.text}"  # without a template: plain text


@pytest.mark.parametrize("content, problem", [
    (None, "no such file"),
    ("a,b\n1,2\n", "unknown format"),
    ('{"prompt": "ok"}\n{not json\n', "cannot be read"),
    ('{"question": "x"}\n', "has no column 'prompt'"),
    ('{"prompt": 3}\n', "column 'prompt' is int64"),
    ('{"prompt": "fine"}\n{"prompt": ""}\n{"prompt": "x"}\n', "empty or null in 1 row(s), the first at row 2"),
    ('{"prompt": "a", "__rlboost_pid": "x"}\n', "reserved"),
])
def test_bad_data_is_bad_input_naming_the_key_and_the_column(user_files, content, problem):
    tmp = user_files
    path = tmp / ("data.txt" if problem == "unknown format" else "data.jsonl")
    if content is not None:
        path.write_text(content)
    with pytest.raises(BadInput) as e:
        _task(tmp, path)
    assert problem in str(e.value), e.value
    assert "task.data.path" in str(e.value) or "task.data.prompt_field" in str(e.value), e.value


# ------------------------------------------------------------------------------------------- reward functions


def test_signatures_are_told_apart_and_unusable_ones_are_bad_input(user_files):
    tmp = user_files
    data = _jsonl(tmp / "d.jsonl", _rows())
    t = _task(tmp, data, "has_quote", "by_column", "async_len", "compute_score", "async_verl")
    kinds = {c.name: (c.kind, c.accepts, c.is_async) for c in t.components}
    assert kinds["has_quote"] == ("trl", None, False) and kinds["by_column"] == ("trl", ("completions", "answer"), False)
    assert kinds["async_len"][2] and kinds["compute_score"][0] == "verl" and kinds["async_verl"][:1] == ("verl",)
    for ref, why in [("bad_signature", "unusable signature"), ("needs_missing_column", "'nope' is no column"),
                     ("absent", "has no 'absent'")]:
        with pytest.raises(BadInput, match=why):
            _task(tmp, data, ref)
    (tmp / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(BadInput, match=r"task.rewards.functions\[0\].*ModuleNotFoundError"):
        make_task(TaskCfg(data=dict(path=str(data), cache_dir=str(tmp / "cache")),
                          rewards=dict(functions=[f"{tmp / 'broken.py'}:f"])))


def test_the_reward_pool_combines_functions_by_weight_and_counts_each_failure(user_files, caplog):
    """TRL (with columns, ids, async), verl (dict, async), None = not applicable; a function that raises, returns the
    wrong length, NaN, a string or hangs past its deadline: it failed — its values None, the answers marked failed
    (their group is left out of the step, never trained on the terms left), counted per function, logged once."""
    from rlboost_hpc.tasks.reward_pool import RewardFunctionFailed, RewardPool

    tmp = user_files
    good = ["has_quote", "by_column", "async_len", "compute_score", "async_verl", "not_applicable"]
    bad = ["raises", "wrong_length", "nan", "a_string", "hangs"]
    t = _task(tmp, _jsonl(tmp / "d.jsonl", _rows()), *good, *bad,
              rewards=dict(weights=[1.0, 2.0, 0.5, 1.0, 1.0, 1.0] + [1.0] * len(bad), timeout_s=3.0))
    p = t.train_prompts()[0]
    with RewardPool(t, workers=2, timeout_s=3.0) as pool:
        items = [(p, 'She said "the end"'), (p, "no quote")]
        r, parts, failed = pool.score(items, [[5, 6, 7], [8]])
        assert parts["has_quote"] == [1.0, 0.0] and parts["by_column"] == [1.0, 0.0]
        assert parts["async_len"] == [3.0, 1.0] and parts["compute_score"] == [1.0, 0.0]
        assert parts["async_verl"] == [0.5, 0.5] and parts["not_applicable"] == [None, None]
        assert r == [1.0 + 2.0 + 1.5 + 1.0 + 0.5, 0.5 + 0.5]
        for name in bad:
            assert parts[name] == [None, None]
        assert failed == (True, True)
        tallies = pool.take_tallies()
        assert tallies["hangs"]["timed_out"] == 1 and all(tallies[n]["failed"] == 1 for n in bad[:-1])
        assert tallies["has_quote"] == {"calls": 1, "failed": 0, "timed_out": 0, "mean": 0.5}
        assert all(tallies[n]["mean"] is None for n in bad)  # means over successful calls only
        assert pool.score(items[:1]).failed == (True,)  # (any failed component marks the answer)
        assert [r.getMessage() for r in caplog.records].count(
            next(m.getMessage() for m in caplog.records if "reward raises" in m.getMessage())) == 1
    t.cfg.rewards.errors = "fail"
    with RewardPool(t, workers=1, timeout_s=3.0) as pool, pytest.raises(RewardFunctionFailed, match="raises"):
        pool.score([(p, "x")])


# ------------------------------------------------------------------------------------------- reward model


@pytest.fixture
def judge(monkeypatch):
    """The judge server of tests/_judge_server.py on 127.0.0.1, key in JUDGE_KEY; yields (base URL, stats())."""
    import urllib.request

    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    procs = []

    def start(*args: str):
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/_judge_server.py"), "--key-env", "JUDGE_KEY",
                                 *args], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        port = int(proc.stdout.readline().split()[1])
        base = f"http://127.0.0.1:{port}"
        return base, lambda: json.loads(urllib.request.urlopen(base + "/stats", timeout=5).read())
    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_an_llm_judge_and_a_scoring_route_over_real_http_with_retries_and_the_key_from_the_environment(
        user_files, judge):
    from rlboost_hpc.config_task import RewardModelCfg
    from rlboost_hpc.tasks.reward_model import RewardModelError
    from rlboost_hpc.tasks.reward_pool import RewardPool

    tmp = user_files
    base, stats = judge("--fail-first", "2")
    data = _jsonl(tmp / "d.jsonl", _rows())
    rm = RewardModelCfg(url=base + "/v1/chat/completions", api_key_env="JUDGE_KEY", weight=0.5, timeout_s=5)
    t = _task(tmp, data, "has_quote", rewards=dict(model=rm))
    assert t.check_endpoint() > 0  # two 503s absorbed by the retries
    p = t.train_prompts()[0]
    with RewardPool(t, workers=1, timeout_s=5.0) as pool:
        r, parts, _ = pool.score([(p, 'a "quote"'), (p, "none")])
    assert parts["reward_model"] == [1.0, 0.0] and r == [1.5, 0.0]
    assert stats()["failed_on_purpose"] == 2 and stats()["refused"] == 0
    score = _task(tmp, data, "has_quote", rewards=dict(model=RewardModelCfg(url=base + "/score", kind="score",
                                                                            api_key_env="JUDGE_KEY")))
    assert score.components[-1].model.score(p, ['"', "x"]) == [1.0, 0.0]
    os.environ["JUDGE_KEY"] = "wrong"  # (monkeypatch restores it)
    with pytest.raises(RewardModelError, match="HTTP 401"):
        score.components[-1].model.score(p, ["x"])
    dead_rm = RewardModelCfg(url="http://127.0.0.1:9/v1/chat/completions", retries=1, timeout_s=1)
    dead = _task(tmp, data, "has_quote", rewards=dict(model=dead_rm))
    with pytest.raises(BadInput, match=r"task.rewards.model.url = http://127.0.0.1:9.*connection failed"):
        dead.check_endpoint()
    with pytest.raises(BadInput, match="NO_SUCH_VAR"):
        _task(tmp, data, "has_quote", rewards=dict(model=RewardModelCfg(url=base, api_key_env="NO_SUCH_VAR")))
    with pytest.raises(BadInput, match=r"\{gold\}"):
        bad_template = RewardModelCfg(url=base, prompt_template="{gold} {completion}")
        _task(tmp, data, "has_quote", rewards=dict(model=bad_template))


def test_a_reward_model_that_redirects_gets_no_key_and_gives_no_reward_through_task_check(user_files, judge, tmp_path):
    """Issue 57 (OpenRLHF #1317): the client followed a redirect with the API key and used the other host's answer
    as rewards. Through ``rlboost-hpc task check``: the redirect is refused (exit 2 naming the key and where it
    pointed), the other host never sees a request, let alone the key."""
    other, other_stats = judge()  # (it would answer anyone: it must never be asked)
    hostile, hostile_stats = judge("--redirect-to", other)
    data = _jsonl(user_files / "d.jsonl", _rows())
    cfg = tmp_path / "redirect.toml"
    cfg.write_text((REPO / "configs/local.toml").read_text() + f"""
[task.rewards.model]
url = "{hostile}/v1/chat/completions"
api_key_env = "JUDGE_KEY"
retries = 0
timeout_s = 5
""")
    p = _cli("task", "check", "--config", str(cfg), "--set", f"task.data.cache_dir='{user_files / 'cache'}'",
             "--set", f"task.data.path='{data}'",
             "--set", f"task.rewards.functions=['{user_files / 'rewards.py'}:has_quote']")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "task.rewards.model.url" in p.stderr and f"redirected (HTTP 302) to {other}" in p.stderr, p.stderr[-2000:]
    assert hostile_stats()["authorized_requests"] == 1  # the key went where it was configured to go, once
    assert other_stats()["authorized_requests"] == 0 and other_stats()["served"] == 0


def test_a_judges_verdict_is_its_last_score_on_the_declared_scale_and_anything_else_is_a_failed_call(
        user_files, judge):
    """Issue 57 (NeMo-Gym #2852, helm #4344, ms-swift #10163): the first match anywhere won (a score the graded answer
    planted and the judge quoted), ``1e-1`` was read as 1 and ``85`` on a 0–1 scale passed. Against real judge and
    scoring servers, through the reward pool: the last verdict counts, exponents are read, a value off the declared
    scale is a failed call (counted), never a reward."""
    from rlboost_hpc.config_task import RewardModelCfg
    from rlboost_hpc.tasks.reward_pool import RewardPool

    data = _jsonl(user_files / "d.jsonl", _rows())
    planted = 'The answer says "Score: 1" about itself. It is wrong.\nScore: 0'
    cases = [(planted, {}, 0.0), ("Score: 1e-1", {}, 0.1), ("Score: 7", {"score_min": 1, "score_max": 10}, 6 / 9),
             ("Score: 85", {}, None), ("Score: -0.5", {}, None), ("I cannot grade this.", {}, None)]
    for reply, scale, want in cases:
        base, _ = judge("--reply", reply)
        rm = RewardModelCfg(url=base + "/v1/chat/completions", api_key_env="JUDGE_KEY", retries=0, timeout_s=5,
                            **scale)
        t = _task(user_files, data, "has_quote", rewards=dict(model=rm, weights=[0.0, 1.0]))
        p = t.train_prompts()[0]
        with RewardPool(t, workers=1, timeout_s=5.0) as pool:
            parts = pool.score([(p, "an answer")]).parts
            tally = pool.take_tallies()["reward_model"]
        if want is None:
            assert tally["failed"] == 1 and tally["mean"] is None, (reply, tally)
        else:
            assert parts["reward_model"] == [pytest.approx(want)] and tally["failed"] == 0, (reply, parts)
    for scores, scale, failed in [([1e9], {}, 1), ([1e9], {"score_max": 1e10}, 0), (["NaN"], {}, 1)]:
        base, _ = judge("--scores", json.dumps(scores))
        rm = RewardModelCfg(url=base + "/score", kind="score", api_key_env="JUDGE_KEY", retries=0, **scale)
        t = _task(user_files, data, "has_quote", rewards=dict(model=rm))
        with RewardPool(t, workers=1, timeout_s=5.0) as pool:
            pool.score([(t.train_prompts()[0], "x")])
            assert pool.take_tallies()["reward_model"]["failed"] == failed, (scores, scale)
    with pytest.raises(ValueError, match="score_min = 1 must be below score_max = 1"):
        RewardModelCfg(url=base, score_min=1.0)


# ------------------------------------------------------------------------------------------- tools


def test_tools_get_their_schema_from_type_hints_and_docstring_and_run_in_the_environment(user_files,
                                                                                         stories260k_hf_dir):
    from rlboost_hpc.tasks.tools import ToolEnvironment, ToolSyntax
    from rlboost_hpc.tasks.user_tools import load_tools

    tmp = user_files
    (tmp / "tools.py").write_text('''
def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: the word.
    """
    return {"cat": "a small animal"}.get(word, "unknown")

def add(a: int, b: int = 1) -> dict:
    """Add two integers.

    Args:
        a: first.
        b: second.
    """
    return {"sum": a + b}

def untyped(x):
    """No hints.

    Args:
        x: something.
    """
''')
    tools = load_tools([f"{tmp / 'tools.py'}:lookup", f"{tmp / 'tools.py'}:add"])
    assert [n for n, _, _ in tools] == ["lookup", "add"]
    assert tools[1][2]["function"]["parameters"]["required"] == ["a"]
    with pytest.raises(BadInput, match=r"task.turns.tools\[0\].*untyped.*type hint"):
        load_tools([f"{tmp / 'tools.py'}:untyped"])
    env = ToolEnvironment(str(stories260k_hf_dir), use_chat=False, syntax=ToolSyntax("", "."),
                          tools=(f"{tmp / 'tools.py'}:lookup", f"{tmp / 'tools.py'}:add"))
    env.setup()
    step = lambda text: env(("step", env._hf(text, add_special_tokens=False)["input_ids"]))  # noqa: E731
    assert step('{"name": "lookup", "arguments": {"word": "cat"}}.').text == "a small animal"
    assert json.loads(step('{"name": "add", "arguments": {"a": 2, "b": 5}}.').text) == {"sum": 7}
    bad = step('{"name": "add", "arguments": {"z": 1}}.')
    assert bad.error and "bad arguments for add" in bad.text
    assert "unknown tool 'calculator'" in step("2 + 3.").text  # the calculator is one tool among others


# ------------------------------------------------------------------------------------------- task check


def _cli(*args, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=e, timeout=300)


#: examples/gsm8k_jsonl/config.toml's [task] table in the flat layout of earlier releases (issue 56 item 1).
FLAT_GSM8K_TASK = """
[task]
name = "gsm8k_jsonl"
dataset = "train.jsonl"
heldout_dataset = "test.jsonl"
prompt_field = "prompt"
reward_functions = ["rewards.py:correct", "rewards.py:concise"]
reward_weights = [1.0, 0.1]
heldout_prompts = 32
"""


def test_a_config_of_the_earlier_flat_task_layout_is_read_in_the_new_places_and_says_so(user_files, caplog):
    """Issue 56: ``[task]`` is four tables now (data, rewards, turns, environment). A team's config of the flat layout
    still runs: through ``rlboost-hpc task check`` it passes, each key moved to its new place with a warning naming
    old and new; loaded, it is the very configuration of the new layout; a ``--set`` of a new name overrides the file's
    old key."""
    import logging
    import tomllib

    example = REPO / "examples/gsm8k_jsonl"
    text = (example / "config.toml").read_text()
    old = user_files / "ex" / "config.toml"  # beside the example's files, as the team's copy would be
    shutil.copytree(example, old.parent)
    old.write_text(text[:text.index("[task]")] + FLAT_GSM8K_TASK + text[text.index("[rollout]"):])
    assert "task" in tomllib.loads(old.read_text()) and "data" not in tomllib.loads(old.read_text())["task"]
    cache = f"task.data.cache_dir='{user_files / 'cache'}'"
    with caplog.at_level(logging.WARNING, logger="rlboost.config"):
        flat = load_config(old, [cache])
    said = [r.getMessage() for r in caplog.records if r.name == "rlboost.config"]
    assert len(said) == 1 and str(old) in said[0], said
    assert "task.dataset → task.data.path" in said[0] and "task.reward_weights → task.rewards.weights" in said[0]
    (old.parent / "new.toml").write_text(text)
    assert flat.model_dump() == load_config(old.parent / "new.toml", [cache]).model_dump()
    assert flat.task.kind == "own" and flat.task.data.path == str(old.parent / "train.jsonl")
    p = _cli("task", "check", "--config", str(old), "--set", cache)
    assert p.returncode == 0 and "task check: OK" in p.stdout, p.stderr[-2000:]
    assert "task.reward_functions → task.rewards.functions" in p.stderr, p.stderr[-2000:]
    other = _cli("task", "check", "--config", str(old), "--set", cache, "--set", "task.data.path='no-such.jsonl'")
    assert other.returncode == 2 and "task.data.path = no-such.jsonl" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr  # (a --set of the new name overrides the file's old key)


def test_task_check_passes_the_gsm8k_example_and_names_what_is_wrong_with_bad_tasks(user_files):
    tmp = user_files
    cache = f"task.data.cache_dir='{tmp / 'cache'}'"
    ok = _cli("task", "check", "--config", "examples/gsm8k_jsonl/config.toml", "--set", cache)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "task check: OK" in ok.stdout and "prompt tokens:" in ok.stdout and "reward correct" in ok.stdout
    data = _jsonl(tmp / "d.jsonl", _rows())
    base = ["task", "check", "--config", "configs/local.toml", "--set", cache, "--set", f"task.data.path='{data}'"]
    for fn, why in [("raises", "reward raises"), ("hangs", "ran past 2 s")]:
        p = _cli(*base, "--set", f"task.rewards.functions=['{tmp / 'rewards.py'}:{fn}']", "--set",
                 "task.rewards.timeout_s=2")
        assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, (fn, p.stderr[-2000:])
    long = _jsonl(tmp / "long.jsonl", _rows() + [{"prompt": "word " * 600, "answer": "x", "data_source": "s",
                                                  "n": 99}])
    p = _cli(*base, "--set", f"task.data.path='{long}'", "--set",
             f"task.rewards.functions=['{tmp / 'rewards.py'}:has_quote']")
    assert p.returncode == 2 and "exceeds the model's context" in p.stderr and "column 'prompt'" in p.stderr, p.stderr


def test_a_heldout_fraction_of_zero_and_no_reward_are_refused(user_files):
    tmp = user_files
    data = _jsonl(tmp / "d.jsonl", _rows())
    with pytest.raises(BadInput, match="no held-out prompts"):
        _task(tmp, data, heldout_fraction=0.0)
    with pytest.raises(ValueError, match="task.data.path needs a reward"):
        TaskCfg(data=dict(path=str(data)))
    assert 10 <= len(_task(tmp, data, heldout_fraction=0.5).heldout_prompts()) <= 30


def test_run_checks_your_tasks_prompt_files_first_whatever_task_name_labels_it(user_files, tmp_path):
    """Regression (the input check of issue 50 met issue 48's tasks): ``rlboost-hpc run`` of a user's task named
    ``my_task`` (a label, not a built-in) was refused as an unknown task; the check now looks at task.data.path itself —
    a prompt file that is not there is exit 2 naming the key, before the model loads and before the run directory
    holds a journal."""
    tmp = user_files
    args = ["run", "--config", "configs/local.toml", "--out", str(tmp_path / "o"), "--no-progress",
            "--set", "task.name='my_task'", "--set", f"task.rewards.functions=['{tmp / 'rewards.py'}:has_quote']",
            "--set", f"task.data.cache_dir='{tmp / 'cache'}'"]
    p = _cli(*args, "--set", f"task.data.path='{tmp / 'missing.jsonl'}'")
    assert p.returncode == 2 and "task.data.path" in p.stderr and "no such file" in p.stderr, p.stderr[-2000:]
    assert "unknown task" not in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o/manager-journal.jsonl").exists()
    p = _cli(*args, "--set", f"task.data.path='{_jsonl(tmp / 'd.jsonl', _rows())}'", "--set",
             f"task.data.heldout_path='{tmp / 'gone.jsonl'}'")
    assert p.returncode == 2 and "task.data.heldout_path" in p.stderr and "unknown task" not in p.stderr, p.stderr


# Qwen2.5's way of showing tools (simplified): a system turn listing each tool's JSON schema in <tools>
TOOLS_CHATML = ("{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{ '\\n' }}"
                "{{ t | tojson }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
                "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_the_tools_schemas_reach_the_chat_templates_prompt_through_task_check(tmp_path):
    """Issue 58 item 6: user tools' schemas were never shown to reach the chat template's ``tools=``. Through
    ``rlboost-hpc task check`` on examples/tools with an instruct-style model whose chat template lists tools (as
    Qwen2.5's does): the rendered prompt holds each tool's JSON schema — its name, description and parameters, from
    the function's type hints and docstring."""
    from _models import make_model_dir

    model = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_CHATML
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    arch = json.loads((model / "config.json").read_text())  # (this tokenizer's 512 ids spell JSON in many tokens)
    (model / "config.json").write_text(json.dumps({**arch, "max_position_embeddings": 2048}))
    p = _cli("task", "check", "--config", "examples/tools/config.toml", "--set", f"model.path='{model}'",
             "--set", "task.chat_template='on'", "--set", "task.turns.tool_call_open='<tool_call>'",
             "--set", "task.turns.tool_call_close='</tool_call>'", "--set",
             f"task.data.cache_dir='{tmp_path / 'cache'}'")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    prompt = p.stdout.split("--- prompt", 1)[1].split("--- prompt", 1)[0]
    listed = [json.loads(line) for line in prompt.split("<tools>", 1)[1].split("</tools>", 1)[0].strip().splitlines()]
    assert [t["function"]["name"] for t in listed] == ["dictionary", "count_letters"], prompt
    assert listed[1]["function"]["description"].startswith("Count how many times a letter appears")
    assert listed[1]["function"]["parameters"]["required"] == ["word", "letter"]
    assert listed[0]["function"]["parameters"]["properties"]["word"]["type"] == "string"
