"""Unit tests of the rollout agent's engine hand-off logic (no manager process: a socket stand-in records frames)."""
from __future__ import annotations

import threading
import time

import pytest

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.rollout.agent import RolloutAgent
from rlboost_hpc.rollout.agent_responses import ResponseTokens
from rlboost_hpc.weights.source import PulledVersion
from rlboost_hpc.rollout.engines.base import Engine, EngineError, RequestError, TokenEvent


class _Frames:
    """Stands in for ManagerLink: records what the agent sends; counts wake-ups (a finished pull wakes the agent)."""

    def __init__(self) -> None:
        self.msgs: list = []
        self.wakes = 0

    def send(self, frame: bytes) -> None:
        self.msgs.append(M.decode(frame))

    def wake(self) -> None:
        self.wakes += 1


class _HoldingEngine(Engine):
    """Like the SGLang engine: tokens produced since the last step are only returned by abort()."""

    def __init__(self) -> None:
        self.max_batch, self.version, self.held, self.closed = 4, 0, {}, False

    def add(self, req):
        self.held[req.rid] = []

    def step(self):
        return []

    def abort(self, rid):
        ids = self.held.pop(rid, None)
        return TokenEvent(rid=rid, token_ids=ids, logprobs=[-0.5] * len(ids)) if ids else None

    def load_weights(self, state_dict, version):
        self.version = version

    def close(self):
        self.closed = True

    @property
    def num_active(self):
        return len(self.held)


