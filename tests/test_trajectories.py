"""Multi-turn trajectories: the manager's turns and observations (pure core, injected clock), per-turn migration with
real engines (the uninterrupted trajectory, exactly), observation masks in training, and a local run with
preemptions."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.manager.state import ENV_PEER
from rlboost_hpc.protocol import messages as M

TRAINER = b"trainer"
DOT, EOS = 426, 2  # stories260K: "." (the tool-call close of these tests) and end of story
PROMPT = [1, 274, 287, 286, 296, 418]  # "Tom was sad" (BOS first)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def make(environment=True):
    core = ManagerCore(clock=Clock(), environment=environment, settings=ManagerSettings(
            pending_limit=8, heartbeat_s=0.25, heartbeat_timeout_s=2.0))
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    return core


def register(core, peer: bytes, job: str):
    core.on_message(peer, M.Register(job_id=job, attempt=0, kind="preemptible", max_batch=8))
    core.on_message(peer, M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))


def spec(n=1, max_new=6, turns=3, total=30, prompt=(1, 5, 6), seed=10):
    return M.GroupSpec(gid="s0g0", prompt_ids=list(prompt), n=n, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                       seed=seed, stop_ids=[EOS], max_turns=turns, max_trajectory_tokens=total, tool_stop_ids=[DOT])


def submit(core, *specs):
    core.outbox.clear()
    core.on_message(TRAINER, M.SubmitStep(step=0, version=0, groups=list(specs)))
    return [m for _, m in core.outbox]


def take(core, peer=None, kind=None):
    out = [(p, m) for p, m in core.outbox if (peer is None or p == peer) and (kind is None or isinstance(m, kind))]
    core.outbox.clear()
    return [m for _, m in out]


def tok(rid, offset, ids, finish=M.FINISH_NONE):
    return M.Tokens(rids=[rid], offsets=[offset], counts=[len(ids)], versions=[0], finish=[finish],
                    ids=M.pack_i32(ids), logprobs=M.pack_f32([-0.25] * len(ids)))


def started(group) -> ManagerCore:
    """A core with one instance ("a") that holds ``group``'s responses (the Assign taken off the outbox)."""
    core = make()
    register(core, b"a", "a")
    submit(core, group)
    core.tick()
    take(core)
    return core


def observe(core, rid, turn, obs, status="ok"):
    core.on_message(ENV_PEER, M.EnvResult(rid=rid, turn=turn, obs_ids=M.pack_i32(obs), status=status, tool_s=0.01))


# ------------------------------------------------------------------------------------------------ the core
def test_a_tool_call_goes_to_the_environment_and_the_next_turn_continues_from_the_observation():
    core = make()
    register(core, b"a", "a")
    submit(core, spec())
    core.tick()
    (w0,) = take(core, b"a", M.Assign)[0].works
    assert w0.prompt_ids == [1, 5, 6] and w0.prefix_ids == [] and w0.tokens_left == 6
    assert DOT in w0.stop_ids and EOS in w0.stop_ids  # the tool-call close ends a turn
    core.on_message(b"a", tok("s0g0/0", 0, [7, 8, DOT], M.FINISH_STOP))
    (call,) = take(core, ENV_PEER)
    assert call.turn == 0 and M.unpack_i32(call.turn_ids).tolist() == [7, 8, DOT]
    assert core.book.requests["s0g0/0"].state == "environment" and not core.fleet.instances["a#0"].inflight
    observe(core, "s0g0/0", 0, [90, 91])
    core.tick()
    (w1,) = take(core, b"a", M.Assign)[0].works
    # an instance only ever sees the current turn: earlier turns and the observation are its prompt
    assert w1.prompt_ids == [1, 5, 6, 7, 8, DOT, 90, 91] and w1.prefix_ids == []
    assert w1.tokens_left == 6 and w1.seed != w0.seed
    core.on_message(b"a", tok("s0g0/0", 0, [9, EOS], M.FINISH_STOP))  # offsets are relative to the turn
    (done,) = take(core, TRAINER, M.GroupDone)
    r = done.responses[0]
    assert M.unpack_i32(r.ids).tolist() == [7, 8, DOT, 90, 91, 9, EOS] and r.turns == 2
    assert M.observation_mask(r.observation_runs, 7).tolist() == [False] * 3 + [True] * 2 + [False] * 2
    assert M.unpack_f32(r.logprobs)[3:5].tolist() == [0.0, 0.0]
    assert M.expand_version_runs(r.version_runs).tolist() == [0] * 7
    assert core.counters.environment_calls == 1 and core.counters.turns_completed == 2
    assert core.counters.observation_tokens == 2


