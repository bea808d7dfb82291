"""Issue 34: bounded staleness (``rollout.max_staleness`` = k). The manager's window of versions (pure logic, injected
clock), its work log keeping every step in flight across compaction, the trainer's staleness accounting and masking,
the decoupled objective's statistics, bad input, and live runs on the local cluster with preemptions."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.manager.restore import restore
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.observe.run_report import quality_gate
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, finish_stats, grpo_loss, stats_to_floats
from test_manager_core import TRAINER, Clock, register, sent, submit, tokens
from test_manager_restart import commit, feed


def make(k=1, on_new_version="finish", worklog=False):
    clock = Clock()
    core = ManagerCore(clock=clock, settings=ManagerSettings(
        pending_limit=4, heartbeat_s=0.25, heartbeat_timeout_s=2.0, max_staleness=k, on_new_version=on_new_version))
    if worklog:
        core.worklog = []
    feed(core, TRAINER, M.TrainerHello(weights_endpoint="tcp://w", model_config={}))
    feed(core, TRAINER, M.SetVersion(version=0))
    core.outbox.clear()
    return core, clock


def finish_all(core, step):
    """Every running response of ``step`` finishes with the version its instance holds."""
    for rid, req in sorted(core.book.requests.items()):
        if req.step == step and req.state == "running":
            inst = core.fleet.instances[req.instance]
            feed(core, inst.peer, tokens(rid, 0, [4, 1], version=inst.version, finish=M.FINISH_STOP))


def loaded(core, peer, version):
    feed(core, peer, M.WeightsLoaded(version=version, checksum=1, nbytes=1, pull_s=0.0, load_s=0.0))


def test_k_steps_ahead_are_admitted_and_no_more():
    core, _ = make(k=1)
    submit(core, step=0, version=0)
    submit(core, step=1, version=1)  # trained by version 1: admitted while version 0 is the latest
    assert [type(m) for m in sent(core, TRAINER)] == [M.Ok, M.Ok]
    core.outbox.clear()
    submit(core, step=2, version=2)
    err = sent(core, TRAINER)[0]
    assert isinstance(err, M.Error) and "max_staleness = 1" in err.error
    assert core.book.requests["s1g0/0"].version == 0  # the oldest version its tokens may have


def test_strict_on_policy_is_unchanged_at_k0():
    core, _ = make(k=0)
    submit(core, step=0, version=0)
    submit(core, step=1, version=1)
    assert isinstance(sent(core, TRAINER)[-1], M.Error)


def test_the_version_changes_while_responses_of_its_window_run_but_not_past_it():
    core, _ = make(k=1)
    register(core, b"a", "a")
    submit(core, step=0, n=2, version=0)
    submit(core, step=1, n=2, version=1)
    core.tick()
    finish_all(core, 0)
    core.outbox.clear()
    feed(core, TRAINER, M.SetVersion(version=1))  # step 1 (window 0..1) runs on: admitted
    assert isinstance(sent(core, TRAINER)[-1], M.Ok)
    core.outbox.clear()
    feed(core, TRAINER, M.SetVersion(version=2))  # would leave step 1's tokens 2 versions old
    err = sent(core, TRAINER)[-1]
    assert isinstance(err, M.Error) and "max_staleness = 1" in err.error


def step0_done_and_version_1(mode: str):
    """k = 1: one instance holding version 0 ran step 0 (done) while step 1 (trained by version 1) waits; the trainer
    has made version 1 current."""
    core, _ = make(k=1, on_new_version=mode)
    register(core, b"a", "a")
    submit(core, step=0, n=1, version=0)
    submit(core, step=1, n=1, version=1)
    core.tick()
    feed(core, b"a", tokens("s0g0/0", 0, [4, 1], finish=M.FINISH_STOP))
    feed(core, TRAINER, M.SetVersion(version=1))
    return core


def test_tokens_of_the_window_are_accepted_and_older_ones_fence():
    core = step0_done_and_version_1("continue")
    feed(core, b"a", tokens("s1g0/0", 0, [4, 4], version=0))  # made before the instance loaded version 1
    loaded(core, b"a", 1)
    feed(core, b"a", tokens("s1g0/0", 2, [4], version=1))  # the same response, continued under version 1
    req = core.book.requests["s1g0/0"]
    assert req.n == 3 and req.runs == [0, 2, 1, 1] and core.counters.off_version_tokens_rejected == 0
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    submit(core, step=2, n=1, version=2)
    core.tick()
    feed(core, b"a", tokens("s2g0/0", 0, [4], version=0))  # window of step 2: versions 1..2
    assert core.counters.off_version_tokens_rejected == 1 and core.fleet.instances["a#0"].state == "fenced"


def test_finish_mode_routes_new_work_only_to_the_latest_and_continue_to_the_window():
    for mode, routable in (("finish", False), ("continue", True)):
        core = step0_done_and_version_1(mode)
        assert core.routable(core.fleet.instances["a#0"]) is routable, mode


def test_a_response_goes_only_to_an_instance_holding_a_version_of_its_window():
    core, _ = make(k=1, on_new_version="continue")
    register(core, b"a", "a")
    submit(core, step=0, n=1, version=0)
    core.tick()
    feed(core, b"a", tokens("s0g0/0", 0, [4, 1], finish=M.FINISH_STOP))
    feed(core, TRAINER, M.SetVersion(version=1))
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    submit(core, step=1, n=1, version=2)  # window 1..2: not for the instance, which still holds version 0
    core.tick()
    assert core.book.requests["s1g0/0"].state == "queued"
    loaded(core, b"a", 1)
    core.tick()
    assert core.book.requests["s1g0/0"].instance == "a#0"
    work = sent(core, b"a", M.Assign)[-1].works[0]
    assert work.version == 1  # the version the instance holds (its agent checks it)


def test_compaction_keeps_every_step_in_flight_and_a_restart_restores_them(tmp_path):
    core, _ = make(k=1, worklog=True)
    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False)
    register(core, b"a", "a")
    submit(core, step=0, n=2, version=0)
    submit(core, step=1, n=2, version=1)
    core.tick()
    finish_all(core, 0)
    running = sorted(r for r, q in core.book.requests.items() if q.step == 1 and q.state == "running")
    assert running
    feed(core, b"a", tokens(running[0], 0, [7, 7, 7]))  # a partial response of step 1
    for g in ("s0g0",):
        feed(core, TRAINER, M.AckGroup(gid=g))
    feed(core, TRAINER, M.SetVersion(version=1))
    submit(core, step=2, n=2, version=2)  # compaction: step 1 is still in flight
    commit(core, log)
    new = ManagerCore(clock=Clock(), epoch=2, settings=core.settings)
    restore(new, W.WorkLog(tmp_path / "work.log", "run", 2, keep=True).restored, 0.0)
    assert {r.step for r in new.book.requests.values()} == {1, 2}
    assert new.book.requests[running[0]].n == 3 and new.book.requests[running[0]].version == 0
    assert new.book.requests["s2g0/0"].version == 1


def _two_compactions_with_step_1_partial(tmp_path, *, migrate: bool) -> tuple[ManagerCore, ManagerCore]:
    """Steps 0–2 submitted ahead (k = 2), step 1's response partial (``migrate``: and handed back by its instance)
    through two compactions, step 2 finished between them; (the core, a core restored from its log)."""
    core, _ = make(k=2, worklog=True)
    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False)
    register(core, b"a", "a")
    for step in range(3):
        submit(core, step=step, n=1, version=step)
    core.tick()
    feed(core, b"a", tokens("s1g0/0", 0, [9, 9]))
    if migrate:
        feed(core, b"a", M.Released(rids=["s1g0/0"], tokens_generated=2))  # a migration of step 1's response
        assert core.book.requests["s1g0/0"].migrations == 1
    feed(core, b"a", tokens("s0g0/0", 0, [4, 1], finish=M.FINISH_STOP))
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    feed(core, TRAINER, M.SetVersion(version=1))
    submit(core, step=3, n=1, version=3)  # compaction 1: step 1 in flight
    commit(core, log)
    feed(core, b"a", tokens("s2g0/0", 0, [4, 1], finish=M.FINISH_STOP))  # step 2 done, step 1 still partial
    submit(core, step=4, n=1, version=3)  # compaction 2: step 1 still partial
    commit(core, log)
    new = ManagerCore(clock=Clock(), epoch=2, settings=core.settings)
    restore(new, W.WorkLog(tmp_path / "work.log", "run", 2, keep=True).restored, 0.0)
    return core, new


def test_a_second_compaction_keeps_a_step_still_in_flight(tmp_path):
    _, new = _two_compactions_with_step_1_partial(tmp_path, migrate=False)
    assert new.book.requests["s1g0/0"].n == 2
    assert new.book.requests["s2g0/0"].state == "done"


def test_a_migration_of_a_step_still_in_flight_survives_two_compactions_and_a_restart(tmp_path):
    """Regression: compaction kept a step in flight's tokens and finishes but not its migrations, so a restart after
    it gave the migrated response a count of 0 (the trainer's per-step ``responses_migrated`` missed it)."""
    core, new = _two_compactions_with_step_1_partial(tmp_path, migrate=True)
    assert new.book.requests["s1g0/0"].n == 2 and new.book.requests["s1g0/0"].migrations == 1
    assert new.counters.responses_migrated == core.counters.responses_migrated >= 1


def test_a_reserved_engine_takes_only_the_step_trained_or_seeded_never_one_ahead(tmp_path):
    """The reserved engine shares the trainer's devices: outside seeding it serves only the step being trained (its
    co-located fallback), while seeding only the step seeded; a step submitted ahead waits for a preemptible
    instance (before the fix it generated step s+1 while the trainer trained step s). Kept across a restart."""
    core, _ = make(k=1, worklog=True)
    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False)
    register(core, b"r", "resv", kind="reserved")
    submit(core, step=0, n=4, version=0)
    submit(core, step=1, n=2, version=1)
    core.tick()
    assert {q.step for q in core.book.requests.values() if q.state == "running"} == {0}  # Θ = 4: step 0 only
    feed(core, TRAINER, M.CloseSeeding(step=0))  # no preemptible instance: the co-located fallback
    finish_all(core, 0)
    core.tick()
    step1 = {r: q.state for r, q in core.book.requests.items() if q.step == 1}
    assert step1 == {"s1g0/0": "queued", "s1g0/1": "queued"}
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    feed(core, TRAINER, M.SetVersion(version=1))
    loaded(core, b"r", 1)
    submit(core, step=2, n=2, version=2)  # seeding step 1: its work goes to the reserved engine, step 2's does not
    commit(core, log)
    core.tick()
    assert {q.step for q in core.book.requests.values() if q.state == "running"} == {1}
    new = ManagerCore(clock=Clock(), epoch=2, settings=core.settings)
    restore(new, W.WorkLog(tmp_path / "work.log", "run", 2, keep=True).restored, 0.0)
    assert (new.train_step, new.seeding_open) == (0, True)
    register(core, b"a", "a", version=1)  # a preemptible instance takes the step ahead
    core.tick()
    assert core.book.requests["s2g0/0"].state == "running" and core.book.requests["s2g0/0"].instance.startswith("a")


