"""A stateful multi-turn environment of a user's own (``task.environment``, issue 48 item 4): the class checked at
load, one instance per trajectory rebuilt by replay wherever it is not live (and a replay that answers otherwise
refused), the manager's turns, rewards and journal, the reward's combination and failure policy; real runs of the
example (training through a manager kill, ``task check``, bad input) are in the integration tests at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlboost_hpc.manager.state import ENV_PEER
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.tasks.environment import (EnvironmentCalls, EnvironmentRunner, TurnCall, load_environment,
                                           row_json)
from rlboost_hpc.tasks.user_code import UserCodeError

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples/env_counter"

ENVS = '''
"""Test environments: a number guess, and ways an environment goes wrong."""
import time


class Guess:
    """Guess the row's secret digit; every step says higher or lower and counts the tries."""

    def reset(self, row):
        self.secret, self.tries = int(row["secret"]), 0
        return "Guess my digit."

    def step(self, turn):
        self.tries += 1
        digits = [c for c in turn if c.isdigit()]
        if not digits:
            return f"No digit, try {self.tries}.", 0.0, False
        if int(digits[0]) == self.secret:
            return "Right!", 1.0, True
        return f"{'Higher' if int(digits[0]) < self.secret else 'Lower'}, try {self.tries}.", -0.1, False


class Flaky(Guess):
    """Not deterministic: what it says depends on how many steps this process ran before."""

    ran = 0

    def reset(self, row):
        self.secret, self.tries = int(row.get("secret", 7)), 0
        return "Guess my digit."

    def step(self, turn):
        Flaky.ran += 1
        obs, reward, done = super().step(turn)
        return f"{obs} ({Flaky.ran})", reward, done


class Broken(Guess):
    def step(self, turn):
        if "3" in turn:
            raise ValueError("cannot handle 3")
        return super().step(turn)


class Hangs(Guess):
    def step(self, turn):
        if "hang" in turn:
            time.sleep(60)
        return super().step(turn)


class NaN(Guess):
    def step(self, turn):
        return "obs", float("nan"), False


class NoStep:
    def reset(self, row):
        return ""


class TwoArgs:
    def reset(self, row, seed):
        return ""

    def step(self, turn):
        return "", 0.0, False


class NeedsSize:
    def __init__(self, size):
        self.size = size

    def reset(self, row):
        return ""

    def step(self, turn):
        return "", 0.0, False


def not_a_class(row):
    return ""