class _Weights:
    """A weight source over ``fn(version, peers)`` (the agent's ``WeightSource`` protocol)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def pull(self, endpoint, version, *, peers=(), keys=None, shards="", checksum=0, adapter=None):
        return self.fn(version, tuple(peers))


def _agent(**kw) -> RolloutAgent:
    a = RolloutAgent("tcp://127.0.0.1:1", "job", 0, **kw)
    a.link = _Frames()
    return a


def test_release_forwards_tokens_the_engine_still_held_before_handing_off():
    a = _agent()
    a.engine = eng = _HoldingEngine()
    a.responses._pos = {"g/0": 3, "g/1": 0}
    eng.held = {"g/0": [7, 8], "g/1": []}
    a.responses.release(["g/0", "g/1"])
    tok, rel = a.link.msgs
    assert isinstance(tok, M.Tokens) and tok.rids == ["g/0"] and tok.offsets == [3] and tok.counts == [2]
    assert M.unpack_i32(tok.ids).tolist() == [7, 8] and tok.finish == [M.FINISH_NONE]
    assert isinstance(rel, M.Released) and rel.rids == ["g/0", "g/1"]
    assert a.tokens_handed_off == 5 and a.tokens_generated == 2


def test_no_heartbeat_follows_the_deregister():
    """Regression (issue 28): the link's I/O thread kept heartbeating after the drain's Deregister, and the manager
    logged a WARNING (and sent a Reject) for a heartbeat from an unregistered peer as every worker left."""
    a = _agent()
    a.link.heartbeat_s = 0.5
    a.engine = _HoldingEngine()
    a._drain("preempted")
    assert isinstance(a.link.msgs[-1], M.Deregister) and a.link.heartbeat_s is None


def test_first_engine_is_built_on_the_builder_thread_not_the_heartbeat_loop():
    built_on: list[str] = []
    gate = threading.Event()

    def slow_factory(model_config, sd, arch=None):
        built_on.append(threading.current_thread().name)
        gate.wait(5)  # an SGLang server start: the agent loop must keep running meanwhile
        return _HoldingEngine()

    a = _agent(engine_factory=slow_factory, weights=_Weights(lambda v, peers: PulledVersion({}, nbytes=1)))
    a._handle(M.Welcome(instance="job#0", latest_version=2, weights_endpoint="tcp://w", model_config={},
                        heartbeat_s=0.25, stream_every_tokens=4, stream_every_s=0.05))
    a.weight_slot.step()  # starts pull + build
    deadline = time.monotonic() + 5
    while not built_on and time.monotonic() < deadline:
        a.weight_slot.step()  # returns at once while the build runs
    assert built_on and built_on[0] != threading.current_thread().name and a.engine is None
    gate.set()
    while a.engine is None and time.monotonic() < deadline:
        a.weight_slot.step()
        time.sleep(0.01)
    assert a.engine is not None and a.engine.version == 2
    loaded = [m for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    assert [m.version for m in loaded] == [2] and a.link.wakes >= 1


def test_engine_start_failure_is_reported_as_a_failed_pull():
    def broken(model_config, sd, arch=None):
        raise RuntimeError("sglang: address already in use")

    a = _agent(engine_factory=broken, weights=_Weights(lambda v, peers: PulledVersion({})))
    a._handle(M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w", model_config={},
                        heartbeat_s=0.25, stream_every_tokens=4, stream_every_s=0.05))
    deadline = time.monotonic() + 5
    while not any(isinstance(m, M.WeightsFailed) for m in a.link.msgs) and time.monotonic() < deadline:
        a.weight_slot.step()
        time.sleep(0.01)
    (f,) = [m for m in a.link.msgs if isinstance(m, M.WeightsFailed)]
    assert "engine start failed: RuntimeError: sglang: address already in use" in f.error and a.engine is None


def test_a_new_version_announced_during_a_pull_is_pulled_next_and_relay_sources_are_used():
    calls: list[tuple[int, tuple]] = []
    gate = threading.Event()

    def source(version, peers):
        calls.append((version, tuple(peers)))
        if version == 1:
            gate.wait(5)  # a slow pull of version 1 ...
        return PulledVersion({}, checksum=10 + version, nbytes=1)

    a = _agent(weights=_Weights(source), relay_wait_s=60.0)
    a.engine = _HoldingEngine()
    a._handle(M.Welcome(instance="job#0", latest_version=1, weights_endpoint="tcp://w", model_config={},
                        heartbeat_s=1.0, stream_every_tokens=4, stream_every_s=0.05, epoch=0, peers=["tcp://peer"]))
    a.engine_epoch = 0
    a.weight_slot.step()  # starts pulling version 1 from the peer
    a._handle(M.NewVersion(version=2, wait=True))  # ... while version 2 is published: no capacity yet
    gate.set()
    deadline = time.monotonic() + 5
    while a.engine.version != 1 and time.monotonic() < deadline:
        a.weight_slot.step()
        time.sleep(0.01)
    a.weight_slot.step()
    assert a.weight_slot.want.number == 2 and a.weight_slot._pull is None  # not lost; it waits for relay capacity
    a._handle(M.PullFrom(version=2, peers=["tcp://other"]))
    while a.engine.version != 2 and time.monotonic() < deadline:
        a.weight_slot.step()
        time.sleep(0.01)
    assert calls == [(1, ("tcp://peer",)), (2, ("tcp://other",))]
    loaded = [m for m in a.link.msgs if isinstance(m, M.WeightsLoaded)]
    assert [(m.version, m.checksum) for m in loaded] == [(1, 11), (2, 12)]


def test_a_finished_pull_wakes_the_agent_instead_of_waiting_out_its_idle_poll():
    """Regression (step timeline): the agent noticed a finished weight pull only after its 20 ms idle wait on the
    link, so the reserved engine started each step ~10 ms late. ``wake`` ends the current or the next wait."""
    import zmq

    from rlboost_hpc.rollout.manager_link import ManagerLink

    ctx = zmq.Context()
    link = ManagerLink(ctx, "tcp://127.0.0.1:9", None, b"wake-test", lambda: b"")
    try:
        link.wake()  # before the wait: not lost
        t0 = time.monotonic()
        assert link.take(5.0) == [] and time.monotonic() - t0 < 1.0
        threading.Timer(0.05, link.wake).start()  # during the wait
        t0 = time.monotonic()
        link.take(5.0)
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        link.take(0.1)  # consumed: the next take waits again
        assert time.monotonic() - t0 >= 0.09
    finally:
        link.close()
        ctx.term()


class _LinkStandIn(_Frames):
    """ManagerLink as run() makes it: nothing arrives, the manager counts as heard from just now."""

    def __init__(self, *args, **kw) -> None:
        super().__init__()
        self.last_rx = time.monotonic()

    def take(self, wait_s: float = 0.0) -> list[bytes]:
        self.last_rx = time.monotonic()
        return []

    def close(self) -> None:
        pass


class _FailingEngine(_HoldingEngine):
    """step() 1: tokens of r1 and r2; step() 2: r1's stream fails alone (the engine drops it); step() 3: r2 gets a
    token; step() 4: the whole engine fails (its server died)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def step(self):
        self.calls += 1
        if self.calls == 1:
            return [TokenEvent("r1", [5, 6], [-0.1, -0.2]), TokenEvent("r2", [7], [-0.3])]
        if self.calls == 2:
            self.held.pop("r1")
            raise RequestError("r1", "sglang request 'r1' failed after 2 token(s): inconsistent chunk")
        if self.calls == 3:
            return [TokenEvent("r2", [8], [-0.4])]
        raise EngineError("sglang server exited with code -9")


