"""Tests of rlboost_hpc.tasks: registry, the stories260K demo task, GSM8K and MATH-500 on the real data."""
from __future__ import annotations

import hashlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost_hpc.paths import DataFileMissing
from rlboost_hpc.tasks.base import Prompt, Task, get_task, known_tasks
from rlboost_hpc.tasks.math import (
    GSM8KTask,
    Math500Task,
    answers_match,
    extract_answer,
    gsm8k_gold,
    last_boxed,
)
from rlboost_hpc.tasks.math import _mv_verify  # the math_verify path itself, bypassing the fast paths
from rlboost_hpc.tasks.stories import OPENINGS, StoryQuoteTask, quote_reward, repetition_rate

# ------------------------------------------------------------------------------------------- registry


def test_registry_builds_known_tasks() -> None:
    assert known_tasks() == ["gsm8k", "gsm8k_tools", "math500", "stories"]
    assert isinstance(get_task("stories"), StoryQuoteTask)
    assert get_task("stories", strict=True).strict is True
    assert isinstance(get_task("gsm8k", n_heldout=5), GSM8KTask)
    assert isinstance(get_task("math500"), Math500Task)


def test_registry_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'.*gsm8k, gsm8k_tools, math500, stories"):
        get_task("gsm9k")


def test_registry_unknown_option_lists_accepted() -> None:
    with pytest.raises(ValueError, match=r"accepted options: n_train, n_heldout, strict, seed"):
        get_task("stories", nonsense=1)


def test_split_by_name() -> None:
    t = get_task("stories")
    assert t.prompts("train") == t.train_prompts()
    assert t.prompts("heldout") == t.heldout_prompts()
    with pytest.raises(ValueError, match="unknown split"):
        t.prompts("test")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- stories


def test_openings_are_clean() -> None:
    assert len(OPENINGS) >= 96
    assert len(set(OPENINGS)) == len(OPENINGS)
    for o in OPENINGS:
        assert '"' not in o and o == o.strip() and o


def test_story_reward_examples() -> None:
    t = StoryQuoteTask()
    p = t.train_prompts()[0]
    assert t.reward(p, ' girl named Lily. She said, "Hi!"') == 1.0
    assert t.reward(p, ' girl named Lily. She said, "') == 1.0  # an opening quote is enough
    assert t.reward(p, " girl named Lily. She liked to play.") == 0.0
    assert t.reward(p, "") == 0.0
    assert t.reward(p, " girl said \u201cHi\u201d") == 0.0  # curly quotes are not the straight quote
    # The text is taken literally: stripping the stop token (BOS for stories260K) is the caller's job.
    assert t.reward(p, " the end.<s>") == 0.0


def test_story_reward_strict() -> None:
    t = StoryQuoteTask(strict=True)
    p = t.heldout_prompts()[0]
    assert t.reward(p, ' He said, "Let us play!" and ran.') == 1.0
    assert t.reward(p, ' He said, "') == 0.0  # not closed
    assert t.reward(p, ' " " " ,') == 0.0  # closed but no letter inside
    assert t.reward(p, ' "..." then "ok"') == 1.0
    assert t.reward(p, " no quotes") == 0.0
    assert quote_reward('a "b" c', strict=True) == 1.0 and quote_reward('a "', strict=True) == 0.0


def test_story_split_disjoint_deterministic() -> None:
    a, b = StoryQuoteTask(), StoryQuoteTask()
    tr, ho = a.train_prompts(), a.heldout_prompts()
    assert (len(tr), len(ho)) == (64, 32)
    assert tr == b.train_prompts() and ho == b.heldout_prompts()
    assert not {p.pid for p in tr} & {p.pid for p in ho}
    assert not {p.text for p in tr} & {p.text for p in ho}
    assert len({p.pid for p in tr + ho}) == 96
    # pinned: a change of OPENINGS or of the split must be deliberate (update this digest with it)
    digest = hashlib.sha1("|".join(p.pid for p in tr + ho).encode()).hexdigest()
    assert digest == "cccc1abe8d15443b0eb670e41c051c1c9a3783c0"
    # the returned lists are copies
    tr.clear()
    assert len(a.train_prompts()) == 64


