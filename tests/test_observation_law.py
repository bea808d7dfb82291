"""One observation law for the live manager and the simulator (policy/observation.py).

The real ManagerCore (injected clock) runs a scripted step: two preemptible instances at different decode rates,
a long tail on the slower one, GroupDone, SetVersion. The same timeline, written down by hand as the simulator
records it (tokens per instance, the peak its balancer learned, when the last response completed, when the
step ended), goes through the simulator's observation path; both must give the same observation and the same
StepDecision (T_seed, N_prem).
"""
from __future__ import annotations

import msgspec
import pytest

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.policy.dispatch import Balancer
from rlboost_hpc.policy.controller import RolloutController, StepObservation
from rlboost_hpc.policy.observation import RemoteWork, observe_remote
from rlboost_hpc.policy.seeding import SeedingWindow
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.sim.systems import RLBOOST
from rlboost_hpc.sim.workload import Availability

TRAINER = b"trainer"


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _scripted_step(balancing: bool) -> tuple[ManagerCore, float]:
    """A: 4 responses × 16 tokens at 2 tokens per response per 0.25 s (32 tok/s). B: 3 × 16 and 1 × 48 tokens at
    1 token per response per 0.25 s (16 tok/s at batch 4, 4 tok/s alone in the tail). Ends at t = 12 s; the
    trainer publishes version 1 at t = 15 s. Returns the core and the step end time."""
    clock = Clock()
    core = ManagerCore(clock=clock, balancer=Balancer(move_running=False) if balancing else None, settings=ManagerSettings(
            pending_limit=4, heartbeat_s=0.25, heartbeat_timeout_s=2.0, balance_every_s=0.5))
    core.on_message(TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    core.on_message(TRAINER, M.SetVersion(version=0))
    for peer in (b"a", b"b"):
        core.on_message(peer, M.Register(job_id=peer.decode(), attempt=0, kind="preemptible", max_batch=32,
                                         engine="torch"))
        core.on_message(peer, M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))
    specs = [M.GroupSpec(gid=f"s0g{g}", prompt_ids=[1, 5, 6], n=4, max_new_tokens=48, temperature=1.0,
                         top_p=1.0, seed=g, stop_ids=[1, 2]) for g in range(2)]
    core.on_message(TRAINER, M.SubmitStep(step=0, version=0, groups=specs))
    core.tick()
    held = {p: sorted(core.fleet.instances[f"{p.decode()}#0"].inflight) for p in (b"a", b"b")}
    assert len(held[b"a"]) == len(held[b"b"]) == 4
    budget = {rid: 16 for rid in held[b"a"] + held[b"b"]}
    budget[held[b"b"][-1]] = 48  # the long tail
    pos = dict.fromkeys(budget, 0)
    per_tick = {b"a": 2, b"b": 1}
    while any(pos[r] < budget[r] for r in budget):
        clock.t = round(clock.t + 0.25, 6)
        for peer, rids in held.items():
            for rid in rids:
                if pos[rid] >= budget[rid]:
                    continue
                k = min(per_tick[peer], budget[rid] - pos[rid])
                fin = M.FINISH_LENGTH if pos[rid] + k == budget[rid] else M.FINISH_NONE
                core.on_message(peer, M.Tokens(rids=[rid], offsets=[pos[rid]], counts=[k], versions=[0],
                                               finish=[fin], ids=M.pack_i32([7] * k),
                                               logprobs=M.pack_f32([-0.5] * k)))
                pos[rid] += k
            core.on_message(peer, M.Heartbeat(version=0, active=sum(pos[r] < budget[r] for r in rids),
                                              tokens_generated=sum(pos[r] for r in rids)))
        core.tick()
    assert clock.t == 12.0
    assert len([m for p, m in core.outbox if p == TRAINER and isinstance(m, M.GroupDone)]) == 2
    clock.t = 15.0
    core.on_message(TRAINER, M.SetVersion(version=1))
    return core, clock.t