def test_budgets_per_turn_and_per_trajectory():
    core = started(spec(max_new=6, total=12))
    core.on_message(b"a", tok("s0g0/0", 0, [7, 8, 9, 10, 11, DOT], M.FINISH_STOP))
    observe(core, "s0g0/0", 0, [90, 91, 92])
    core.tick()
    (w1,) = take(core, b"a", M.Assign)[0].works
    assert w1.tokens_left == 3  # 12 − 6 − 3: the trajectory's budget bounds the turn's
    core.on_message(b"a", tok("s0g0/0", 0, [1, 2, 3, 4]))  # past it: fenced, never appended
    assert core.fleet.instances["a#0"].state == "fenced" and core.book.requests["s0g0/0"].n == 9


def test_an_observation_that_leaves_no_room_ends_the_trajectory():
    core = started(spec(max_new=6, total=10))
    core.on_message(b"a", tok("s0g0/0", 0, [7, 8, 9, 10, 11, DOT], M.FINISH_STOP))
    take(core)
    observe(core, "s0g0/0", 0, [90, 91, 92, 93])  # 6 + 4 = 10: no token left for a next turn
    (done,) = take(core, TRAINER, M.GroupDone)
    assert done.responses[0].finish_reason == "trajectory_budget" and len(done.responses[0].ids) == 24
    assert core.stats().responses_truncated_by_cause == {"trajectory_budget": 1}


@pytest.mark.parametrize("turns, total, script, reason", [
    # a single turn cut by rollout.max_new_tokens (6)
    (1, 6, [([7, 8, 9, 10, 11, 12], "length")], "length"),
    # the model's stop token: not truncated
    (3, 30, [([7, EOS], "stop")], "stop"),
    # a stop token exactly at the budget is still a stop
    (1, 6, [([7, 8, 9, 10, 11, EOS], "stop")], "stop"),
    # turn 2 of 2 ends with a tool call that is never answered: the turn cap
    (2, 30, [([7, DOT], "stop", [90]), ([8, DOT], "stop")], "turn_cap"),
    # turn 2 is cut by what the trajectory has left (12 − 6 − 2 = 4 < 6): the trajectory budget
    (3, 12, [([7, 8, 9, 10, 11, DOT], "stop", [90, 91]), ([1, 2, 3, 4], "length")], "trajectory_budget"),
    # turn 2 is cut by its own max_new_tokens while the trajectory has room: length
    (3, 30, [([7, DOT], "stop", [90]), ([1, 2, 3, 4, 5, 6], "length")], "length"),
    # a tool call that fills the trajectory exactly: no room for its answer
    (3, 6, [([7, 8, 9, 10, 11, DOT], "stop")], "trajectory_budget"),
])
def test_every_response_carries_why_it_ended(turns, total, script, reason):
    """The manager knows why a response or trajectory ended and tells the trainer (``finish_reason``): the model
    stopped, or a budget cut it — rollout.max_new_tokens (``length``), task.turns.max (``turn_cap``),
    task.turns.max_tokens (``trajectory_budget``); truncations are counted by cause."""
    core = started(spec(max_new=6, turns=turns, total=total))
    for turn, (ids, fin, *obs) in enumerate(script):
        if turn:
            core.tick()
            take(core)
        core.on_message(b"a", tok("s0g0/0", 0, ids, M.FINISH_CODES[fin]))
        if obs:
            observe(core, "s0g0/0", turn, obs[0])
    (done,) = take(core, TRAINER, M.GroupDone)
    assert done.responses[0].finish_reason == reason
    assert core.stats().responses_truncated_by_cause == ({} if reason == "stop" else {reason: 1})


