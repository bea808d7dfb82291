"""Tools of multi-turn rollouts: the calculator (a safe evaluator, never eval), the tool-call syntax, observations
rendered as token ids, and tool calls under a deadline in the manager's process (a hung tool never hangs a
trajectory)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.service import ManagerService
from rlboost_hpc.manager.state import ENV_PEER
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.tasks.pool import CallStatus, DeadlinePool
from rlboost_hpc.tasks.tools import ToolCalls, ToolEnvironment, ToolError, ToolSyntax, calculate, parse_tool_call


@pytest.mark.parametrize("expr, value", [("2+3*4", "14"), ("(48/2)", "24"), ("1,000 * 3 =", "3000"),
                                         ("7/3", "2.333333333"), ("2**10", "1024"), ("-5 % 3", "1")])
def test_the_calculator_evaluates_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('touch /tmp/pwned')", "().__class__.__bases__", "open('x')",
                                  "x + 1", "1/0", "", "9" * 300, "'a' * 10", "9**99999", "[1, 2]", "1 < 2"])
def test_anything_but_arithmetic_is_a_tool_error_never_code(expr):
    with pytest.raises(ToolError):
        calculate(expr)


def test_tool_call_syntax_json_bare_and_malformed():
    s = ToolSyntax("<tool_call>", "</tool_call>")
    text = 'I add. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert parse_tool_call(text, s) == ("calculator", {"expression": "2+2"})
    assert parse_tool_call("so <tool_call> 3*4 </tool_call>", s) == ("calculator", {"expression": "3*4"})
    assert parse_tool_call("Tom had 3 apples.", ToolSyntax("", ".")) == ("calculator", {"expression": "Tom had 3 apples"})
    for bad in ['<tool_call>{"name": 3}</tool_call>', "<tool_call>{oops</tool_call>", "no call here</tool_call>",
                "<tool_call>  </tool_call>"]:
        with pytest.raises(ToolError):
            parse_tool_call(bad, s)


@pytest.mark.parametrize("payload", [
    '{"name": "calculator", "arguments": {"expression": "6*7"}}',  # Hermes / Qwen: an object
    '{"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"}',  # OpenAI: a JSON string
    '{"name": "calculator", "parameters": {"expression": "6*7"}}',  # Llama 3.x
    '{"type": "function", "function": {"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"}}',
    '{"name": "calculator", "arguments": {"expression": 42}}',  # a number as the value
    '{"name": "calculator", "arguments": "{\\"expression\\": 42}"}',  # a number inside the JSON string
    ' 6*7 ',  # a bare expression
    '[{"name": "calculator", "arguments": {"expression": "6*7"}}]',  # Mistral: a list of one call (issue 50)
    '[{"name": "calculator", "arguments": {"expression": "6*7"}, "id": "Ab3xYz9Qp"}]',  # ... with its call id
])
def test_every_tool_call_shape_a_model_emits_gets_its_result(payload):
    """vLLM PR #22002 / smolagents PR #1003: valid calls in the OpenAI form (``arguments`` a JSON string), with
    ``parameters`` (Llama), the OpenAI ``tool_calls`` element, or a number as the value are answered, not penalised."""
    from rlboost_hpc.tasks.tools import calculator_expression

    name, args = parse_tool_call(f"<tool_call>{payload}</tool_call>", ToolSyntax())
    assert name == "calculator" and calculate(calculator_expression(args)) == "42"


@pytest.mark.parametrize("payload, why", [
    ('{"name": "calculator", "arguments": "{\\"expression\\": "}', "malformed arguments JSON"),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be an object or a JSON string"),
    ('{"name": "calculator", "arguments": "[1, 2]"}', "must be an object or a JSON string"),
    ('[{"name": "calculator", "arguments": {}}, {"name": "calculator", "arguments": {}}]', "one tool call per turn"),
    ('[]', "one tool call per turn, got a list of 0"),
    ('[6]', '"name": str'),
    ('{"name": "calculator", "arguments": {}, "parameters": {}}', "not both"),
    ('{"arguments": {"expression": "1"}}', '"name": str'),
])
def test_malformed_calls_are_refused_saying_why(payload, why):
    with pytest.raises(ToolError, match=why):
        parse_tool_call(f"<tool_call>{payload}</tool_call>", ToolSyntax())


@pytest.mark.parametrize("args, why", [({}, "is missing"), ({"expression": True}, "is a bool"),
                                       ({"expression": [1]}, "is a list"), ({"expression": None}, "is missing")])
def test_the_calculator_names_a_wrong_argument(args, why):
    from rlboost_hpc.tasks.tools import calculator_expression

    with pytest.raises(ToolError, match=why):
        calculator_expression(args)
    assert calculator_expression({"expression": 2.5}) == "2.5" and calculate(calculator_expression({"expression": -3}))


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    from _models import train_tokenizer

    d = tmp_path_factory.mktemp("chatml")
    tok = train_tokenizer(bos=False)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.save_pretrained(d)
    return d


def test_observations_are_the_chat_templates_tool_message_as_ids(chatml_dir):
    """With a chat template the observation is the template's rendering after the assistant's turn: its end-of-turn
    marker, the tool message, the next assistant header — appended as ids, nothing generated re-tokenised."""
    env = ToolEnvironment(str(chatml_dir), use_chat=True)
    env.setup()
    hf = env._hf
    turn = hf('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
              add_special_tokens=False)["input_ids"]
    out = env(("step", turn))
    assert not out.error and out.text == "42"
    assert hf.decode(out.obs_ids) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    bad = env(("step", hf("<tool_call>6 *</tool_call>", add_special_tokens=False)["input_ids"]))
    assert bad.error and "not an arithmetic expression" in hf.decode(bad.obs_ids)
    assert "ran past" in hf.decode(env(("error", "the tool call ran past its 5 s deadline")).obs_ids)
    long = ToolEnvironment(str(chatml_dir), use_chat=True, max_observation_tokens=4)
    long.setup()
    text = long._hf.decode(long(("step", long._hf("<tool_call>99**60</tool_call>")["input_ids"])).obs_ids)
    assert text.startswith("<|im_end|>\n<|im_start|>tool\n") and text.endswith("<|im_start|>assistant\n")


def test_plain_observations_without_a_template(stories260k_hf_dir):
    env = ToolEnvironment(str(stories260k_hf_dir), use_chat=False, syntax=ToolSyntax("", "."))
    env.setup()
    out = env(("step", env._hf("2 + 3.", add_special_tokens=False)["input_ids"]))
    assert out.text == "5" and env._hf.decode(out.obs_ids).strip() == "Result: 5"


class HangingEnvironment(ToolEnvironment):
    """A tool that never returns when the turn holds token 999 (a runaway tool), else the calculator."""

    def __call__(self, item):
        if item[0] == "step" and 999 in item[1]:
            time.sleep(600)
        return super().__call__(item)


def test_a_hung_tool_call_times_out_into_an_error_observation_and_the_trajectory_goes_on(stories260k_hf_dir):
    """The manager's service runs tool calls in its deadline pool: a hung call's worker is killed and replaced, the
    trajectory continues from an error observation (counted as a timeout); a good call in parallel is unaffected."""
    env = HangingEnvironment(str(stories260k_hf_dir), use_chat=False, syntax=ToolSyntax("", "."))
    core = ManagerCore(clock=time.monotonic, environment=True)
    svc = ManagerService(core, environment=ToolCalls(env, workers=2, timeout_s=1.0))
    try:
        core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
        core.on_message(b"t", M.SetVersion(version=0))
        core.on_message(b"a", M.Register(job_id="a", attempt=0, kind="preemptible", max_batch=8))
        core.on_message(b"a", M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
        core.on_message(b"t", M.SubmitStep(step=0, version=0, groups=[M.GroupSpec(
            gid="g", prompt_ids=[1], n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0, stop_ids=[2],
            max_turns=2, max_trajectory_tokens=60, tool_stop_ids=[426])]))
        core.tick()
        env.setup()  # this process's copy (the pool's workers load their own)
        two = env._hf("2 + 3.", add_special_tokens=False)["input_ids"]
        for rid, ids in (("g/0", [999, 426]), ("g/1", two)):
            core.on_message(b"a", M.Tokens(rids=[rid], offsets=[0], counts=[len(ids)], versions=[0], finish=[1],
                                           ids=M.pack_i32(ids), logprobs=M.pack_f32([-1.0] * len(ids))))
        core.outbox = [(p, m) for p, m in core.outbox if p == ENV_PEER]
        svc._flush()  # the two EnvCalls go to the pool
        t0 = time.monotonic()
        while svc.env.pending and time.monotonic() - t0 < 60:
            svc._environment()
            time.sleep(0.01)
        good, hung = core.book.requests["g/1"], core.book.requests["g/0"]
        assert good.state == hung.state == "queued" and good.turn == hung.turn == 1
        obs = lambda r: env._hf.decode(M.unpack_i32(bytes(r.ids[4 * r.observations[0]:4 * r.turn_start])).tolist())
        assert "Result: 5" in obs(good) and "ran past its 1 s deadline" in obs(hung)
        assert core.counters.environment_timeouts == 1 and svc.env.pool.replaced == 1
        assert core.counters.environment_seconds >= 1.0
    finally:
        svc.close()


class Flaky:
    """Raises on "boom", dies on "die", answers otherwise."""

    def __call__(self, item):
        if item == "boom":
            raise ValueError("bad input")
        if item == "die":
            import os

            os._exit(3)
        return item.upper()


def test_the_deadline_pool_completes_every_call_once():
    with DeadlinePool(Flaky(), workers=2, timeout_s=5.0) as pool:
        done = pool.run_all(["a", "boom", "die", "b"])
        assert [c.status for c in done] == [CallStatus.OK, CallStatus.FAILED, CallStatus.FAILED, CallStatus.OK]
        assert done[0].value == "A" and "ValueError: bad input" in done[1].error and "twice" in done[2].error
        assert pool.replaced == 2 and pool.pending == 0
        pool.submit("k", "x")
        with pytest.raises(ValueError):
            pool.submit("k", "y")


class WhoAmI:
    def __call__(self, item):
        import os

        if item == "die":
            os._exit(3)
        return os.getpid()


def test_calls_bound_to_a_worker_position_run_there_and_a_replaced_worker_counts_a_generation():
    """Issue 48 (stateful environments): a call may name its worker position; a worker that dies is replaced in
    place and its position's generation tells the caller that the state it held is gone."""
    with DeadlinePool(WhoAmI(), workers=2, timeout_s=5.0) as pool:
        for i in range(6):
            pool.submit(i, "x", slot=i % 2)
        done: dict = {}
        while len(done) < 6:
            done.update((c.key, c.value) for c in pool.poll(1.0))
        assert {done[0], done[2], done[4]} == {pool._slots[0].proc.pid}
        assert {done[1], done[3], done[5]} == {pool._slots[1].proc.pid}
        assert [pool.generation(0), pool.generation(1)] == [0, 0]
        pool.submit("d", "die", slot=1)
        while not pool.poll(1.0):
            pass
        assert [pool.generation(0), pool.generation(1)] == [0, 2]  # (it died, and again on its re-run)
        with pytest.raises(ValueError, match="slot 2"):
            pool.submit("e", "x", slot=2)