'''

ROW = row_json({"prompt": "Guess", "secret": 7})


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def runner(envs, name, hf_dir, **kw):
    r = EnvironmentRunner(f"{envs}:{name}", tokenizer_dir=str(hf_dir), stop_ids=(2,), plain_format="\n{result}\n",
                          **kw)
    r.setup()
    return r


def ids(r, text):
    return np.asarray(r._hf(text, add_special_tokens=False)["input_ids"], dtype="<i4").tobytes()


def play(r, turns, trajectory="t"):
    """Play ``turns`` (texts) on ``r`` as the manager would: each call carries the history; returns the outcomes
    and the history."""
    history, outs = [], []
    for k, text in enumerate(turns):
        out = r(("turn", TurnCall(trajectory, k, ids(r, text), ROW, "Guess my digit.", tuple(history))))
        outs.append(out)
        history.append((ids(r, text), np.asarray(out.obs_ids, dtype="<i4").tobytes(), out.reward))
    return outs, history


# ------------------------------------------------------------------------------------------------ the class
@pytest.mark.parametrize("name, why", [
    ("NoStep", "has no step(assistant_turn) method"), ("TwoArgs", "must take one argument (row)"),
    ("NeedsSize", "must be constructible without arguments"), ("not_a_class", "not a class"),
    ("Missing", "has no 'Missing'"),
])
def test_a_class_without_reset_and_step_of_the_right_shape_is_refused_naming_the_key(envs, name, why):
    with pytest.raises(UserCodeError, match="task.environment") as e:
        load_environment(f"{envs}:{name}")
    assert why in str(e.value)


def test_the_environment_is_a_config_key_of_your_own_multi_turn_task():
    from pydantic import ValidationError

    from rlboost_hpc.config_task import TaskCfg

    data, env, turns = {"path": "d.jsonl"}, {"class_path": "e.py:E"}, {"max": 3}
    ok = TaskCfg(data=data, environment=env, turns=turns)
    assert ok.environment.class_path == "e.py:E" and not ok.rewards.functions  # the environment's reward is a reward
    for bad, why in [(dict(environment=env, turns=turns), "need task.data.path"),
                     (dict(data=data, environment=env), "task.turns.max > 1"),
                     (dict(data=data, environment=env, turns=dict(max=3, tools=["t.py:f"])), "task.turns.tools"),
                     (dict(data=data, environment=env, turns=turns, rewards=dict(functions=["r.py:f"], weights=[1.0])),
                      "2 reward terms"),
                     (dict(data=data, environment={}, turns=turns), "exactly one of class_path .* and openenv"),
                     (dict(data=data, environment={**env, "openenv": {"url": "http://h:1"}}, turns=turns),
                      "exactly one of"),
                     (dict(data=data, environment={"openenv": {"url": "h:1"}}, turns=turns), "openenv.url"),
                     (dict(data=data, environment={**env, "reward_range": [1, 0]}, turns=turns),
                      r"reward_range = \[1\.0, 0\.0\]: low must be below high")]:
        with pytest.raises(ValidationError, match=why):
            TaskCfg(**bad)


# ------------------------------------------------------------------------------------------------ the instances
def test_an_instance_not_live_is_rebuilt_by_replay_and_answers_as_the_live_one(envs, stories260k_hf_dir):
    live = runner(envs, "Guess", stories260k_hf_dir)
    outs, history = play(live, ["I say 2", "then 9", "now 5", "it is 7"])
    assert [o.reward for o in outs] == [-0.1, -0.1, -0.1, 1.0] and [o.done for o in outs] == [False] * 3 + [True]
    assert [o.replayed for o in outs] == [0, 0, 0, 0]  # its instance stayed live in this worker
    assert live._hf.decode(outs[2].obs_ids).strip() == "Higher, try 3."  # state: the tries so far
    # another worker (a replaced one, a restarted manager's) holds no instance: it replays reset and turns 0..2
    fresh = runner(envs, "Guess", stories260k_hf_dir)
    again = fresh(("turn", TurnCall("t", 3, ids(fresh, "it is 7"), ROW, "Guess my digit.", tuple(history[:3]))))
    assert again == outs[3].__class__(**{**vars(outs[3]), "replayed": 4})
    third = fresh(("turn", TurnCall("t", 2, ids(fresh, "now 5"), ROW, "Guess my digit.", tuple(history[:2]))))
    assert third.obs_ids == outs[2].obs_ids and third.replayed == 3  # (its instance had ended: rebuilt again)


def test_a_replay_that_answers_otherwise_is_refused_naming_the_turn(envs, stories260k_hf_dir):
    live = runner(envs, "Flaky", stories260k_hf_dir)
    outs, history = play(live, ["1", "2", "4"])
    assert all(o.status == "ok" for o in outs)
    fresh = runner(envs, "Flaky", stories260k_hf_dir)
    out = fresh(("turn", TurnCall("t", 2, ids(fresh, "4"), ROW, "Guess my digit.", tuple(history[:2]))))
    assert out.status == "diverged" and out.obs_ids == []
    assert "is not deterministic" in out.error and "trajectory t" in out.error and "turn 0" in out.error
    # a first observation other than the prompt's is refused too
    out = fresh(("turn", TurnCall("u", 1, ids(fresh, "4"), ROW, "Guess my NUMBER.", tuple(history[:1]))))
    assert out.status == "diverged" and "reset(row)" in out.error


def test_a_step_that_raises_or_returns_a_bad_reward_is_an_environment_error(envs, stories260k_hf_dir):
    broken = runner(envs, "Broken", stories260k_hf_dir)
    outs, _ = play(broken, ["1", "3"])
    assert outs[0].status == "ok" and outs[1].status == "error" and "ValueError: cannot handle 3" in outs[1].error
    nan = runner(envs, "NaN", stories260k_hf_dir)
    (out,), _ = play(nan, ["1"])
    assert out.status == "error" and "finite number" in out.error
    # a declared range (task.environment.reward_range): -0.1 for a wrong guess is outside [0, 1] — an error, counted,
    # never clipped to a reward
    ranged = runner(envs, "Guess", stories260k_hf_dir, reward_range=(0.0, 1.0))
    outs, _ = play(ranged, ["x", "1"])
    assert outs[0].status == "ok" and outs[0].reward == 0.0
    assert outs[1].status == "error" and "reward -0.1 is outside task.environment.reward_range [0, 1]" in outs[1].error


@pytest.mark.integration
def test_a_step_past_its_deadline_ends_its_trajectory_and_the_others_of_its_worker_are_rebuilt(envs,
                                                                                              stories260k_hf_dir):
    """A hung step kills its worker (a timeout); the instances that worker held are rebuilt by replay on their next
    call, under a deadline that pays for the replay, and answer exactly as they would have."""
    r = EnvironmentRunner(f"{envs}:Hangs", tokenizer_dir=str(stories260k_hf_dir), stop_ids=(2,),
                          plain_format="\n{result}\n")
    r.setup()
    calls = EnvironmentCalls(r, workers=1, timeout_s=1.5)
    try:
        first = calls.observe_all({("a", 0): TurnCall("a", 0, ids(r, "2"), ROW, "Guess my digit."),
                                   ("b", 0): TurnCall("b", 0, ids(r, "hang"), ROW, "Guess my digit.")})
        assert first[("a", 0)].status == "ok" and first[("b", 0)].status == "timeout"
        assert "deadline" in first[("b", 0)].error and calls.pool.generation(0) == 1
        hist = ((ids(r, "2"), np.asarray(first[("a", 0)].obs_ids, dtype="<i4").tobytes(), -0.1),)
        (nxt,) = calls.observe_all({("a", 1): TurnCall("a", 1, ids(r, "5"), ROW, "Guess my digit.", hist)}).values()
        assert nxt.status == "ok" and nxt.replayed == 2 and r._hf.decode(nxt.obs_ids).strip() == "Higher, try 2."
    finally:
        calls.close()


# ------------------------------------------------------------------------------------------------ the manager
def env_spec(n=1, max_new=4, turns=3, total=40):
    return M.GroupSpec(gid="s0g0", prompt_ids=[1, 5, 6], n=n, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                       seed=3, stop_ids=[2], max_turns=turns, max_trajectory_tokens=total, env_row=ROW,
                       env_first="Guess my digit.")


def step_result(core, rid, turn, obs, reward, done=False, status="ok", error="", replayed=0):
    core.on_message(ENV_PEER, M.EnvResult(rid=rid, turn=turn, obs_ids=M.pack_i32(obs), status=status, tool_s=0.01,
                                          reward=reward, done=done, error=error, replayed=replayed))


def test_every_turn_goes_to_the_environment_whose_rewards_add_up_and_whose_done_ends_the_trajectory():
    from test_trajectories import TRAINER, started, take, tok

    core = started(env_spec(n=2))
    core.on_message(b"a", tok("s0g0/0", 0, [7, 8, 9, 10], M.FINISH_LENGTH))  # cut by its budget: still a step
    core.on_message(b"a", tok("s0g0/1", 0, [7, 2], M.FINISH_STOP))  # the model's own end of turn
    c0, c1 = take(core, ENV_PEER)
    assert (c0.rid, c0.turn, c0.row, c0.first, c0.history, c0.last) == ("s0g0/0", 0, ROW, "Guess my digit.", [], False)
    step_result(core, "s0g0/0", 0, [40, 41], -0.1)
    step_result(core, "s0g0/1", 0, [], 1.0, done=True)
    core.tick()
    take(core)
    core.on_message(b"a", tok("s0g0/0", 0, [11, 2], M.FINISH_STOP))
    (c2,) = take(core, ENV_PEER)
    assert c2.turn == 1 and c2.history == [(M.pack_i32([7, 8, 9, 10]), M.pack_i32([40, 41]), -0.1)]
    assert M.unpack_i32(c2.turn_ids).tolist() == [11, 2] and not c2.last
    step_result(core, "s0g0/0", 1, [42], 0.25, replayed=3)
    core.tick()
    take(core)
    core.on_message(b"a", tok("s0g0/0", 0, [12, 2], M.FINISH_STOP))
    (c3,) = take(core, ENV_PEER)
    assert c3.turn == 2 and c3.last  # the last turn allowed: the trajectory ends after this step, done or not
    step_result(core, "s0g0/0", 2, [], 0.5)
    (done,) = take(core, TRAINER, M.GroupDone)
    r0, r1 = done.responses
    assert (r0.finish_reason, r0.turns, r0.env_return, r0.env_error) == ("turn_cap", 3, pytest.approx(0.65), "")
    assert (r1.finish_reason, r1.turns, r1.env_return) == ("stop", 1, 1.0)
    assert M.observation_mask(r0.observation_runs, 9).tolist() == [False] * 4 + [True] * 2 + [False] * 2 + [True]
    assert core.counters.environment_calls == 4 and core.counters.environment_replays == 1


def test_a_failed_step_ends_as_an_environment_error_and_a_diverged_replay_fails_the_step():
    from test_trajectories import TRAINER, started, take, tok

    core = started(env_spec(n=2))
    core.on_message(b"a", tok("s0g0/0", 0, [7, 2], M.FINISH_STOP))
    core.on_message(b"a", tok("s0g0/1", 0, [8, 2], M.FINISH_STOP))
    take(core)
    step_result(core, "s0g0/0", 0, [], 0.0, status="error", error="ValueError: cannot handle 3")
    assert core.book.requests["s0g0/0"].finish_reason == "environment_error"
    assert core.book.requests["s0g0/0"].env_error == "error: ValueError: cannot handle 3"
    step_result(core, "s0g0/1", 0, [], 0.0, status="diverged", error="task.environment = 'e' is not deterministic")
    (failed,) = take(core, TRAINER, M.StepFailed)
    assert "not deterministic" in failed.error and core.book.requests["s0g0/1"].state == "environment"
    assert core.counters.environment_errors == 2


def test_the_manager_releases_a_trajectory_that_ends_while_its_environment_holds_it():
    """Issue 57 item 5 (the manager's side): a trajectory with no room left for its observation, and the unfinished
    ones a resumed trainer's new version drops, are released to the environment (which closes what it still holds:
    ``EnvironmentCalls.release``); one that ended by ``done`` is released too (nothing left to close there)."""
    from test_trajectories import started, take, tok

    from rlboost_hpc.manager.restore import discard_stale

    core = started(env_spec(n=3, total=8))
    for i in range(3):
        core.on_message(b"a", tok(f"s0g0/{i}", 0, [7, 2], M.FINISH_STOP))
    take(core)
    step_result(core, "s0g0/0", 0, [40, 41, 42, 43, 44, 45], 0.1)  # 2 + 6 tokens: no room for the observation
    assert core.book.requests["s0g0/0"].finish_reason == "trajectory_budget"
    assert [m.rids for m in take(core, ENV_PEER, M.EnvRelease)] == [["s0g0/0"]]
    step_result(core, "s0g0/1", 0, [], 1.0, done=True)
    assert [m.rids for m in take(core, ENV_PEER, M.EnvRelease)] == [["s0g0/1"]]
    assert discard_stale(core) == 1
    assert [m.rids for m in take(core, ENV_PEER, M.EnvRelease)] == [["s0g0/2"]]


def test_environment_calls_release_what_a_worker_holds_and_only_that(envs, stories260k_hf_dir, tmp_path):
    """Issue 57 item 5 (the pool's side): a release closes a live instance once, comes after a step still pending
    for the trajectory, and is nothing for a trajectory whose instance is closed already."""
    log = tmp_path / "instances.log"
    (tmp_path / "counting.py").write_text(COUNTING.format(example=str(EXAMPLE), log=str(log)))
    r = EnvironmentRunner(f"{tmp_path / 'counting.py'}:Counting", tokenizer_dir=str(stories260k_hf_dir),
                          stop_ids=(2,), plain_format="\n{result}\n")
    row = row_json({"prompt": "Go", "start": 1, "target": 3})
    first = "Counter 1, target 3: up or down?"
    calls = EnvironmentCalls(r, timeout_s=10.0)
    try:
        turn = np.asarray([5, 6], dtype="<i4").tobytes()
        got = calls.observe_all({("a", 0): TurnCall("a", 0, turn, row, first),
                                 ("b", 0): TurnCall("b", 0, turn, row, first, last=True)})
        assert got[("a", 0)].obs_ids and not got[("b", 0)].obs_ids  # a lives on, b was closed at its last turn
        calls.submit(("c", 0), TurnCall("c", 0, turn, row, first))
        calls.release(["a", "b", "c", "a"])  # c: after its pending step
        while calls.pending:
            calls.poll(1.0)
        lines = [line.split() for line in log.read_text().splitlines()]
        assert sorted(w for w, _ in lines) == ["close"] * 3 + ["open"] * 3
        assert sorted(i for w, i in lines if w == "close") == sorted(i for w, i in lines if w == "open")
    finally:
        calls.close()
    assert len(log.read_text().splitlines()) == 6  # nothing was left for the close to tear down


def test_a_restarted_manager_keeps_the_steps_rewards_and_asks_for_the_step_in_flight_with_the_history(tmp_path):
    from test_manager_restart import commit, feed, multi_turn_started, restarted
    from test_manager_core import sent, tokens

    core, log = multi_turn_started(tmp_path, env_spec(n=2))
    feed(core, b"a", tokens("s0g0/0", 0, [7, 2], finish=M.FINISH_STOP))
    feed(core, b"a", tokens("s0g0/1", 0, [8, 2], finish=M.FINISH_STOP))
    step_result(core, "s0g0/0", 0, [40, 41], 0.3)
    step_result(core, "s0g0/1", 0, [50], -0.1)
    core.tick()
    feed(core, b"a", tokens("s0g0/1", 0, [9, 2], finish=M.FINISH_STOP))  # its step is in flight at the kill
    commit(core, log)
    log.close()
    new, _, _ = restarted(tmp_path)
    r0, r1 = new.book.requests["s0g0/0"], new.book.requests["s0g0/1"]
    assert r0.state == "queued" and r0.env_rewards == [0.3] and r1.state == "environment" and r1.env_rewards == [-0.1]
    (call,) = sent(new, ENV_PEER, M.EnvCall)
    assert (call.rid, call.turn, call.row) == ("s0g0/1", 1, ROW)
    assert call.history == [(M.pack_i32([8, 2]), M.pack_i32([50]), -0.1)]
    assert call == r1.env_call()
    # the step answered again (say, a second time around the restart) replaces its reward, never adds it twice
    step_result(new, "s0g0/1", 1, [], 1.0, done=True)
    step_result(new, "s0g0/1", 1, [], 1.0, done=True)
    assert r1.env_rewards == [-0.1, 1.0] and r1.finish_reason == "stop"


# ------------------------------------------------------------------------------------------------ the reward
@pytest.fixture
def counter_task(tmp_path):
    from rlboost_hpc.config import load_config
    from rlboost_hpc.tasks.user_task import make_task

    cfg = load_config(EXAMPLE / "config.toml", [f"task.data.cache_dir='{tmp_path / 'cache'}'",
                                                 "task.heldout_prompts=2"])
    task = make_task(cfg.task)
    yield task
    task.close()


def test_the_environments_return_joins_the_reward_functions_by_weight_and_its_failures_follow_the_policy(
        counter_task):
    from rlboost_hpc.tasks.reward_pool import RewardFunctionFailed, RewardPool

    task = counter_task
    assert [(c.name, c.kind, c.weight) for c in task.components] == [("names_a_direction", "trl", 0.2),
                                                                      ("Counter", "environment", 1.0)]
    p = task.train_prompts()[0]
    row, first = task.environment_of(p)
    assert json.loads(row)["start"] == p.meta["start"] and first.startswith(f"Counter {p.meta['start']}, target")
    assert task.format_prompt(p) == f"{p.text}\n\n{first}"  # reset's observation is the prompt's last part
    items = [(p, "go up"), (p, "stay"), (p, "down")]
    env = [(0.5, ""), (1.1, ""), (0.0, "error: ValueError: boom")]
    with RewardPool(task, workers=1, timeout_s=10.0) as pool:
        rewards, parts, failed = pool.score(items, None, env)
        assert parts == {"names_a_direction": [1.0, 0.0, 1.0], "Counter": [0.5, 1.1, None]}
        assert rewards[:2] == pytest.approx([0.2 + 0.5, 1.1]) and failed == (False, False, True)
        assert pool.take_tallies()["Counter"] == {"calls": 3, "failed": 1, "timed_out": 0, "mean": 0.8}
        with pytest.raises(ValueError, match="Counter"):
            pool.score(items)  # an environment's task is never scored without its trajectories' returns
        pool.errors = "fail"
        with pytest.raises(RewardFunctionFailed, match=r"Counter \(task.environment\).*ValueError: boom"):
            pool.score(items, None, env)


def test_held_out_evaluation_plays_the_environment_like_the_rollouts(counter_task, stories260k_hf_dir):
    """Evaluation gives every held-out trajectory an instance of its own: every turn is a step, observations are
    masked out of the KL samples, the environment's return is in the reward, and a second evaluation draws the same."""
    from _util import load_hf_dir

    from rlboost_hpc.models.hf_dir import PolicyTokenizer
    from rlboost_hpc.tasks.reward_pool import RewardPool
    from rlboost_hpc.trainer.eval import TurnSettings, evaluate

    arch, sd = load_hf_dir(stories260k_hf_dir)
    tok = PolicyTokenizer.from_dir(stories260k_hf_dir, arch)
    runner = EnvironmentRunner(str(EXAMPLE / "envs.py:Counter"), tokenizer_dir=str(stories260k_hf_dir),
                               stop_ids=tuple(tok.stop_ids), plain_format="\n{result}\n")
    calls, pool = EnvironmentCalls(runner, timeout_s=10.0), RewardPool(counter_task, workers=1, timeout_s=10.0)
    try:
        turns = TurnSettings(max_turns=3, max_trajectory_tokens=120, tool_stop_ids=(), tools=calls)
        kw = dict(samples=2, max_new_tokens=12, temperature=1.0, top_p=1.0, turns=turns, score=pool.score)
        a, b = evaluate(arch, sd, tok, counter_task, **kw), evaluate(arch, sd, tok, counter_task, **kw)
        tally = pool.take_tallies()["Counter"]
    finally:
        calls.close()
        pool.close()
    assert a["reward_sampled"] == b["reward_sampled"] and a["reward_greedy"] == b["reward_greedy"]
    masked = [s for s in a["sampled"] if s.loss_mask is not None]
    assert len(masked) >= len(a["sampled"]) // 2 and all(len(s.response_ids) <= 120 for s in a["sampled"])
    assert tally["calls"] == 2 * a["responses"] and tally["failed"] == 0 and tally["mean"] is not None


# ------------------------------------------------------------------------------------------------ real runs
def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=timeout)


@pytest.mark.integration
def test_task_check_shows_the_first_observations_and_bad_input_exits_2_naming_the_key(tmp_path, envs):
    import io

    from rlboost_hpc.config import load_config
    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.tasks.check import check_task

    cache = f"task.data.cache_dir='{tmp_path / 'cache'}'"
    out = io.StringIO()
    check_task(load_config(EXAMPLE / "config.toml", [cache]), out=out)
    text = out.getvalue()
    firsts = [line for line in text.splitlines() if "first observation of row" in line]
    assert len(firsts) == 3 and all("Counter " in line and ", target " in line for line in firsts), text
    assert "step('') on row" in text and text.rstrip().endswith("task check: OK")
    for ref, why in [(f"{envs}:Flaky", "must be deterministic"),  # its step('') answers otherwise the second time
                     (f"{envs}:Guess", "reset(row) of row")]:  # the example's rows have no 'secret' column
        with pytest.raises(BadInput, match="task.environment") as e:
            cfg = load_config(EXAMPLE / "config.toml", [cache, f"task.environment.class_path='{ref}'"])
            check_task(cfg, out=io.StringIO())
        assert why in str(e.value)
    run = _cli("run", "--config", str(EXAMPLE / "config.toml"), "--out", str(tmp_path / "bad"), "--no-progress",
               "--set", cache, "--set", f"task.environment.class_path='{envs}:NoStep'")
    assert run.returncode == 2 and "task.environment" in run.stderr and "has no step(assistant_turn)" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.chaos
@pytest.mark.slow
def test_the_counter_example_trains_through_a_manager_kill_its_environments_rebuilt_by_replay(tmp_path):
    """examples/env_counter on the local cluster (preemptible workers): its manager SIGKILLed while trajectories are
    half-way (observations in the work log); the restarted manager's tool processes rebuild their environments by
    replaying the journaled turns — every replayed observation checked against the trajectory's — and the run ends
    with nothing lost, duplicated, off-version or trained twice."""
    rep = trained_through_a_manager_kill(EXAMPLE / "config.toml", tmp_path)
    assert rep["reward_functions"]["Counter"]["calls"] > 0



def trained_through_a_manager_kill(config: Path, tmp_path: Path, *sets: str) -> dict:
    """``rlboost-hpc run --config config`` (3 steps; ``sets``: more ``--set`` overrides), its manager SIGKILLed once a
    trajectory of the second step is past its first turn; the run must end with the manager restarted once, its
    environments rebuilt by replay, nothing lost, duplicated, off-version or trained twice. Returns the report."""
    from rlboost_hpc.manager import worklog as W
    from rlboost_hpc.manager.journal import read
    from rlboost_hpc.rundir import RunDir

    out, rd = tmp_path / "run", RunDir(tmp_path / "run")
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(config), "--out",
            str(out), "--no-progress", "--set", f"task.data.cache_dir='{tmp_path / 'cache'}'",
            "--set", "trainer.steps=3", "--set", "trainer.export_model=false", "--set", "task.heldout_prompts=2",
            "--set", "trainer.eval_samples=1", "--set", "trainer.checkpoint_every=0",
            *[a for x in sets for a in ("--set", x)]]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    killed = None
    try:
        while proc.poll() is None and (not rd.metrics.exists() or not rd.metrics.read_text().strip()):
            time.sleep(0.05)
        while proc.poll() is None and killed is None:  # a trajectory of the next step is past its first turn
            # (and not finished: until the next submission compacts it, the log still holds the first step's
            # observations — a kill then left nothing to replay, as CI's chaos marker saw once)
            recs = W.read(rd.work_log)[0]
            ended = {r.rid for r in recs if isinstance(r, W.Finished)}
            if any(isinstance(r, W.Observation) and r.ids and not r.rid.startswith("s0g") and r.rid not in ended
                   for r in recs):
                killed = [r for r in read(rd.journal) if r.get("event") == "start"][-1]["pid"]
                os.kill(int(killed), 9)
            time.sleep(0.01)
        _, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0 and killed is not None, err[-3000:]
    rep = json.loads(rd.report.read_text())
    assert rep["manager_restarts"] == 1 and rep["environment_replays"] > 0, rep
    assert rep["steps"] == 3 and rep["responses_trained"] == 3 * 8 * 8
    assert rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"] == 0
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["environment_errors"] == 0
    assert rep["turns_per_trajectory_mean"] > 1.5
    assert "not deterministic" not in (rd.logs / "manager.jsonl").read_text()
    return rep


COUNTING = '''
"""The example's Counter, counting its instances: every __init__ and close() appends a line to LOG; the first step
of a turn after the first stalls (past task.turns.timeout_s) and the second raises — once each in the rollouts and
once each in the held-out evaluation."""
import os
import sys
import time
import uuid