def test_a_step_submitted_ahead_is_seeded_by_the_reserved_engine_once_the_step_before_it_is_trained(tmp_path):
    """Regression: the run's last k steps are all submitted ahead, so no submit opened their seeding; the manager
    kept them "ahead" of the step trained and the reserved engine never took them — with no preemptible instance
    (all preempted) the trainer, seeding until a micro-batch was ready, waited the step's 300 s timeout (the LoRA
    chaos test at k = 2, 1 run in 10). The version change that ends a step opens the next one's seeding, and a
    restarted manager keeps it open."""
    core, _ = make(k=2, worklog=True)
    log = W.WorkLog(tmp_path / "work.log", "run", 1, keep=False)
    register(core, b"r", "resv", kind="reserved")
    for s in range(3):  # steps 0, 1, 2 submitted at step 0 (the run's last steps: nothing more is submitted)
        submit(core, step=s, n=4 if s == 0 else 2, version=s)
    core.tick()  # Θ = 4: step 0 only
    feed(core, TRAINER, M.CloseSeeding(step=0))
    finish_all(core, 0)
    feed(core, TRAINER, M.AckGroup(gid="s0g0"))
    core.tick()
    assert {q.step for q in core.book.requests.values() if q.state == "running"} == set()  # 1 and 2 are ahead of 0
    feed(core, TRAINER, M.SetVersion(version=1))
    loaded(core, b"r", 1)
    commit(core, log)
    core.tick()
    assert {q.step for q in core.book.requests.values() if q.state == "running"} == {1}  # step 1 seeds; 2 is ahead
    new = ManagerCore(clock=Clock(), epoch=2, settings=core.settings)
    restore(new, W.WorkLog(tmp_path / "work.log", "run", 2, keep=True).restored, 0.0)
    assert (new.train_step, new.seeding_open) == (0, True)