def test_truncations_are_a_prometheus_counter_by_cause():
    from prometheus_client import CollectorRegistry, generate_latest

    from rlboost_hpc.observe.metrics import ManagerMetrics

    core = started(spec(n=2, max_new=6, turns=2))
    core.on_message(b"a", tok("s0g0/0", 0, [7, 8, 9, 10, 11, 12], M.FINISH_LENGTH))
    core.on_message(b"a", tok("s0g0/1", 0, [7, EOS], M.FINISH_STOP))
    metrics = ManagerMetrics("r")
    metrics.refresh(core)
    reg = CollectorRegistry()
    reg.register(metrics)
    text = generate_latest(reg).decode()
    assert 'rlboost_responses_truncated_total{cause="length",run="r"} 1.0' in text
    assert 'cause="turn_cap"' not in text  # parts that happened; no zero-filled sentinels


def test_an_environment_that_cannot_answer_ends_the_trajectory_as_an_environment_error():
    core = started(spec())
    core.on_message(b"a", tok("s0g0/0", 0, [7, DOT], M.FINISH_STOP))
    observe(core, "s0g0/0", 0, [], status="error")  # not even an error observation could be rendered
    (done,) = take(core, TRAINER, M.GroupDone)
    assert done.responses[0].finish_reason == "environment_error"


def test_the_last_turn_never_calls_the_environment():
    core = started(spec(turns=2))
    core.on_message(b"a", tok("s0g0/0", 0, [7, DOT], M.FINISH_STOP))
    observe(core, "s0g0/0", 0, [90])
    core.tick()
    take(core)
    core.on_message(b"a", tok("s0g0/0", 0, [8, DOT], M.FINISH_STOP))  # a call in turn 2 of 2: the end
    assert not [m for p, m in core.outbox if p == ENV_PEER]
    assert core.book.requests["s0g0/0"].state == "done" and core.counters.environment_calls == 1


def test_environment_results_only_from_the_environment_and_only_for_the_waiting_turn():
    core = started(spec())
    core.on_message(b"a", tok("s0g0/0", 0, [7, DOT], M.FINISH_STOP))
    take(core)
    core.on_message(b"a", M.EnvResult(rid="s0g0/0", turn=0, obs_ids=M.pack_i32([5])))  # an instance cannot
    observe(core, "s0g0/0", 3, [5])  # a stale turn
    assert core.book.requests["s0g0/0"].state == "environment" and core.book.requests["s0g0/0"].n == 2
    observe(core, "s0g0/0", 0, [5], status="timeout")
    assert core.book.requests["s0g0/0"].state == "queued" and core.counters.environment_timeouts == 1


def test_the_version_never_changes_under_a_trajectory_waiting_for_its_tool():
    core = make()
    register(core, b"a", "a")
    submit(core, spec())
    core.tick()
    core.on_message(b"a", tok("s0g0/0", 0, [7, DOT], M.FINISH_STOP))
    take(core)
    core.on_message(TRAINER, M.SetVersion(version=1))
    (err,) = take(core, TRAINER, M.Error)
    assert "unfinished" in err.error and core.lineage.latest.number == 0


def test_multi_turn_groups_need_an_environment():
    core = make(environment=False)
    (err,) = [m for m in submit(core, spec()) if isinstance(m, M.Error)]
    assert "environment" in err.error


def test_a_turn_interrupted_mid_way_resumes_elsewhere_from_its_tokens_so_far():
    core = started(spec(max_new=6))
    core.on_message(b"a", tok("s0g0/0", 0, [7, DOT], M.FINISH_STOP))
    observe(core, "s0g0/0", 0, [90])
    core.tick()
    take(core)
    core.on_message(b"a", tok("s0g0/0", 0, [11, 12]))
    register(core, b"b", "b")
    core.on_message(b"a", M.Deregister(reason="preempted", tokens_generated=0, cause="preempted"))
    core.tick()
    (w,) = take(core, b"b", M.Assign)[0].works
    assert w.prompt_ids == [1, 5, 6, 7, DOT, 90] and w.prefix_ids == [11, 12] and w.tokens_left == 4
    assert core.counters.migrations_by_turn == {"1": 1}
    assert core.counters.tokens_in_interrupted_turns == 2  # what restarting the turn would regenerate
    assert core.counters.assistant_tokens_in_interrupted_trajectories == 4  # ... restarting the trajectory


# ----------------------------------------------------------------------- per-turn migration, real engines
def _env(turn_ids: list[int]) -> list[int]:
    """A deterministic environment: the observation is a pure function of the turn's ids."""
    return [300 + sum(turn_ids) % 50, 13, 14 + len(turn_ids) % 3]