@pytest.mark.parametrize("balancing", [False, True], ids=["balancer-off", "balancer-on"])
def test_live_manager_and_simulator_observe_the_same_step_and_decide_the_same(balancing):
    core, t_end = _scripted_step(balancing)
    live = msgspec.structs.asdict(core.step_account.last_remote)
    # The simulator's records for the same timeline: tokens per instance, the peak its balancer learned (A ran at
    # 32 tok/s throughout; B's best bucket is batch 4 at 16 tok/s), the last response at 12 s, the step end at 15 s.
    simulated = observe_remote([RemoteWork(tokens=64, peak_tokens_per_s=32.0),
                                RemoteWork(tokens=3 * 16 + 48, peak_tokens_per_s=16.0)],
                               rollout_done_s=12.0, step_end_s=t_end)
    assert simulated.t_remote_s == pytest.approx((64 / 32 + 96 / 16) / 2)  # 4.0 s, not busy time (7.0 s)
    assert simulated.t_wait_remote_s == pytest.approx(3.0)  # not the mean idle time per instance (8.0 s)
    assert live == pytest.approx({"t_remote_s": simulated.t_remote_s, "t_wait_remote_s": simulated.t_wait_remote_s,
                                  "n_remote": 2, "tokens": 160, "fallback_s": 0.0})

    def decide(rem) -> tuple:
        ctl = RolloutController(n_resv=1.0, seeding=SeedingWindow(initial_s=3.0, floor_s=0.2))
        ctl.begin_step(2)
        d = ctl.end_step(StepObservation(t_seed_s=3.0, t_wait_train_s=1.5, t_wait_remote_s=rem["t_wait_remote_s"],
                                         t_remote_s=rem["t_remote_s"], n_remote=rem["n_remote"], t_train_s=2.0,
                                         n_instances_start=2, n_instances_end=2, n_available=8))
        return d.t_seed_s, d.n_prem_cap

    sim = {"t_remote_s": simulated.t_remote_s, "t_wait_remote_s": simulated.t_wait_remote_s,
           "n_remote": simulated.n_remote}
    assert decide(live) == decide(sim) == pytest.approx((2.5, 6))  # T_seed 3 + (1.5 − 3)/3; ⌈(4·2 + 3·1)/2⌉


def test_the_simulator_feeds_its_controller_through_the_law(monkeypatch):
    """Every step of a simulated run reports what the law returned for its records (no parallel formula)."""
    import rlboost_hpc.sim.simulator as sim

    returned = []

    def spy(work, **kw):
        out = observe_remote(work, **kw)
        returned.append(out)
        return out

    monkeypatch.setattr(sim, "observe_remote", spy)
    run = sim.simulate(profile("8b"), RLBOOST, Availability.fixed(2), max_steps=3, duration_s=1e9)
    assert len(run.timeline) == len(returned) == 3
    assert any(o.n_remote for o in returned)
    for row, o in zip(run.timeline, returned):
        assert (row["t_remote_s"], row["t_wait_remote_s"], row["n_remote"]) == (o.t_remote_s, o.t_wait_remote_s,
                                                                               o.n_remote)


def test_law_fallbacks_pool_peak_then_busy_time_and_leavers_count():
    # an instance without a measurement uses the step's mean known peak
    obs = observe_remote([RemoteWork(40, 20.0), RemoteWork(30, None, busy_s=9.0), RemoteWork(0, 50.0)],
                         rollout_done_s=None, step_end_s=5.0)
    assert (obs.n_remote, obs.t_remote_s, obs.t_wait_remote_s, obs.tokens) == (2, pytest.approx((2 + 1.5) / 2), 0.0,
                                                                               70)
    # no peak anywhere: busy seconds stand in
    obs = observe_remote([RemoteWork(10, None, busy_s=4.0)], rollout_done_s=1.0, step_end_s=3.5)
    assert (obs.t_remote_s, obs.t_wait_remote_s) == (4.0, 2.5)
    # nobody took part: nothing to wait for
    assert observe_remote([], rollout_done_s=1.0, step_end_s=9.0).t_wait_remote_s == 0.0
    with pytest.raises(ValueError):
        observe_remote([RemoteWork(-1)], rollout_done_s=None, step_end_s=0.0)


def test_the_simulators_engine_model_is_fitted_from_the_live_decode_rates():
    from rlboost_hpc.sim.calibrate import CalibrationError, fit_decode

    # t_iter(B) = 0.002 + 0.001·B  →  rate(B) = B / t_iter(B)
    rates = {str(b): b / (0.002 + 0.001 * b) for b in (4, 8, 16, 32)}
    perf = fit_decode(rates, max_batch=32)
    assert perf.a == pytest.approx(0.002) and perf.b == pytest.approx(0.001) and perf.max_running == 32
    one = fit_decode({"8": 1000.0}, max_batch=8)
    assert (one.a, one.b) == (0.0, pytest.approx(0.001))
    with pytest.raises(CalibrationError, match="decode_tokens_per_s_by_batch"):
        fit_decode({}, max_batch=8)