def _response(versions: list[int], obs_runs: list[int] | None = None) -> M.Response:
    n = len(versions)
    runs: list[int] = []
    for v in versions:
        if runs and runs[-2] == v:
            runs[-1] += 1
        else:
            runs += [v, 1]
    return M.Response(rid="s3g0/0", sample=0, ids=M.pack_i32([5] * (n - 1) + [1]), logprobs=M.pack_f32([-1.0] * n),
                      version_runs=np.array(runs, dtype="<i4").tobytes(), finish_reason="stop", migrations=0,
                      instances=["a#0"], observation_runs=np.array(obs_runs or [], dtype="<i4").tobytes(), turns=1)


def _trainer(k: int, version: int):
    from rlboost_hpc.trainer.loop import RLTrainer, StepSettings, Totals

    t = RLTrainer.__new__(RLTrainer)
    t.s = StepSettings(prompts_per_step=1, group_size=2, max_new_tokens=16, temperature=1.0, top_p=1.0, micro_batch=2,
                       max_staleness=k)
    t.version, t.totals, t.stop_ids = version, Totals(), (1,)
    t.tok = type("Tok", (), {"decode": staticmethod(lambda ids: "x")})()
    return t


def test_the_trainer_counts_staleness_and_never_trains_a_token_older_than_k():
    t = _trainer(k=1, version=3)
    hist: dict[str, int] = {}
    smp, *_ = t._sample(3, _response([2, 2, 3, 3, 3]), [1, 2], 16, hist)
    assert hist == {"0": 3, "1": 2} and smp.loss_mask is None and smp.staleness == [1, 1, 0, 0, 0]
    smp, *_ = t._sample(3, _response([1, 2, 3]), [1, 2], 16, hist)  # version 1 is 2 behind: outside the window
    assert t.totals.tokens_masked_too_stale == 1 and smp.loss_mask == [False, True, True]
    assert t.totals.tokens_trained_off_version == 0  # masked: never trained
    assert t.totals.tokens_by_staleness == {"0": 4, "1": 3}