def _drive(factory, core: ManagerCore, interrupt: tuple[str, int] | None) -> dict[str, M.Response]:
    """Run one step of trajectories through ``core`` with real engines (``factory()``) behind two instances; at
    ``interrupt`` = (rid, k) the instance generating rid is preempted once the trajectory holds ≥ k tokens while
    running (its unsent tokens are lost, its work migrates, a fresh instance replaces it). Tool calls are answered
    by :func:`_env`. Returns the delivered responses by rid."""
    from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams

    engines = {b"i0": factory(), b"i1": factory()}
    for p in engines:
        register(core, p, p.decode())
    fresh = 0
    out: dict[str, M.Response] = {}
    pos: dict[str, int] = {}
    total = sum(len(g.rids) for g in core.book.groups.values())
    for _ in range(20_000):
        core.tick()
        outbox, core.outbox = core.outbox, []
        for peer, msg in outbox:
            if isinstance(msg, M.Assign) and peer in engines:
                for w in msg.works:
                    engines[peer].add(GenRequest(w.rid, list(w.prompt_ids), w.tokens_left, SamplingParams(
                        temperature=w.temperature, top_p=w.top_p, seed=w.seed, stop_token_ids=tuple(w.stop_ids)),
                        list(w.prefix_ids)))
                    pos[w.rid] = len(w.prefix_ids)
            elif peer == ENV_PEER:
                core.on_message(ENV_PEER, M.EnvResult(rid=msg.rid, turn=msg.turn, obs_ids=M.pack_i32(
                    _env(M.unpack_i32(msg.turn_ids).tolist()))))
            elif isinstance(msg, M.GroupDone):
                out.update({r.rid: r for r in msg.responses})
        if len(out) == total:
            return out
        for peer, eng in list(engines.items()):
            for ev in eng.step():
                core.on_message(peer, M.Tokens(
                    rids=[ev.rid], offsets=[pos[ev.rid]], counts=[len(ev.token_ids)], versions=[0],
                    finish=[M.FINISH_CODES[ev.finish_reason] if ev.finished else 0],
                    ids=M.pack_i32(ev.token_ids), logprobs=M.pack_f32(ev.logprobs)))
                pos[ev.rid] += len(ev.token_ids)
                req = core.book.requests[ev.rid]
                if interrupt and ev.rid == interrupt[0] and req.n >= interrupt[1] and req.state == "running":
                    interrupt = None  # preempted: what it has not sent yet is lost, its work migrates
                    core.on_message(peer, M.Deregister(reason="preempted", tokens_generated=0, cause="preempted"))
                    del engines[peer]
                    fresh += 1
                    engines[b"n%d" % fresh] = factory()
                    register(core, b"n%d" % fresh, "n%d" % fresh)
                    break
    raise AssertionError("trajectories did not finish")


@pytest.fixture(scope="module")
def stories(stories260k_hf_dir):
    from _util import load_hf_dir

    return load_hf_dir(stories260k_hf_dir)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_interrupting_any_token_of_any_turn_gives_the_uninterrupted_trajectory(stories, temperature):
    """The property: preempt the instance at any token of any turn of a trajectory, resume on another, and the
    trajectory (ids, logprobs, observations, turns) is the uninterrupted one exactly."""
    from rlboost_hpc.rollout.engines.torch_engine import TorchEngine

    cfg, sd = stories

    def factory():
        return TorchEngine(cfg, sd, max_batch=4)

    def run(interrupt):
        core = make()
        submit(core, M.GroupSpec(gid="s0g0", prompt_ids=PROMPT, n=2, max_new_tokens=20, temperature=temperature,
                                 top_p=1.0, seed=3, stop_ids=[EOS], max_turns=4, max_trajectory_tokens=70,
                                 tool_stop_ids=[DOT]))
        return _drive(factory, core, interrupt), core

    base, core0 = run(None)
    traj = base["s0g0/0"]
    n = len(traj.ids) // 4
    assert traj.turns >= 2 and core0.counters.environment_calls >= 1, "the prompt must lead to a tool call"
    obs = M.observation_mask(traj.observation_runs, n)
    points = [k for k in range(1, n) if not obs[k - 1]]  # every token an engine generated
    for k in points:
        got, core = run(("s0g0/0", k))
        for rid, want in base.items():
            g = got[rid]
            assert g.ids == want.ids and g.observation_runs == want.observation_runs and g.turns == want.turns, k
            # the ids are exact; logprobs to fp32 sums in batches of other compositions
            np.testing.assert_allclose(M.unpack_f32(g.logprobs), M.unpack_f32(want.logprobs), atol=1e-4, rtol=0)
        assert core.counters.responses_migrated >= 1