def test_a_request_the_engine_drops_is_handed_back_and_a_broken_engine_ends_the_worker_losing_no_token(monkeypatch):
    """Regression: one request's bad stream chunk (the engine's RequestError) killed the worker with a traceback and
    30 requests in flight. Now its tokens go out, then RequestFailed (the manager resumes it elsewhere), and the
    others go on; an engine that fails as a whole ends the worker with exit code 4 after flushing what it produced."""
    from rlboost_hpc.rollout import agent as agent_mod

    monkeypatch.setattr(agent_mod, "ManagerLink", _LinkStandIn)
    eng = _FailingEngine()
    a = RolloutAgent("tcp://127.0.0.1:1", "job", 0, engine=eng)
    for rid in ("r1", "r2"):
        eng.add(type("R", (), {"rid": rid})())
        a.responses._pos[rid] = 0
    a.welcome = M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w", model_config={},
                          heartbeat_s=0.25, stream_every_tokens=1000, stream_every_s=1000.0)
    assert a.run() == agent_mod.EXIT_FAILED
    sent = [m for m in a.link.msgs if not isinstance(m, (M.Register, M.Heartbeat))]
    failed = [i for i, m in enumerate(sent) if isinstance(m, M.RequestFailed)]
    assert len(failed) == 1 and sent[failed[0]].rid == "r1" and "inconsistent chunk" in sent[failed[0]].error
    tokens = [(m, i) for i, m in enumerate(sent) if isinstance(m, M.Tokens)]
    got: dict[str, list[int]] = {}
    for m, i in tokens:
        ids = M.unpack_i32(m.ids)
        k = 0
        for rid, off, cnt in zip(m.rids, m.offsets, m.counts):
            assert off == len(got.get(rid, []))  # in order, nothing skipped
            got.setdefault(rid, []).extend(ids[k:k + cnt])
            k += cnt
            if rid == "r1":
                assert i < failed[0]  # r1's tokens before its RequestFailed
    assert got == {"r1": [5, 6], "r2": [7, 8]}  # every token produced reached the manager