def test_story_split_sizes_and_pids_stable() -> None:
    small = StoryQuoteTask(n_train=10, n_heldout=5)
    big = StoryQuoteTask(n_train=70, n_heldout=34)
    assert len(small.train_prompts()) == 10 and len(small.heldout_prompts()) == 5
    assert small.train_prompts() == big.train_prompts()[:10]
    by_text = {p.text: p.pid for p in big.train_prompts() + big.heldout_prompts()}
    for p in small.train_prompts() + small.heldout_prompts():
        assert by_text[p.text] == p.pid
    assert StoryQuoteTask(seed=1).train_prompts() != StoryQuoteTask().train_prompts()
    with pytest.raises(ValueError, match="exceeds"):
        StoryQuoteTask(n_train=100, n_heldout=32)
    with pytest.raises(ValueError):
        StoryQuoteTask(n_train=0)


def test_story_format_and_stops() -> None:
    t = StoryQuoteTask()
    p = t.train_prompts()[3]
    assert t.format_prompt(p) == p.text
    assert t.stop_strings == ()


def test_repetition_rate() -> None:
    assert repetition_rate("") == 0.0
    assert repetition_rate("one two") == 0.0
    assert repetition_rate("Once upon a time, there was a little girl named Lily.") == 0.0
    assert repetition_rate("went to the park " * 5) == pytest.approx(1 - 4 / 18)
    assert repetition_rate('" " " " " " " "') > 0.8
    assert repetition_rate(",,,,,,,,,,,,") > 0.8
    assert 0.0 <= repetition_rate("a b c a b c d") <= 1.0


# ------------------------------------------------------------------------------------ extraction


def test_last_boxed() -> None:
    assert last_boxed(r"x \boxed{1} y \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{3} then truncated \boxed{4") == "3"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed 5 is it") == "5"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxedx{3}") is None
    assert last_boxed(r"{ \boxed{3}") == "3"  # an unrelated unclosed brace does not matter
    assert last_boxed(r"\boxed{6} then \boxed 5") == "5"


def test_extract_answer() -> None:
    assert extract_answer("She pays 5-3=2 dollars.\n#### 2", "gsm8k") == "2"
    assert extract_answer("#### 1,234 dollars", "gsm8k") == "1,234"
    assert extract_answer("The answer is 5-3=2. Then 7 more.", "gsm8k") == "2"
    assert extract_answer("The answer is 18 apples for 3 kids", "gsm8k") == "18"
    assert extract_answer("The answer is: -7.", "gsm8k") == "-7"
    assert extract_answer("I got 3, then 4", "gsm8k") == "4"
    assert extract_answer(r"The answer is 3 so \boxed{4}", "gsm8k") == "4"
    assert extract_answer("5-3", "math") == "3"  # a binary minus is not a sign
    assert extract_answer("it is 3/4", "math") == "3/4"
    assert extract_answer("no digits", "gsm8k") is None


def test_answers_match_basics() -> None:
    assert answers_match("18", "18") and answers_match("18", "$18") and answers_match("18", "18.00")
    assert answers_match("1250", "1,250") and not answers_match("18", "19")
    assert answers_match(r"\frac{1}{2}", "0.5") and answers_match(r"\frac{1}{2}", "1/2")
    assert answers_match(r"11,\! 111,\! 111,\! 100", "11111111100")
    assert not answers_match("-2, 1", "-21")  # a list is not a thousands-grouped number
    assert answers_match(r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)")
    assert not answers_match("18", None) and not answers_match("18", "  ")


def test_answers_match_guards_runaway_inputs() -> None:
    t0 = time.perf_counter()
    assert not answers_match("3", "10^{10^{10}}")
    assert not answers_match("3", "2^{99999999}")
    assert not answers_match("3", "99999!")
    assert not answers_match("3", "x+" * 500)
    assert not answers_match("3", "(10!)!")
    # extraction is linear in the response length, even for pathological output
    assert extract_answer("\\boxed{" * 20000 + "1}") == "1"
    assert extract_answer("{" * 50000 + " 1 " * 50000, "gsm8k") == "1"
    assert time.perf_counter() - t0 < 2.0