# ------------------------------------------------------------------------------------------------ training
def test_observation_tokens_carry_no_loss_and_no_logprob_comparison(stories):
    """Garbage behaviour logprobs on observation tokens change nothing; the trained tokens are the assistant's."""
    from rlboost_hpc.trainer.backends.base import Sample
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend, pack

    cfg, sd = stories
    resp = [400, 401, DOT, 90, 91, 92, 402, EOS]
    mask = [True, True, True, False, False, False, True, True]
    lps = [-1.0, -2.0, -0.5, 0.0, 0.0, 0.0, -1.5, -0.1]

    def sample(obs_lp):
        return Sample(prompt_ids=[1, 365], response_ids=resp, advantage=1.0, loss_mask=mask,
                      behaviour_logprobs=[lp if m else obs_lp for lp, m in zip(lps, mask)])

    _ids, _att, rmask, _ = pack([sample(0.0)])
    assert rmask[0].tolist() == [False] + mask
    out = []
    for obs_lp in (0.0, -1e6):
        torch.manual_seed(0)
        be = TorchBackend(cfg, sd, lr=1e-3, device=torch.device("cpu"))
        m = be.accumulate([sample(obs_lp)], 1)
        out.append((m, [p.grad.clone() for p in be.model.parameters() if p.grad is not None]))
    (m0, g0), (m1, g1) = out
    assert m0["tokens"] == 5 and m0 == m1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # and the loss is over those 5 tokens: the same sample with the observation unmasked differs
    be = TorchBackend(cfg, sd, lr=1e-3, device=torch.device("cpu"))
    full = Sample(prompt_ids=[1, 365], response_ids=resp, advantage=1.0, behaviour_logprobs=lps)
    assert be.accumulate([full], 1)["tokens"] == 8


# ------------------------------------------------------------------------------------------------ a run
@pytest.mark.integration
@pytest.mark.slow
def test_a_local_run_with_tool_calls_and_preemptions_loses_nothing(tmp_path):
    """The main job with multi-turn trajectories on stories260K (its "." is the tool-call close: the calculator
    answers with error observations, the trajectories go on), a warned preemption held until the victim holds
    partial responses: nothing lost, duplicated or off-version, every trajectory trained once, tool calls made."""
    from pathlib import Path

    from test_demo_run import diagnose, run_cli

    repo = Path(__file__).resolve().parent.parent
    trace = tmp_path / "trace.csv"  # a worker removed (warned) once it holds partial trajectories, one added
    trace.write_text("0,add,a\n0,add,b\n1000,remove,a\n1500,add,c\n")
    out = tmp_path / "run"
    p = run_cli(repo, out, "trainer.steps=3", "task.turns.max=3", "task.turns.tool_call_open=''",
                "task.turns.tool_call_close='.'", "rollout.max_new_tokens=24", "task.heldout_prompts=8",
                f"cluster.trace='{trace}'", "cluster.time_scale=1.0", "cluster.replay_s=120",
                "cluster.window_start_s=0", "cluster.max_workers=2", "cluster.min_changes=0",
                "cluster.min_removals=0", "cluster.min_starts=0", "cluster.preempt_when_busy=true", "policy.cap=false")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    why = diagnose(p, out)
    assert rep["steps"] == 3 and rep["responses_trained"] == 3 * 8 * 8, why
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, why
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0, why
    assert rep["environment_calls"] > 0 and rep["turns_per_trajectory_mean"] > 1.0, why
    assert rep["environment_errors"] + rep["environment_timeouts"] <= rep["environment_calls"], why
    assert rep["preemptions"] >= 1 and rep["responses_migrated"] >= 1, why
    assert sum(rep["migrations_by_turn"].values()) >= 1, why
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("turns_mean" in m and "environment_s" in m for m in lines)