sys.path.insert(0, {example!r})
from envs import Counter  # noqa: E402

LOG = {log!r}


def _note(what, env):
    with open(LOG, "a") as f:
        f.write(f"{{what}} {{env.name}}\\n")


def _once(name):
    with open(f"/proc/{{os.getppid()}}/cmdline", "rb") as f:  # the trainer's evaluation, or the manager's rollouts
        role = "evaluation" if b"rlboost_hpc.cli" in f.read() else "rollout"
    try:
        os.close(os.open(f"{{LOG}}.{{role}}.{{name}}", os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class Counting(Counter):
    def __init__(self):
        self.turns, self.name = 0, uuid.uuid4().hex
        _note("open", self)

    def step(self, assistant_turn):
        self.turns += 1
        if self.turns == 2 and _once("stall"):
            time.sleep(120)
        if self.turns == 2 and _once("raise"):
            raise RuntimeError("the second turn of a second trajectory fails")
        return super().step(assistant_turn)

    def close(self):
        _note("close", self)
'''


@pytest.mark.integration
@pytest.mark.slow
def test_every_environment_a_run_opens_is_closed_exactly_once_on_every_ending(tmp_path):
    """Issue 57 item 5 (open-range PR #324), through ``rlboost-hpc run``: the example's Counter counting its instances.
    A trajectory ends by ``done``, its last turn, no room left for the observation (the manager releases it), a
    step that raises, a step past its deadline (its tool process is stopped: the instances it held are closed, and
    rebuilt by replay where they were needed), the held-out evaluation, and the run's end; every instance opened is
    closed, and none twice."""
    log = tmp_path / "instances.log"
    (tmp_path / "counting.py").write_text(COUNTING.format(example=str(EXAMPLE), log=str(log)))
    run = _cli("run", "--config", str(EXAMPLE / "config.toml"), "--out", str(tmp_path / "run"), "--no-progress",
               "--set", f"task.data.cache_dir='{tmp_path / 'cache'}'",
               "--set", f"task.environment.class_path='{tmp_path / 'counting.py'}:Counting'",
               "--set", "task.turns.timeout_s=2",
               "--set", "task.turns.max_tokens=60", "--set", "trainer.steps=2",
               "--set", "trainer.export_model=false", "--set", "task.heldout_prompts=2",
               "--set", "trainer.eval_samples=1", "--set", "trainer.checkpoint_every=0", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rep = json.loads((tmp_path / "run/report.json").read_text())
    lines = [line.split() for line in log.read_text().splitlines()]
    opened = [i for what, i in lines if what == "open"]
    closed = [i for what, i in lines if what == "close"]
    assert rep["environment_timeouts"] == rep["environment_errors"] == 1, rep
    assert rep["responses_truncated_by_cause"].get("trajectory_budget", 0) > 0, rep
    assert len(set(opened)) == len(opened) > 0
    assert sorted(closed) == sorted(opened), (len(opened), len(closed), set(opened) - set(closed))


def test_a_run_refused_after_the_environment_reset_its_prompts_leaves_no_process_behind(tmp_path):
    """The context check renders prompts with their ``reset(row)`` observation, which starts the environment's reset
    process; a check that then refuses the run (here: the trajectory budget exceeds the model's context) used to
    leave that process running in the caller (an in-process run, a Slurm trainer job's retry). It is stopped on the
    way out — through ``RunSetup.load``, as ``rlboost-hpc run`` calls it."""
    import psutil

    from rlboost_hpc.config import ConfigError, load_config
    from rlboost_hpc.run_setup import RunSetup

    me = psutil.Process()

    def workers() -> set[int]:
        out = set()
        for p in me.children(recursive=True):
            try:
                if "spawn_main" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    out.add(p.pid)
            except psutil.Error:
                pass
        return out

    before = workers()
    cfg = load_config(EXAMPLE / "config.toml", [f"task.data.cache_dir='{tmp_path / 'cache'}'",
                                                "task.turns.max_tokens=1000"])
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        RunSetup.load(cfg)
    assert not workers() - before