class BrokenSetup:
    def setup(self):
        raise OSError("no tokenizer here")

    def __call__(self, item):
        return item


def test_a_handler_whose_setup_always_fails_is_an_error_not_an_endless_respawn():
    pool = DeadlinePool(BrokenSetup(), workers=1, timeout_s=1.0)
    try:
        pool.submit("k", "x")
        with pytest.raises(RuntimeError, match="died during their handler's setup"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                pool.poll(0.5)
    finally:
        pool.close()


class Holds:
    """Holds a resource per call; ``teardown()`` writes what it held to ``log`` (one line per worker)."""

    def __init__(self, log: str, hang_teardown: bool = False) -> None:
        self.log, self.hang_teardown, self.held = log, hang_teardown, []

    def __call__(self, item):
        self.held.append(item)
        if item == "stall":
            time.sleep(120)
        return item

    def teardown(self):
        import os

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {' '.join(self.held)}\n")
        if self.hang_teardown:
            time.sleep(120)


def test_a_worker_stopped_at_a_deadline_or_by_close_tears_down_what_it_holds_within_its_grace(tmp_path):
    """Issue 57 item 5: with ``grace_s`` a worker past its deadline is stopped (SIGTERM interrupts the call, its
    handler's ``teardown()`` runs) and replaced at once; ``close`` tears every worker down; a teardown that hangs is
    killed when its grace is over."""
    log = tmp_path / "teardown.log"
    with DeadlinePool(Holds(str(log)), workers=1, timeout_s=1.0, grace_s=5.0) as pool:
        for key in ("a", "stall", "b"):
            pool.submit(key, key)
        done: dict = {}
        while len(done) < 3:
            done.update((c.key, c.status) for c in pool.poll(1.0))
        assert done == {"a": CallStatus.OK, "stall": CallStatus.TIMEOUT, "b": CallStatus.OK}
        assert pool.replaced == 1
        for _ in range(600):  # the stopped worker tears down beside its replacement
            if log.exists():
                break
            pool.poll(0.05)
        assert log.read_text().split()[1:] == ["a", "stall"]
    assert [line.split()[1:] for line in log.read_text().splitlines()] == [["a", "stall"], ["b"]]
    stuck = DeadlinePool(Holds(str(tmp_path / "stuck.log"), hang_teardown=True), workers=2, timeout_s=1.0,
                         grace_s=1.0)
    stuck.run_all(["c"])
    t0 = time.monotonic()
    stuck.close()  # (both workers' teardowns hang: killed after their grace, together)
    assert time.monotonic() - t0 < 30 and " c\n" in (tmp_path / "stuck.log").read_text()


def test_a_worker_whose_parent_dies_tears_down_what_it_holds(tmp_path):
    """Issue 57 item 5: a manager SIGKILLed leaves its tool processes an EOF; they close what they hold and exit."""
    import os
    import signal
    import subprocess
    import sys

    log = tmp_path / "teardown.log"
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_tools import Holds; "
            "from rlboost_hpc.tasks.pool import DeadlinePool; "
            f"p = DeadlinePool(Holds({str(log)!r}), workers=1, timeout_s=5.0, grace_s=5.0); p.run_all(['e']); "
            "print('ready', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parent.parent)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for _ in range(600):
            if log.exists() and log.read_text().endswith("\n"):
                break
            time.sleep(0.05)
        assert log.read_text().split()[1:] == ["e"]
    finally:
        proc.kill()