def test_reward_works_in_threads() -> None:
    """math_verify runs with its signal-based timeouts off, so it works off the main thread."""
    task = Math500Task(n_heldout=40)
    prompts = task.heldout_prompts()
    golds = [p.meta["answer"] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        same = list(pool.map(_mv_verify, golds, golds))
        wrong = list(pool.map(task.reward, prompts, [f"\\boxed{{{g}+1}}" for g in golds]))
        right = list(pool.map(task.reward, prompts, [f"so \\boxed{{{g}}}" for g in golds]))
    assert same == [True] * 40 and wrong == [0.0] * 40 and right == [1.0] * 40


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200) | st.text(alphabet="0123456789+-*/^{}\\()boxed,.=# ", max_size=120))
def test_reward_total_on_any_text(text: str) -> None:
    g = Prompt(pid="t/0", text="q", meta={"answer": "18"})
    m = Prompt(pid="t/1", text="q", meta={"answer": r"\frac{1}{2}"})
    assert GSM8KTask().reward(g, text) in (0.0, 1.0)
    assert Math500Task().reward(m, text) in (0.0, 1.0)
    assert StoryQuoteTask().reward(g, text) in (0.0, 1.0)


def test_reward_rejects_foreign_prompt() -> None:
    with pytest.raises(ValueError, match="no gold answer"):
        GSM8KTask().reward(Prompt(pid="x", text="q"), "18")


# ------------------------------------------------------------------------------ GSM8K (real data)


def test_gsm8k_gold() -> None:
    assert gsm8k_gold("a\nb\n#### 1,080\n") == "1080"
    assert gsm8k_gold("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("no final line")


def test_gsm8k_splits_and_format() -> None:
    t = GSM8KTask(n_train=50, n_heldout=20)
    tr, ho = t.train_prompts(), t.heldout_prompts()
    assert len(tr) == 50 and len(ho) == 20
    assert not {p.pid for p in tr} & {p.pid for p in ho}
    assert ho[0].pid == "gsm8k/test/0" and ho[0].meta["answer"] == "18"
    assert t.format_prompt(ho[0]) == f"Question: {ho[0].text}\nAnswer:"
    assert all(re.fullmatch(r"-?\d+", p.meta["answer"]) for p in tr + ho)
    assert len(GSM8KTask().heldout_prompts()) == 1319


def test_gsm8k_reward_on_gold_and_perturbed() -> None:
    t = GSM8KTask(n_heldout=200)
    failures = []
    for p in t.heldout_prompts():
        gold = int(p.meta["answer"])
        sol = p.meta["solution"]
        wrong_sol = re.sub(r"####\s*[-\d,]+\s*$", f"#### {gold + 1}", sol.rstrip())
        cases = {
            "solution": (sol, 1.0),
            "answer_is": (f"The answer is {gold}.", 1.0),
            "answer_is_commas": (f"The answer is {gold:,}.", 1.0),
            "boxed": (f"So the total is \\boxed{{{gold}}}.", 1.0),
            "solution+1": (wrong_sol, 0.0),
            "answer_is+1": (f"The answer is {gold + 1}.", 0.0),
            "different": (f"The answer is {gold * 3 + 7}.", 0.0),
        }
        for label, (resp, want) in cases.items():
            if t.reward(p, resp) != want:
                failures.append((p.pid, label, resp[-80:]))
    print(f"GSM8K reward failures: {len(failures)}")
    assert failures == []


# --------------------------------------------------------------------------- MATH-500 (real data)

#: gold answers math_verify cannot handle: pid -> reason. Currently none (all 500 verify).
MATH500_KNOWN_EXCEPTIONS: dict[str, str] = {}


def _perturb(gold: str) -> str:
    """A different answer: the first integer in the gold plus one, else the gold with "+1" appended."""
    m = re.search(r"\d+", gold)
    if m:
        return gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end() :]
    return gold + "+1"


def test_math500_splits() -> None:
    t = Math500Task()
    tr, ho = t.train_prompts(), t.heldout_prompts()
    assert (len(tr), len(ho)) == (400, 100)
    assert not {p.pid for p in tr} & {p.pid for p in ho}
    assert len({p.pid for p in tr + ho}) == 500
    assert "\\boxed{}" in t.format_prompt(ho[0]) and t.format_prompt(ho[0]).startswith("Question: ")
    assert len(Math500Task(n_heldout=10, n_train=7).train_prompts()) == 7
    with pytest.raises(ValueError, match="exceeds"):
        Math500Task(n_heldout=501).heldout_prompts()