def test_strict_on_policy_counts_any_other_version_and_masks_nothing():
    t = _trainer(k=0, version=3)
    hist: dict[str, int] = {}
    smp, *_ = t._sample(3, _response([2, 3, 3]), [1, 2], 16, hist)
    assert t.totals.tokens_trained_off_version == 1 and smp.loss_mask is None and smp.staleness is None
    assert hist == {"0": 2} == t.totals.tokens_by_staleness  # the same histogram as at k >= 1: comparable runs


def test_the_decoupled_objective_reports_weights_ratio_and_mismatch_per_staleness():
    torch.manual_seed(0)
    B, T = 2, 5
    logp = (torch.randn(B, T) * 0.1 - 1.0).requires_grad_()
    beh = logp.detach() + torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0], [0.0, 0.2, 0.0, 0.0, 0.0]])
    mask = torch.ones(B, T, dtype=torch.bool)
    stale = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]])
    opts = GRPOOptions(behaviour_correction="tis", behaviour_cap=2.0)
    loss, st = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, opts, behaviour_logp=beh,
                         staleness=stale)
    out = finish_stats(stats_to_floats(st))
    assert out["logprob_diff_staleness1"] == pytest.approx((0.5 + 0.5 + 0.2) / 3, rel=1e-5)
    assert out["logprob_diff_staleness0"] == pytest.approx(0.0, abs=1e-6)
    assert out["behaviour_ratio_max"] == pytest.approx(1.0, abs=1e-5)  # π_old/π_beh = e^-0.5 at most below 1
    assert out["behaviour_weight_mean"] == pytest.approx(float((torch.exp(-(beh - logp.detach()))).mean()), rel=1e-5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("sets, key", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout.max_staleness=1", "rollout.on_new_version=maybe"], "rollout.on_new_version"),
    (["rollout.max_staleness=1"], "trainer.behaviour_correction"),
    (["rollout.max_staleness=1", "trainer.behaviour_correction=tis", "trainer.behaviour_cap=0"],
     "trainer.behaviour_cap"),
    (["rollout.max_staleness=1", "trainer.behaviour_correction=tis", "rollout.engine=emulated"], "rollout.engine"),
    (["trainer.gate_max_kl=0"], "trainer.gate_max_kl"),
    (["trainer.gate_max_repetition=1.5"], "trainer.gate_max_repetition"),
])
def test_bad_staleness_settings_exit_2_naming_the_key(repo_root, tmp_path, sets, key):
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.chaos
@pytest.mark.parametrize("k, mode", [(1, "finish"), (2, "continue")])
def test_a_run_with_bounded_staleness_under_preemptions_loses_nothing_and_trains_nothing_too_old(tmp_path, k, mode):
    from rlboost_hpc.chaos import chaos_main

    out = tmp_path / "run"
    # workers that live longer than a spawn and a first pull on a loaded host, and warned removals held until their
    # worker holds a partial response: a preemption that migrates work is certain, not a race with process start
    rc = chaos_main(["--out", str(out), "--steps", "8", "--seed", str(k), "--lifetime-s", "4.0",
                     "--set", f"rollout.max_staleness={k}", "--set", f"rollout.on_new_version={mode}",
                     "--set", "trainer.behaviour_correction=tis", "--set", "cluster.preempt_when_busy=true"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["tokens_trained_off_version"] == 0
    assert rep["tokens_masked_too_stale"] == 0  # the manager refused every token older than k first
    assert rep["preemptions"] >= 1 and rep["responses_migrated"] >= 1
    stale = {int(j): n for j, n in rep["tokens_by_staleness"].items()}
    assert max(stale) <= k and sum(stale.values()) > 0
    assert rep["max_staleness"] == k
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(max(map(int, ln["staleness_tokens"]), default=0) <= k for ln in lines)


@pytest.mark.chaos
@pytest.mark.slow
def test_bounded_staleness_survives_trainer_and_manager_kills_exactly_once(tmp_path):
    """k = 1 with the trainer SIGKILLed (it resumes from its checkpoint: the data frontier before the oldest untrained
    step, so the step submitted ahead is submitted again) and the manager SIGKILLed every few seconds (the work log
    keeps both steps in flight through compaction): nothing lost, duplicated or trained outside the window."""
    from rlboost_hpc.chaos import chaos_main

    out = tmp_path / "run"
    rc = chaos_main(["--out", str(out), "--steps", "14", "--seed", "3", "--trainer-kills", "3",
                     "--manager-kill-every-s", "2.5", "--set", "rollout.max_staleness=1",
                     "--set", "trainer.behaviour_correction=tis"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0
    assert rep["prompts_not_trained_exactly_once"] == 0 and rep["tokens_trained_off_version"] == 0
    assert rep["tokens_masked_too_stale"] == 0  # the manager refused every token older than k first
    assert rep["resumes"] >= 1 and rep["manager_restarts"] >= 1
    assert max(map(int, rep["tokens_by_staleness"])) <= 1


def test_the_quality_gate_names_what_failed_and_a_nan_fails():
    assert quality_gate(0.04, 0.005, 1.0, 0.2) == []
    failed = quality_gate(4.6, 0.89, 1.0, 0.2)
    assert len(failed) == 2 and "trainer.gate_max_kl" in failed[0] and "trainer.gate_max_repetition" in failed[1]
    assert quality_gate(float("nan"), 0.0, 1.0, 0.2)  # an undefined KL never passes


@pytest.mark.slow
def test_a_collapse_of_a_stale_run_is_caught_by_the_quality_gate(repo_root, tmp_path):
    """k = 8 with 4 preemptible workers (tokens up to 5 versions old) at lr 1e-3 (33x the demo's): the policy
    reward-hacks (held-out reward 1.0, repeated 3-grams ~0.9, KL ~4.6 nats/token). The report and the run's stderr
    say the gate failed; the run itself completed (exit 0: its artifacts are kept for inspection)."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
                        "--out", str(out), "--no-progress", "--set", "rollout.max_staleness=8", "--set",
                        "trainer.behaviour_correction=tis", "--set", "trainer.lr=1e-3", "--set", "trainer.steps=30",
                        "--set", "cluster.max_workers=4"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert max(int(j) for j in rep["tokens_by_staleness"]) >= 2, rep["tokens_by_staleness"]
    assert rep["quality_gate_passed"] is False and rep["quality_gate_failures"], rep["quality_gate_failures"]
    assert "quality gate failed" in p.stderr
