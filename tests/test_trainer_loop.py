"""The RL step against a scripted manager (pure, no sockets): the trainer's own on-policy check."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from rlboost_hpc.policy.controller import RolloutController
from rlboost_hpc.policy.seeding import SeedingWindow
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import ManagerStats, StepActivity
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.tasks.base import Scored, get_task
from rlboost_hpc.trainer.publisher import Published
from rlboost_hpc.trainer.loop import RLTrainer, RolloutFailed, StepSettings


class ScriptedManager:
    """Answers the trainer's calls; delivers every submitted group at once, stamping the tokens of one response
    with ``bad_version`` in its last ``bad_tokens`` tokens (an engine that stamped a wrong version)."""

    def __init__(self, bad_version: int | None = None, bad_tokens: int = 0,
                 reasons: tuple[str, ...] = ("length",)) -> None:
        self.events: list = []
        self.bad_version, self.bad_tokens = bad_version, bad_tokens
        self.reasons = reasons  # finish_reason of response i: reasons[i % len(reasons)]

    def call(self, msg, timeout_s=None):
        if isinstance(msg, M.SubmitStep):
            for g in msg.groups:
                rs = []
                for i in range(g.n):
                    n = 4
                    runs = [msg.version, n]
                    if self.bad_version is not None and i == 0 and g.gid.endswith("g0"):
                        runs = [msg.version, n - self.bad_tokens, self.bad_version, self.bad_tokens]
                    rs.append(M.Response(rid=f"{g.gid}/{i}", sample=i, ids=M.pack_i32([5, 6, 7, 8]),
                                         logprobs=M.pack_f32([-1.0] * n), version_runs=np.array(runs, "<i4").tobytes(),
                                         finish_reason=self.reasons[i % len(self.reasons)], migrations=0,
                                         instances=["x#0"]))
                self.events.append(M.GroupDone(step=msg.step, gid=g.gid, responses=rs))
        return M.Ok(what=type(msg).__name__)

    def next_event(self, timeout_s):
        return self.events.pop(0) if self.events else None

    def arrived_events(self):
        out, self.events = self.events, []
        return out

    def send(self, msg):
        pass

    def stats(self):
        return ManagerStats(last_step_activity=StepActivity(instance_s={"busy": 0.0, "idle": 0.0, "pulling": 0.0}))


class CountingBackend:
    def __init__(self) -> None:
        self.trained = 0
        self.samples = []

    def accumulate(self, batch, responses_in_step):
        self.trained += len(batch)
        self.samples += batch
        return {"loss": 0.0, "tokens": sum(len(s.response_ids) for s in batch)}

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 0.0}


def _trainer(manager, **settings) -> RLTrainer:
    tok = SimpleNamespace(use_chat=False, stop_ids=(1, 2), encode_text=lambda t: [1, 3, 4], decode=lambda ids: "x")
    s = StepSettings(**{"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0,
                        "top_p": 1.0, "micro_batch": 4, **settings})
    fixed = RolloutController(n_resv=1.0, seeding=SeedingWindow(initial_s=0.0, adapt=False))  # T_seed = 0
    return RLTrainer(client=manager, backend=CountingBackend(), task=get_task("stories"), tokenizer=tok, settings=s,
                     publish=lambda v: Published(VersionId(v), 0.0, 0.0, 0, 0), controller=fixed)


def test_tokens_stamped_with_another_version_are_counted_by_the_trainer():
    """The trainer checks the versions the engines stamped (carried in GroupDone), independently of the manager:
    a response whose last two tokens carry version 7 counts 2 tokens trained off-version."""
    clean = _trainer(ScriptedManager())
    rec = clean.run_step(0)
    m = rec.line()
    assert clean.totals.tokens_trained_off_version == 0 and clean.totals.responses_trained == 8
    # the metrics.jsonl line: every field of the typed record (the run's own once it set them), then the backend's
    assert json.loads(json.dumps(m)) == m and "backend" not in m and "t_s" not in m
    assert {"t_seed_next_s", "n_prem_cap", "fallback_s", "truncated_share", "phase_s"} <= set(m)
    assert set(rec.backend) <= set(m) and all(m[k] == v for k, v in rec.backend.items())
    assert abs(sum(m["phase_s"].values()) - m["wall_s"]) < 1e-9 and {"submit", "train"} <= set(m["phase_s"])
    compute = m["phase_s"]["train"] + m["phase_s"].get("optimizer", 0.0)
    assert abs(m["fixed_overhead_s"] - (m["wall_s"] - compute)) < 1e-9  # no engine generated: all but compute
    bad = _trainer(ScriptedManager(bad_version=7, bad_tokens=2))
    bad.run_step(0)
    assert bad.totals.tokens_trained_off_version == 2


def test_a_group_delivered_twice_is_trained_once_and_acknowledged_again():
    """After a lost connection the manager delivers unacknowledged groups again: the loop skips a copy of a group
    it already took (and one of an earlier step), acknowledging it, and never counts it as a duplicate."""
    mgr = ScriptedManager()
    t = _trainer(mgr)
    orig = mgr.call

    def call(msg, timeout_s=None):
        out = orig(msg, timeout_s)
        if isinstance(msg, M.SubmitStep):
            mgr.events.insert(1, mgr.events[0])  # the first group arrives twice
            mgr.events.insert(0, M.GroupDone(step=msg.step - 1, gid="s-1g0", responses=[]))  # an old step's
        return out

    mgr.call = call
    acks = []
    mgr.send = lambda m: acks.append(m.gid) if isinstance(m, M.AckGroup) else None
    t.run_step(0)
    assert t.totals.responses_trained == 8 and t.totals.responses_duplicated == 0
    assert t.totals.groups_redelivered == 2 and sorted(acks) == ["s-1g0", "s0g0", "s0g0", "s0g1"]


def test_why_each_response_ended_reaches_the_trainer_and_its_metrics():
    """finish_reason travels with every response into its Sample; the step's truncated share by cause is in its
    metrics and the run's totals; an unknown reason fails the step (never trained as if it had stopped)."""
    t = _trainer(ScriptedManager(reasons=("stop", "length", "turn_cap", "stop")))
    m = t.run_step(0).line()
    got = [smp.finish_reason for smp in t.backend.samples]
    assert got == ["stop", "length", "turn_cap", "stop"] * 2
    assert [smp.truncated for smp in t.backend.samples[:4]] == [False, True, True, False]
    assert m["truncated_share"] == 0.5
    assert m["truncated_share_by_cause"] == {"length": 0.25, "turn_cap": 0.25, "trajectory_budget": 0.0,
                                             "environment_error": 0.0}
    assert t.totals.responses_truncated_by_cause == {"length": 2, "turn_cap": 2}
    bad = _trainer(ScriptedManager(reasons=("abort",)))
    with pytest.raises(RolloutFailed, match="unknown reason 'abort'"):
        bad.run_step(0)