def test_math500_all_gold_verify_and_perturbed_fail() -> None:
    t = Math500Task(n_heldout=500)
    t0 = time.perf_counter()
    pos_fail, neg_fail = [], []
    for p in t.heldout_prompts():
        gold = p.meta["answer"]
        if t.reward(p, f"Thus the answer is $\\boxed{{{gold}}}$.") != 1.0:
            pos_fail.append((p.pid, gold))
        elif not _mv_verify(gold, gold):  # the reward's string fast path passed; math_verify must agree
            pos_fail.append((p.pid, gold, "math_verify"))
        for wrong in (_perturb(gold), gold + "+1"):
            if t.reward(p, f"\\boxed{{{wrong}}}") != 0.0:
                neg_fail.append((p.pid, gold, wrong))
    elapsed = time.perf_counter() - t0
    print(f"MATH-500: {len(pos_fail)} gold not verified, {len(neg_fail)} perturbed accepted, {elapsed:.1f} s")
    for f in pos_fail + neg_fail:
        print("  ", f)
    unexpected = [f for f in pos_fail + neg_fail if f[0] not in MATH500_KNOWN_EXCEPTIONS]
    assert unexpected == []
    assert len(MATH500_KNOWN_EXCEPTIONS) <= 5


# ------------------------------------------------------------------------------ data-file errors


def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBOOST_DATA", str(tmp_path))
    return tmp_path


def test_bad_jsonl_line_names_file_and_line(tmp_path, monkeypatch) -> None:
    d = _data_dir(tmp_path, monkeypatch)
    (d / "gsm8k").mkdir()
    good = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    (d / "gsm8k" / "test.jsonl").write_text(f"{good}\n\n{good}\n{{not json\n")
    with pytest.raises(ValueError, match=r"test\.jsonl: line 4: malformed JSON"):
        GSM8KTask().heldout_prompts()
    (d / "gsm8k" / "test.jsonl").write_text(f"{good}\n" + json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(ValueError, match=r"test\.jsonl: line 2: .*####"):
        GSM8KTask().heldout_prompts()
    (d / "gsm8k" / "test.jsonl").write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object"):
        GSM8KTask().heldout_prompts()
    (d / "math500").mkdir()
    (d / "math500" / "math500.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + '\n{"problem": "q"}\n')
    with pytest.raises(ValueError, match=r"math500\.jsonl: line 2: missing field\(s\) \['answer'\]"):
        Math500Task(n_heldout=1).heldout_prompts()


def test_small_data_dir_works(tmp_path, monkeypatch) -> None:
    d = _data_dir(tmp_path, monkeypatch)
    (d / "gsm8k").mkdir()
    (d / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    (p,) = GSM8KTask().heldout_prompts()
    assert p.meta["answer"] == "2" and GSM8KTask().reward(p, "#### 2") == 1.0


def test_missing_data_file_names_origin(tmp_path, monkeypatch) -> None:
    _data_dir(tmp_path, monkeypatch)
    with pytest.raises(DataFileMissing, match=r"train\.jsonl.*openai/grade-school-math"):
        GSM8KTask().train_prompts()
    with pytest.raises(DataFileMissing, match=r"math500\.jsonl.*MATH-500"):
        Math500Task().heldout_prompts()
    # constructing a task and computing rewards needs no file
    assert GSM8KTask().reward(Prompt(pid="x", text="q", meta={"answer": "4"}), "#### 4") == 1.0


def test_tasks_are_task_subclasses() -> None:
    for name in known_tasks():
        assert isinstance(get_task(name), Task)


def test_the_tool_task_is_built_with_the_runs_tool_call_syntax():
    """Issue 56: ``make_task`` builds ``gsm8k_tools`` with ``task.turns.tool_call_open`` /
    ``task.turns.tool_call_close`` (no attribute set on the task from outside): its prompts teach that syntax."""
    from rlboost_hpc.config_task import TaskCfg
    from rlboost_hpc.tasks.user_task import make_task

    t = make_task(TaskCfg(name="gsm8k_tools", train_prompts=2, heldout_prompts=1,
                          turns=dict(max=3, tool_call_open="<<call>>", tool_call_close="<</call>>")))
    text = t.format_prompt(t.train_prompts()[0])
    assert '<<call>>{"name": "calculator"' in text and "<</call>>" in text
    plain = make_task(TaskCfg(name="gsm8k", train_prompts=2, heldout_prompts=1))
    assert "<<call>>" not in plain.format_prompt(plain.train_prompts()[0])