class _GenEngine(_HoldingEngine):
    """Records the requests it is given; ``make`` tokens appear for each at the next abort (like the SGLang engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list = []

    def add(self, req):
        self.added.append(req)
        self.held[req.rid] = []


def test_continue_mode_loads_a_new_version_between_iterations_and_resumes_each_response_from_its_tokens():
    """Issue 34, ``on_new_version = "continue"``: a pull of version 1 finishes while a response runs; the agent sends
    its tokens stamped with version 0, loads version 1 and re-adds the response from prompt + every token so far
    with the budget they used up taken off. In ``finish`` mode it waits for the engine to be idle."""
    for mode in ("finish", "continue"):
        a = _agent(weights=_Weights(lambda v, peers: PulledVersion({}, checksum=5, nbytes=1)))
        a.engine = eng = _GenEngine()
        a._handle(M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w", model_config={},
                            heartbeat_s=1.0, stream_every_tokens=4, stream_every_s=0.05, on_new_version=mode))
        a.engine_epoch = 0
        a._handle(M.Assign(works=[M.Work(rid="g/0", prompt_ids=[1, 2], prefix_ids=[9], tokens_left=10,
                                         temperature=1.0, top_p=1.0, seed=3, stop_ids=[2], version=0)]))
        eng.held["g/0"] = [7, 8]  # generated under version 0, not sent yet
        a._handle(M.NewVersion(version=1))
        deadline = time.monotonic() + 5
        while a.weight_slot._pull is None or not a.weight_slot._pull.done():
            a.weight_slot.step()
            time.sleep(0.01)
            assert time.monotonic() < deadline
        a.weight_slot.step()
        if mode == "finish":
            assert eng.version == 0 and len(eng.added) == 1  # waits for the engine to be idle
            continue
        tok = next(m for m in a.link.msgs if isinstance(m, M.Tokens))
        assert tok.versions == [0] and tok.offsets == [1] and M.unpack_i32(tok.ids).tolist() == [7, 8]
        assert eng.version == 1 and len(eng.added) == 2
        again = eng.added[1]
        assert again.prompt_ids == [1, 2] and again.prefix_ids == [9, 7, 8] and again.max_new_tokens == 8
        assert a.responses._pos["g/0"] == 3


def test_a_sigterm_refined_into_a_preemption_deregisters_with_the_preemptions_reason():
    """Regression (issue 50): a Slurm requeue — SIGTERM, then Slurm's word (or the warning signal) that it is a
    preemption — reached the manager as cause "preempted" with the reason "stopped (SIGTERM)", so the manager logged
    "deregistered: stopped (SIGTERM)" for an end the report counts as a preemption. The reason follows the cause."""
    a = _agent()
    a.engine = _HoldingEngine()
    a.request_stop("stopped (SIGTERM)", "stopped")
    refined = []

    def settled():  # while the drain waits, Slurm answers: it is preempting the job
        if not refined:
            refined.append(True)
            a.request_stop("preempted (SIGTERM+PreemptTime)", "preempted")
        return True

    a.cause_settled, a.cause_settle_s = settled, 5.0
    a._drain(a.stop_reason)
    dereg = a.link.msgs[-1]
    assert isinstance(dereg, M.Deregister)
    assert (dereg.cause, dereg.reason) == ("preempted", "preempted (SIGTERM+PreemptTime)")


def test_a_reserved_engine_refused_at_its_first_registration_registers_as_the_next_attempt():
    """Regression (issue 50, a finished run continued with more steps — also a renamed run directory resumed with
    RLBOOST_RUN_ID): the manager restored from the work log remembers ``reserved#0`` as an ended attempt and refuses
    it; the reserved engine gave up (no Welcome yet), so every step waited its 300 s for an engine that never came."""
    a = _agent(kind="reserved")
    a._handle(M.Reject(reason="identity job#0 belongs to an attempt that already ended"))
    reg = a.link.msgs[-1]
    assert isinstance(reg, M.Register) and reg.attempt == 1 and reg.kind == "reserved"
    worker = _agent()  # a preemptible worker exits instead (its job is requeued under a new attempt)
    with pytest.raises(Exception, match="already ended"):
        worker._handle(M.Reject(reason="identity job#0 belongs to an attempt that already ended"))


class _RestartedManager(_Frames):
    """A link whose manager died around a drain and came back as epoch 2, knowing the instance from its work log:
    it says ``Alive(2)``, answers a Register with a ``Welcome(resend)`` and a Deregister that follows it with a
    ``Farewell`` (the frames the agent queued for the dead manager are lost). ``silent_s``: how long the manager
    has been silent when the drain starts."""

    def __init__(self, silent_s: float) -> None:
        super().__init__()
        self.last_rx = time.monotonic() - silent_s
        self.inbox = [M.encode(M.Alive(epoch=2))]
        self.registered = False

    def send(self, frame: bytes) -> None:
        super().send(frame)
        m = self.msgs[-1]
        if isinstance(m, M.Register):
            self.registered = True
            self.inbox.append(M.encode(M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w",
                                                 model_config={}, heartbeat_s=0.5, stream_every_tokens=4,
                                                 stream_every_s=0.05, epoch=2, resend=True)))
        elif isinstance(m, M.Deregister) and self.registered:
            self.inbox.append(M.encode(M.Farewell()))

    def take(self, wait_s: float = 0.0) -> list[bytes]:
        out, self.inbox = self.inbox, []
        if out:
            self.last_rx = time.monotonic()
        else:
            time.sleep(min(wait_s, 0.01))
        return out


def _warned_agent(silent_s: float) -> RolloutAgent:
    """An agent of epoch 1 running g/0 (assigned at offset 2; tokens 5, 6 sent, 7 still in the engine)."""
    a = _agent()
    a.link = _RestartedManager(silent_s)
    a.welcome = M.Welcome(instance="job#0", latest_version=0, weights_endpoint="tcp://w", model_config={},
                          heartbeat_s=0.5, stream_every_tokens=4, stream_every_s=0.05, epoch=1)
    a.engine = eng = _HoldingEngine()
    a.responses._pos = {"g/0": 4}
    a.responses._sent = {"g/0": ResponseTokens(offset=2, ids=[5, 6], lps=[-0.1, -0.2])}
    eng.held = {"g/0": [7]}
    a.drain_confirm_s = 10.0
    a.request_stop("preempted (SIGTERM)", "preempted")
    return a


def _kinds(msgs) -> list[str]:
    return [type(m).__name__ + ("(resent)" if isinstance(m, M.Tokens) and m.resent else "") for m in msgs]


def test_a_drain_lost_with_its_manager_is_handed_again_to_the_restarted_one_one_side():
    """The drain's frames went to a manager killed before it applied them; the restarted manager (it knows the
    instance) says Alive with its new epoch: the draining agent registers again, resends every token of the response
    it handed back (from its assigned offset, the one the engine held included), releases it and deregisters again,
    and exits on the Farewell — not after the wait's deadline. (The live side: ``test_manager_restart.py::
    test_workers_warned_while_their_manager_is_dead_…``.)"""
    a = _warned_agent(silent_s=0.0)
    t0 = time.monotonic()
    a._drain(a.stop_reason)
    assert time.monotonic() - t0 < 5.0
    assert _kinds(a.link.msgs) == ["Draining", "Tokens", "Released", "Deregister", "Register", "Tokens(resent)",
                                   "Draining", "Released", "Deregister"]
    resent = a.link.msgs[5]
    assert resent.rids == ["g/0"] and resent.offsets == [2] and M.unpack_i32(resent.ids).tolist() == [5, 6, 7]
    assert a.link.msgs[-2].rids == ["g/0"] and a.link.msgs[-1].cause == "preempted"


def test_a_drain_that_finds_its_manager_silent_waits_for_the_restarted_one_before_handing_back_one_side():
    """The manager has been silent past ``MANAGER_SILENT_S`` when the warning comes: the agent first waits for the
    restarted manager (registers again on its Alive, resends on its Welcome), then drains to it — nothing is sent
    into the void first."""
    a = _warned_agent(silent_s=3.0)
    a._drain(a.stop_reason)
    assert _kinds(a.link.msgs) == ["Register", "Tokens(resent)", "Draining", "Tokens", "Released", "Deregister"]
    assert a.link.msgs[3].offsets == [4] and M.unpack_i32(a.link.msgs[3].ids).tolist() == [7]


def test_a_drain_waits_for_no_farewell_at_the_runs_end_and_at_most_its_deadline_otherwise_one_side():
    """The manager's own Drain (the run ends) is never waited on; a warned end with no answer waits
    ``drain_confirm_s``, no longer."""
    a = _warned_agent(silent_s=0.0)
    a.link.inbox = []
    a._handle(M.Drain(reason="run finished"))
    t0 = time.monotonic()
    a._drain(a.stop_reason)
    assert time.monotonic() - t0 < 0.5 and _kinds(a.link.msgs)[-1] == "Deregister"
    b = _warned_agent(silent_s=0.0)
    b.link.inbox, b.drain_confirm_s = [], 0.3
    t0 = time.monotonic()
    b._drain(b.stop_reason)
    assert 0.3 <= time.monotonic() - t0 < 2.0 and _kinds(b.link.msgs) == ["Draining", "Tokens", "Released",
                                                                          "Deregister"]