def test_advantages_follow_the_std_option():
    """Rewards 1, 0, 0, 0 and 1, 1, 0, 0 in the step's two groups: GRPO divides the centred rewards by the group's
    std; with advantage_std_norm off (Dr. GRPO) the advantages are the centred rewards."""
    for norm, want in ((True, [1.7320508, -0.5773503, -0.5773503, -0.5773503, 1.0, 1.0, -1.0, -1.0]),
                       (False, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])):
        t = _trainer(ScriptedManager(), advantage_std_norm=norm)
        rewards = iter([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
        t.score = lambda items, *_, **__: Scored([next(rewards) for _ in items], {})
        t.run_step(0)
        assert [smp.advantage for smp in t.backend.samples] == pytest.approx(want, abs=1e-5)


class TimedManager(ScriptedManager):
    """The scripted manager on an injected clock: group i of a step arrives ``arrive_s[i]`` seconds after its
    submission; waiting for an event advances the clock (no sleeping). Records when seeding was closed."""

    def __init__(self, arrive_s: list[float]) -> None:
        super().__init__()
        self.now, self.arrive_s, self.due, self.closed_at = 0.0, arrive_s, [], []

    def clock(self) -> float:
        return self.now

    def call(self, msg, timeout_s=None):
        out = super().call(msg, timeout_s)
        if isinstance(msg, M.SubmitStep):
            self.due = [(self.now + a, ev) for a, ev in zip(self.arrive_s, self.events)]
            self.events = []
        elif isinstance(msg, M.CloseSeeding):
            self.closed_at.append(self.now)
        return out

    def next_event(self, timeout_s):
        if not self.due:
            self.now += timeout_s
            return None
        at, ev = self.due[0]
        if at > self.now + timeout_s:
            self.now += timeout_s
            return None
        self.now = max(self.now, at)
        return self.due.pop(0)[1]

    def arrived_events(self):
        out = [ev for at, ev in self.due if at <= self.now]
        self.due = self.due[len(out):]
        return out


def _timed_trainer(mgr: TimedManager, t_seed: float, **settings) -> RLTrainer:
    t = _trainer(mgr, **settings)
    t.clock = mgr.clock
    t.controller = RolloutController(n_resv=1.0, seeding=SeedingWindow(initial_s=t_seed, adapt=False, floor_s=0.0))
    return t


def test_seeding_lasts_until_a_micro_batch_is_ready_then_closes():
    """Issue 55: past T_seed with nothing to train, the reserved engines go on generating (seed_until_trainable):
    groups of 4 responses arrive at 1 s and 3 s with m_b = 8 and T_seed = 0.5 s, so seeding closes at 3 s, when the
    first pass can start; without it, at T_seed (the trainer then waited)."""
    for until, closed in ((True, 3.0), (False, 0.5)):
        mgr = TimedManager([1.0, 3.0])
        t = _timed_trainer(mgr, 0.5, micro_batch=8, seed_until_trainable=until)
        rec = t.run_step(0)
        assert mgr.closed_at == [pytest.approx(closed)] and rec.t_seed_s == pytest.approx(closed)
        assert t.totals.responses_trained == 8


def test_a_pass_takes_every_ready_response_up_to_micro_batch_max():
    """Issue 55: responses that arrive together train as one pass (throughput), a trickle in passes of m_b."""
    for most, arrive, passes in ((8, [1.0, 1.0], [8]), (0, [1.0, 1.0], [4, 4]), (8, [1.0, 2.0], [4, 4]),
                                 (6, [1.0, 1.0], [6, 2])):
        mgr = TimedManager(arrive)
        t = _timed_trainer(mgr, 0.0, micro_batch=4, micro_batch_max=most)
        sizes = []
        acc = t.backend.accumulate
        t.backend.accumulate = lambda batch, n: sizes.append(len(batch)) or acc(batch, n)
        t.run_step(0)
        assert sizes == passes, (most, arrive)