@pytest.mark.integration
def test_a_tool_call_close_that_is_not_one_token_is_refused_naming_the_key(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo / "configs/local.toml"),
                        "--out", str(tmp_path / "r"), "--no-progress", "--set", "task.turns.max=2",
                        "--set", "task.turns.tool_call_close='<end of call>'"], capture_output=True, text=True,
                       cwd=repo, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "task.turns.tool_call_close = '<end of call>'" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_gsm8k_with_the_calculator_on_a_chat_model_renders_tool_messages(tmp_path):
    """``task.name = "gsm8k_tools"`` on the tiny Qwen3 (ChatML template): a random model does not write tool calls,
    so a token it does emit closes them (``task.turns.tool_call_close``); observations are the template's tool messages,
    appended as ids, masked out of training; preemptions lose nothing."""
    from pathlib import Path

    from _models import make_model_dir
    from test_demo_run import diagnose, run_cli

    d = make_model_dir(tmp_path / "qwen3", "qwen3", tied=False, seed=1)
    repo = Path(__file__).resolve().parent.parent
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n1000,remove,a\n1500,add,c\n")
    out = tmp_path / "run"
    p = run_cli(repo, out, f"model.path='{d}'", "task.name=gsm8k_tools", "task.turns.max=3",
                "task.turns.tool_call_close='Ġthe'", "trainer.steps=2", "task.train_prompts=16",
                "task.heldout_prompts=2",
                "trainer.eval_samples=1", "rollout.prompts_per_step=16", "rollout.max_new_tokens=32",
                "weights.dtype=float32", f"cluster.trace='{trace}'", "cluster.time_scale=1.0", "cluster.replay_s=120",
                "cluster.window_start_s=0", "cluster.max_workers=2", "cluster.min_changes=0", "cluster.min_removals=0",
                "cluster.min_starts=0", "cluster.preempt_when_busy=true", "policy.cap=false")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    why = diagnose(p, out)
    assert rep["model"]["chat_template"] is True and rep["steps"] == 2, why
    assert rep["responses_trained"] == 2 * 16 * 8 and rep["responses_lost"] == 0, why
    assert rep["responses_duplicated"] == 0 and rep["tokens_trained_off_version"] == 0, why
    assert rep["environment_calls"] > 0 and rep["turns_per_trajectory_mean"] > 1.0, why
    assert rep["observation_tokens"] >= 10 * rep["environment_calls"], why  # a ChatML tool message: ≥ 10 tokens
    assert rep["preemptions_with_warning"] >= 1 and rep["responses_migrated"] >= 1, why


def test_held_out_evaluation_plays_trajectories_with_the_tool(stories, stories260k_hf_dir):
    """Evaluation of a multi-turn task calls the tool like the rollouts do: trajectories with observations (masked
    out of the KL samples), the reward on the final turn, the same draws on a second evaluation."""
    from rlboost_hpc.models.hf_dir import PolicyTokenizer
    from rlboost_hpc.tasks.base import get_task
    from rlboost_hpc.tasks.tools import ToolCalls, ToolEnvironment, ToolSyntax
    from rlboost_hpc.trainer.eval import TurnSettings, evaluate

    cfg, sd = stories
    tok = PolicyTokenizer.from_dir(stories260k_hf_dir, cfg)
    task = get_task("stories", n_heldout=3)
    with_tools = ToolCalls(ToolEnvironment(str(stories260k_hf_dir), use_chat=False, syntax=ToolSyntax("", ".")))
    try:
        turns = TurnSettings(max_turns=3, max_trajectory_tokens=80, tool_stop_ids=(DOT,), tools=with_tools)
        kw = dict(samples=2, max_new_tokens=24, temperature=1.0, top_p=1.0, turns=turns)
        a, b = evaluate(cfg, sd, tok, task, **kw), evaluate(cfg, sd, tok, task, **kw)
    finally:
        with_tools.close()
    masked = [s for s in a["sampled"] if s.loss_mask is not None]
    assert masked and all(len(s.loss_mask) == len(s.response_ids) <= 80 for s in masked)
    assert any(not m for s in masked for m in s.loss_mask)
    assert a["reward_sampled"] == b["reward_sampled"] and [s.response_ids for s in a["sampled"]] == \
        [s.response_ids for s in b["sampled"]]
