"""Issue 51: ``trainer.report_to`` — the run's figures in TensorBoard, MLflow and Weights & Biases, read back through
each tracker's own reader (tests/_trackers.py): TensorBoard's event accumulator, MLflow's client against the file
store, W&B's offline run files. No tracker is mocked; the one test double here is a :class:`Tracker` that blocks
(the hub's contract: a stuck tracker never holds up a step)."""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _trackers import mlflow_client, mlflow_history, tensorboard_scalars, tensorboard_tags, wandb_offline
from rlboost_hpc.observe import names
from rlboost_hpc.observe.trackers import Role, Tracker, TrackerKind
from rlboost_hpc.observe.tracking import TrackerHub
from rlboost_hpc.rundir import RunDir

DATA = Path(__file__).parent / "data"


def real_line() -> dict:
    """A ``metrics.jsonl`` line of a real local run (torch backend, two preemptible slots, the fault tally)."""
    return json.loads((DATA / "metrics_line.json").read_text())


def lines(n: int, start: int = 0, **over) -> list[dict]:
    out = []
    for s in range(start, start + n):
        line = {**real_line(), "step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s, "ts": 1.8e9 + s}
        line["faults"] = {**line["faults"], "preemptions_warned": s, "kills": 1}
        out.append({**line, **over})
    return out


# ------------------------------------------------------------------------------------------------ the naming scheme
def test_every_figure_of_a_step_record_has_a_name_and_no_name_shadows_another():
    """Every StepRecord field (and every backend figure of a real line) is named by the table, not the fallback;
    names use only characters every tracker accepts, and none is a ``/``-prefix of another (MLflow's file store
    keeps a metric as a file, a section as a directory)."""
    from rlboost_hpc.trainer.record import StepRecord

    line = real_line()
    keys = (set(StepRecord.__struct_fields__) - {"backend"}) | set(line)
    special = {"instance_activity_s", "faults", "rollout_by_kind"}
    unnamed = sorted(k for k in keys if k not in names.NOT_FIGURES | set(names.STEP_NAMES) |
                     set(names.STEP_FAMILIES) | special)
    assert not unnamed, f"add these metrics.jsonl keys to rlboost_hpc/observe/names.py: {unnamed}"
    figs = names.step_figures(line)
    assert figs["reward/mean"] == line["reward_mean"] and figs["kl"] == line["kl"]
    assert figs["preemption/preemptions_total"] == line["faults"]["preemptions_warned"] + line["faults"]["kills"]
    assert figs["preemption/responses_migrated_total"] == line["faults"]["responses_migrated"]
    assert figs["phase/train_seconds"] == line["phase_s"]["train"]
    assert figs["instances/by_instance/reserved_0/busy_seconds"] == line["instance_activity_s"]["reserved#0"]["busy"]
    assert figs["rollout/reserved/tokens"] == line["rollout_by_kind"]["reserved"]["tokens"]
    assert figs["rollout/preemptible/busy_seconds"] == line["rollout_by_kind"]["preemptible"]["busy_s"]
    assert "weight_checksum" not in str(figs) and not any(k.startswith("train/") and k[6:] not in (
        "grad_norm", "lr", "clip_frac", "ratio_max", "behaviour_weight_mean", "behaviour_ratio_max",
        "behaviour_effective_sample_size", "behaviour_dropped_ratio") for k in figs)
    every = set(figs) | set(names.SCAVENGER_NAMES.values()) | set(names.summary_figures(
        json.loads(json.dumps({"steps": 3, "objective": {"kl_coef": 0.1}, "decode_tokens_per_s_by_batch": {"8": 1}}))))
    for name in every:
        assert re.fullmatch(r"[a-z0-9_\-./]+", name, flags=re.I), name
        assert not any(other.startswith(name + "/") for other in every), f"{name} is a section of another name"
    # a figure a new backend adds is sent too, under train/
    assert names.step_figures({**line, "entropy": 0.5, "step": 1})["train/entropy"] == 0.5
    assert names.step_figures({"step": 1, "reward_functions": {"format": 0.25}})["reward/format"] == 0.25


def test_the_names_shared_with_prometheus_are_series_the_collectors_export():
    """Where Prometheus exports the same figure, names.PROMETHEUS says which series; each is one the manager's or
    the scavenger's collector really exports (name and labels), so the two schemes cannot drift apart."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from rlboost_hpc.manager.core import ManagerCore
    from rlboost_hpc.observe.metrics import ManagerMetrics
    from rlboost_hpc.observe.timeline import Phase
    from rlboost_hpc.protocol import messages as M
    from scavenger.metrics import ScavengerMetrics

    core = ManagerCore(clock=lambda: 0.0)
    core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
    core.on_message(b"t", M.SetVersion(version=0))
    core.on_message(b"t", M.PolicyState(t_seed_s=1.0, n_prem_cap=2))
    core.on_message(b"t", M.StepTimes(step=0, wall_s=2.0, phases={p.value: 0.1 for p in Phase}, fixed_overhead_s=0.0,
                                      mismatch={k: 0.01 for k in ("logprob_diff", "logprob_diff_max", "mismatch_kl",
                                                                  "mismatch_outside_clip_share",
                                                                  "mismatch_capped_share")}))
    core.on_message(b"i", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
    core.on_message(b"i", M.WeightsLoaded(version=0, checksum=1, nbytes=1, pull_s=0.1, load_s=0.0))
    mm = ManagerMetrics()
    mm.refresh(core)
    sm = ScavengerMetrics(1.0, 2.0)
    res = SimpleNamespace(submitted=[], cancelled=[], signalled=[], ok=True, target=SimpleNamespace(n=2, active=True),
                          desired=2, live=2, pending=1, running=1, draining=0, free_slots=3, held=0)
    sm.refresh(res, SimpleNamespace(gpu_hours=1.0, tokens_produced=10, preemptions=0, requeues=0, attempts=2))
    samples = []
    for c in (mm, sm):
        reg = CollectorRegistry()
        reg.register(c)
        samples += [(s.name, s.labels) for fam in reg.collect() for s in fam.samples]
    exported = {(n, tuple(sorted((k, v) for k, v in lab.items() if k not in ("run", "le")))) for n, lab in samples}
    missing = [f"{tracker} → {prom}{labels}" for tracker, (prom, labels) in names.PROMETHEUS.items()
               if not {(prom, tuple(sorted(labels.items()))), (prom + "_count", tuple(sorted(labels.items())))}
               & exported]
    assert not missing, f"names.PROMETHEUS points at series no collector exports: {missing}"
    assert names.prometheus_series("mismatch/kl_nats") == ("rlboost_step_mismatch_kl_nats", {})
    assert names.prometheus_series("reward/mean") is None


def test_the_scavengers_prometheus_snapshot_and_statistics_all_have_names():
    from types import SimpleNamespace

    from scavenger.metrics import ScavengerMetrics
    from scavenger.stats import RunStats

    sm = ScavengerMetrics(1.0, 3.0)
    res = SimpleNamespace(submitted=["1"], cancelled=[], signalled=[], ok=True,
                          target=SimpleNamespace(n=2, active=True), desired=2, live=2, pending=1, running=1,
                          draining=0, free_slots=3, held=0)
    stats = RunStats(jobs=2, attempts=3, preemptions=1, requeues=1, gpu_hours=2.0, tokens_produced=1000,
                     lifetime_mean_s=60.0)
    sm.refresh(res, stats)
    figs = names.scavenger_figures(sm.snapshot(), stats.summary())
    assert set(sm.snapshot()) <= set(names.SCAVENGER_NAMES), set(sm.snapshot()) - set(names.SCAVENGER_NAMES)
    assert figs["scavenger/preemptions_total"] == 1 and figs["cost/harvest_dollars_total"] == 2.0
    assert figs["cost/saving_vs_on_demand_dollars_total"] == 4.0 and figs["cost/per_token_dollars"] == 2.0 / 1000
    assert figs["scavenger/attempt_lifetime_mean_seconds"] == 60.0
    assert "scavenger/tokens_regenerated_total" not in figs  # unknown (None): left out, as Prometheus leaves it out


# ------------------------------------------------------------------------------------------------ the hub
def test_tensorboard_and_mlflow_hold_every_step_and_a_resumed_hub_continues_the_same_runs(tmp_path, caplog):
    """Steps 0–2, then a resume from the checkpoint of step 2 that redoes step 2 (a crash after it was logged):
    MLflow continues the same run (status FINISHED again, a changed parameter kept as a tag); TensorBoard's purge
    marker replaces step 2 rather than doubling it."""
    rd = RunDir(tmp_path / "run").create()
    hub = TrackerHub(["tensorboard", "mlflow"], rd, run_name="run")
    hub.params({"trainer": {"steps": 3, "lr": 3e-5}, "model": {"path": None}})
    for line in lines(3):
        hub.step(line)
    (tmp_path / "run/report.json").write_text(json.dumps({"steps": 3, "preemptions": 2}))
    hub.summary({"steps": 3, "preemptions": 2})
    hub.artifact(rd.report)
    hub.close()
    assert hub.failed == {}
    runs = json.loads(rd.trackers.read_text())
    assert set(runs) == {"tensorboard", "mlflow"}
    client, run_id = mlflow_client(rd.root)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert mlflow_history(rd.root, "reward/mean") == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert [v for _, v in mlflow_history(rd.root, "preemption/preemptions_total")] == [1, 2, 3]
    assert tensorboard_scalars(rd.tensorboard)["report/steps"] == [(2, 3.0)]
    assert "report.json/text_summary" in tensorboard_tags(rd.tensorboard)["tensors"]

    with caplog.at_level(logging.INFO, logger="rlboost.tracking"):
        hub = TrackerHub(["tensorboard", "mlflow"], rd, run_name="run", resume_step=2)
        hub.params({"trainer": {"steps": 5, "lr": 3e-5}, "model": {"path": None}})
        for line in lines(3, start=2, reward_mean=0.9):
            hub.step(line)
        hub.close()
    # issue 57 item 7 (tango #152, prime-rl PR #1668): MLflow held the redone step twice ([0, 1, 2, 2, 3, 4]); it
    # cannot delete a point, so the resumed incarnation forks: one run with every step once
    forked = json.loads(rd.trackers.read_text())
    assert forked["tensorboard"] == runs["tensorboard"] and forked["mlflow"]["run_id"] != run_id
    assert "mlflow forks into run" in caplog.text
    old, run = client.get_run(run_id), client.get_run(forked["mlflow"]["run_id"])
    assert old.info.status == "KILLED" and old.data.tags["rlboost.superseded_by"] == run.info.run_id
    assert run.info.status == "FINISHED" and run.data.params["trainer.steps"] == "3"
    assert run.data.tags["rlboost.param_changed.trainer.steps"] == "5" and run.data.tags["rlboost.forked_at_step"] == "2"
    assert [(s, round(v, 3)) for s, v in mlflow_history(rd.root, "reward/mean")] == [
        (0, 0.0), (1, 0.1), (2, 0.9), (3, 0.9), (4, 0.9)]
    tb = tensorboard_scalars(rd.tensorboard)
    assert tb["reward/mean"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.9)), (3, pytest.approx(0.9)),
                                 (4, pytest.approx(0.9))]
    assert tb.get("report/steps") in (None, [])  # the summary the first incarnation logged at step 2 was purged with it
    assert [a.path for a in client.list_artifacts(run_id)] == ["report.json", "summary"]  # (the old run's files)


def test_a_fresh_start_makes_new_tracker_runs_and_a_tracker_added_at_a_resume_gets_the_earlier_steps(tmp_path):
    rd = RunDir(tmp_path / "run").create()
    hub = TrackerHub(["mlflow"], rd, run_name="run")
    hub.step(lines(1)[0])
    hub.close()
    first = json.loads(rd.trackers.read_text())["mlflow"]["run_id"]
    hub = TrackerHub(["mlflow"], rd, run_name="run")  # trainer.resume = never, or no checkpoint yet: step 0 again
    hub.close()
    assert json.loads(rd.trackers.read_text())["mlflow"]["run_id"] != first
    hub = TrackerHub(["mlflow", "tensorboard"], rd, run_name="run", resume_step=2)
    hub.backfill(lines(2))  # the steps the checkpoint covers: only the new TensorBoard run lacks them
    hub.step(lines(1, start=2)[0])
    hub.close()
    assert [s for s, _ in tensorboard_scalars(rd.tensorboard)["kl"]] == [0, 1, 2]
    assert [s for s, _ in mlflow_history(rd.root, "kl")] == [2]


def test_a_tracker_that_raises_mid_run_is_logged_once_and_dropped_and_the_others_go_on(tmp_path, caplog):
    """MLflow's run vanishes under it (its directory deleted): every later call raises. One WARNING names it, the
    hub drops it, TensorBoard still gets every step, and no call of the caller waited."""
    rd = RunDir(tmp_path / "run").create()
    hub = TrackerHub(["tensorboard", "mlflow"], rd, run_name="run")
    hub.step(lines(1)[0])
    deadline = time.monotonic() + 60
    while not (rd.trackers.is_file() and mlflow_history(rd.root, "kl")):
        assert time.monotonic() < deadline, "MLflow never got step 0"
        time.sleep(0.05)
    ident = json.loads(rd.trackers.read_text())["mlflow"]
    shutil.rmtree(rd.mlruns / ident["experiment_id"] / ident["run_id"])
    with caplog.at_level(logging.WARNING, logger="rlboost.tracking"):
        t0 = time.monotonic()
        for line in lines(4, start=1):
            hub.step(line)
        put_s = time.monotonic() - t0
        hub.summary({"steps": 5})
        hub.close()
    assert put_s < 0.5
    assert list(hub.failed) == ["mlflow"] and [t.kind for t in hub.trackers] == []
    assert caplog.text.count("trackers: mlflow failed") == 1 and "it is dropped, the run goes on" in caplog.text
    assert [s for s, _ in tensorboard_scalars(rd.tensorboard)["reward/mean"]] == [0, 1, 2, 3, 4]


def test_only_global_rank_0_logs(tmp_path, monkeypatch):
    """Under torchrun every rank of an SPMD program runs the step loop; only rank 0 sends anything."""
    monkeypatch.setenv("RANK", "1")
    rd = RunDir(tmp_path / "run").create()
    hub = TrackerHub(["tensorboard", "mlflow"], rd, run_name="run")
    hub.step(lines(1)[0])
    hub.close()
    assert not hub.active and not rd.tensorboard.exists() and not rd.mlruns.exists() and not rd.trackers.exists()
    scavenger = TrackerHub(["tensorboard"], rd, run_name="run", role=Role.SCAVENGER)  # the daemon has no ranks
    assert scavenger.active
    scavenger.close()


class StuckTracker(Tracker):
    """A tracker whose every call waits for ``release`` (a server that stopped answering)."""

    kind = TrackerKind.MLFLOW

    def __init__(self, release: threading.Event) -> None:
        self.release, self.calls = release, 0

    def identity(self):
        return {}

    def log_metrics(self, step, figures, ts):
        self.calls += 1
        self.release.wait()

    def close(self, failed):
        pass


def test_a_stuck_tracker_never_holds_up_a_step_and_a_full_queue_drops_with_one_warning(tmp_path, caplog):
    rd = RunDir(tmp_path / "run").create()
    release = threading.Event()
    stuck = StuckTracker(release)
    hub = TrackerHub(["mlflow"], rd, run_name="run", queue_items=3, opener=lambda kind, known: stuck)
    with caplog.at_level(logging.WARNING, logger="rlboost.tracking"):
        t0 = time.monotonic()
        for line in lines(20):
            hub.step(line)
        assert time.monotonic() - t0 < 0.5
    assert 0 < hub.dropped_items < 20 and caplog.text.count("dropping new ones") == 1
    release.set()
    hub.close(timeout_s=30)
    assert stuck.calls == 20 - hub.dropped_items


@pytest.mark.integration
def test_wandb_offline_run_files_hold_the_steps_config_summary_and_files_and_a_resume_keeps_the_run_id(
        tmp_path, monkeypatch):
    """``WANDB_MODE=offline``: no network; the run files land in RUN_DIR/wandb (``wandb sync`` sends them)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rd = RunDir(tmp_path / "run").create()
    hub = TrackerHub(["wandb"], rd, run_name="run")
    hub.params({"trainer": {"steps": 3}})
    for line in lines(2):
        hub.step(line)
    shutil.copyfile(DATA / "metrics_line.json", rd.report)
    hub.summary({"steps": 2, "preemptions": 1})
    hub.artifact(rd.report)
    hub.close()
    assert hub.failed == {}
    time.sleep(1.1)  # W&B names an offline directory by the second it started in (a real resume takes longer)
    hub = TrackerHub(["wandb"], rd, run_name="run", resume_step=2)
    hub.step(lines(1, start=2)[0])
    hub.close()
    assert hub.failed == {}
    time.sleep(1.1)
    scavenger = TrackerHub(["wandb"], rd, run_name="run", role=Role.SCAVENGER)  # joins as a second writer
    scavenger.metrics(2, {"scavenger/preemptions_total": 4.0})
    scavenger.close()
    assert scavenger.failed == {}
    deadline = time.monotonic() + 30  # a secondary writer's finish returns before W&B's service wrote its rows
    while "scavenger/preemptions_total" not in (got := wandb_offline(rd.root))["history"][-1]:
        assert time.monotonic() < deadline, got["history"]
        time.sleep(0.2)
    assert got["history"].pop()["scavenger/preemptions_total"] == 4
    assert [h["_step"] for h in got["history"]] == [0, 1, 2]
    assert [h["reward/mean"] for h in got["history"]] == pytest.approx([0.0, 0.1, 0.2])
    assert [h["preemption/preemptions_total"] for h in got["history"]] == [1, 2, 3]
    assert got["summary"]["report/preemptions"] == 1 and got["config"]["trainer"] == {"steps": 3}
    assert "report.json" in got["files"]
    ident = json.loads(rd.trackers.read_text())["wandb"]["id"]
    assert [r[0] for r in got["runs"]] == [ident] * 3  # two incarnations and the scavenger: one W&B run


# ------------------------------------------------------------------------------------------------ the scavenger
def test_the_scavengers_preemptions_and_cost_reach_the_trainers_mlflow_and_tensorboard_runs(tmp_path):
    """The daemon (against the contract-tested fake Slurm of test_scavenger.py) joins the runs the trainer named in
    trackers.json and sends its preemptions, requeues, GPU-seconds and dollars, keyed by the trainer's step."""
    from test_scavenger import FakeClock, FakeSlurm, two_jobs_for_an_hour_then_a_preemption

    from scavenger.config import ScavengerConfig
    from scavenger.daemon import Scavenger

    run_dir = tmp_path / "run"
    rd = RunDir(run_dir).create()
    trainer = TrackerHub(["tensorboard", "mlflow"], rd, run_name="run")
    trainer.step(lines(1)[0])
    trainer.close()
    clock = FakeClock()
    fake = FakeSlurm(clock)
    script = tmp_path / "rollout.sbatch"
    script.write_text("#!/bin/bash\nsleep 1000\n")
    prices = ScavengerConfig(max_jobs=4, poll_s=5, spot_price_per_gpu_hour=2.0, on_demand_price_per_gpu_hour=10.0)
    sc = Scavenger(prices, run_dir, slurm=fake, clock=clock, script=script)
    two_jobs_for_an_hour_then_a_preemption(sc, fake, clock, run_dir)
    sc.close()
    assert sc.tracking.hub is None
    pre = mlflow_history(run_dir, "scavenger/preemptions_total")
    assert pre[-1] == (3, 1.0) and {s for s, _ in pre} == {3}  # target.json's step
    cost = mlflow_history(run_dir, "cost/harvest_dollars_total")[-1][1]
    assert 2 * 2.0 <= cost <= 2.1 * 2.0  # two 1-GPU jobs for ~1 h at $2 per GPU-hour
    assert mlflow_history(run_dir, "cost/saving_vs_on_demand_dollars_total")[-1][1] == pytest.approx(cost * 4)
    assert mlflow_history(run_dir, "scavenger/tokens_produced_total")[-1] == (3, 1_000_000)
    assert mlflow_history(run_dir, "reward/mean") == [(0, 0.0)]  # the trainer's figures in the same run
    tb = tensorboard_scalars(rd.tensorboard / "scavenger")
    assert tb["scavenger/preemptions_total"][-1] == (3, 1.0) and tb["scavenger/requeues_total"][-1] == (3, 1.0)


# ------------------------------------------------------------------------------------------------ the CLI
def test_naming_a_tracker_that_is_not_installed_is_exit_2_naming_its_extra(tmp_path, repo_root):
    code = ("import sys; sys.modules['mlflow'] = None  # as if mlflow were not installed\n"
            "from rlboost_hpc.cli import main; sys.exit(main())")
    p = subprocess.run([sys.executable, "-c", code, "run", "--config", str(repo_root / "configs/local.toml"), "--out",
                        str(tmp_path / "o"), "--set", 'trainer.report_to=["tensorboard", "mlflow"]', "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=repo_root)
    assert p.returncode == 2, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "trainer.report_to names mlflow" in err[0]
    assert "pip install 'rlboost-hpc[mlflow]'" in err[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "o/manager-journal.jsonl").exists()


# ------------------------------------------------------------------------------------------------ a demo run
#: A short demo run: a small held-out evaluation, the spot trace's preemptions compressed into the first seconds, and
#: a warned preemption at every step boundary (by progress: a 3-step run on a loaded host has preemptions for sure).
FAST = ["trainer.export_model=false", "task.heldout_prompts=4", "trainer.eval_samples=1", "cluster.time_scale=320",
        "cluster.replay_s=8", "cluster.faults.every_steps=1", 'cluster.faults.kinds=["preempt"]']


def metrics_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.slow
def test_a_demo_run_sends_every_steps_reward_kl_and_preemptions_to_tensorboard_and_mlflow_and_a_resume_continues(
        repo_root, tmp_path):
    """The issue's bar: ``trainer.report_to = ["tensorboard", "mlflow"]`` on the demo; every step's reward, KL and
    preemption counts read back from both, the config as parameters, the report as the summary, run.png and
    report.json as files; then more ``trainer.steps`` resume the run into the same MLflow run."""
    from test_demo_run import diagnose, run_cli

    out = tmp_path / "demo"
    p = run_cli(repo_root, out, 'trainer.report_to=["tensorboard", "mlflow"]', "trainer.steps=3", *FAST)
    assert p.returncode == 0, diagnose(p, out)
    first = json.loads((out / "trackers.json").read_text())
    client, run_id = mlflow_client(out)

    def check(steps: int) -> None:
        ms = metrics_lines(out)
        assert [m["step"] for m in ms] == list(range(steps))
        tb = tensorboard_scalars(out / "tensorboard")
        for name, want in [("reward/mean", [m["reward_mean"] for m in ms]), ("kl", [m["kl"] for m in ms]),
                           ("preemption/preemptions_total",
                            [m["faults"]["preemptions_warned"] + m["faults"]["kills"] for m in ms]),
                           ("preemption/warned_total", [m["faults"]["preemptions_warned"] for m in ms]),
                           ("preemption/responses_migrated_total", [m["faults"]["responses_migrated"] for m in ms]),
                           ("preemption/cluster_live_workers", [m["cluster_live"] for m in ms])]:
            assert mlflow_history(out, name) == [(s, pytest.approx(v)) for s, v in enumerate(want)], name
            assert tb[name] == [(s, pytest.approx(v, rel=1e-6)) for s, v in enumerate(want)], name
        rep = json.loads((out / "report.json").read_text())
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params["rollout.group_size"] == "8"
        assert run.data.metrics["report/preemptions"] == rep["preemptions"] and rep["preemptions"] > 0
        assert run.data.metrics["report/resumes"] == rep["resumes"] == steps // 5
        assert {a.path for a in client.list_artifacts(run_id)} >= {"report.json", "run.png"}
        assert tb["report/steps"][-1] == (steps - 1, steps)
        assert "run" in tensorboard_tags(out / "tensorboard")["images"]
        # the sample table (issue 58 item 5, miles #3202): trainer.log_samples (4) rows of every step, once each
        # (a resumed run writes the redone steps again, not twice), in samples.jsonl and each tracker's table
        rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [s for s in range(steps) for _ in range(4)]
        assert all(r["prompt"] and isinstance(r["response"], str) and 0.0 <= r["reward"] <= 1.0 for r in rows)
        tables = {a.path for a in client.list_artifacts(run_id, "samples")}
        assert tables == {f"samples/step-{s:06d}.json" for s in range(steps)}, tables
        table = json.loads(Path(client.download_artifacts(run_id, f"samples/step-{steps - 1:06d}.json")).read_text())
        assert table["columns"][:3] == ["prompt", "response", "reward"]
        assert [r[2] for r in table["data"]] == pytest.approx([r["reward"] for r in rows[-4:]])
        assert "samples/text_summary" in tensorboard_tags(out / "tensorboard")["tensors"]

    check(3)
    assert max(m["faults"]["preemptions_warned"] + m["faults"]["kills"] for m in metrics_lines(out)) > 0
    p = run_cli(repo_root, out, 'trainer.report_to=["tensorboard", "mlflow"]', "trainer.steps=5", *FAST)
    assert p.returncode == 0, diagnose(p, out)
    assert json.loads((out / "trackers.json").read_text()) == first  # the same tracker runs, continued
    check(5)
    assert client.get_run(run_id).data.tags["rlboost.param_changed.trainer.steps"] == "5"
    assert len(client.search_runs([first["mlflow"]["experiment_id"]])) == 1


@pytest.mark.integration
@pytest.mark.slow
def test_a_tracker_that_fails_mid_run_does_not_stop_the_run(repo_root, tmp_path):
    """MLflow's run directory is deleted after the first step reached it: MLflow raises from then on; the run logs
    one WARNING, drops it, and finishes with every step in TensorBoard."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(out), "--no-progress", "--set", 'trainer.report_to=["tensorboard", "mlflow"]', "--set",
            "trainer.steps=3", "--set", "cluster.max_workers=0", *[a for f in FAST[:3] for a in ("--set", f)]]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=repo_root)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "trackers.json").is_file() and mlflow_history(out, "kl")):
            assert proc.poll() is None and time.monotonic() < deadline, "no step reached MLflow"
            time.sleep(0.2)
        ident = json.loads((out / "trackers.json").read_text())["mlflow"]
        shutil.rmtree(out / "mlruns" / ident["experiment_id"] / ident["run_id"])
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("trackers: mlflow failed") == 1 and "it is dropped, the run goes on" in err
    assert [s for s, _ in tensorboard_scalars(out / "tensorboard")["reward/mean"]] == [0, 1, 2]
    assert json.loads((out / "report.json").read_text())["steps"] == 3


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_killed_after_its_checkpoint_resumes_into_an_mlflow_run_holding_each_step_once(repo_root, tmp_path):
    """Issue 57 item 7 (tango #152, prime-rl PR #1668), through ``rlboost-hpc run``: the trainer SIGKILLed once
    MLflow holds a step past the last checkpoint; the same command resumes and redoes that step. MLflow cannot delete
    a point, so the resumed incarnation forks: trackers.json names a run whose every step is there once (the same
    values as metrics.jsonl), the killed one is marked KILLED and names its successor."""
    import os
    import signal

    from test_demo_run import diagnose, run_cli

    out = tmp_path / "demo"
    sets = ['trainer.report_to=["mlflow"]', "trainer.steps=5", "trainer.checkpoint_every=2", *FAST]
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(out), "--no-progress"] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=repo_root,
                            start_new_session=True)
    try:
        while proc.poll() is None:  # step 2 is in MLflow, and only the checkpoint of step 2 exists (steps 0, 1)
            if (out / "trackers.json").exists() and any(s == 2 for s, _ in mlflow_history(out, "reward/mean")):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    first = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    p = run_cli(repo_root, out, *sets)
    assert p.returncode == 0, diagnose(p, out)
    client, run_id = mlflow_client(out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["resumes"] == 1 and rep["resumed_from_step"] == 2 and run_id != first
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert mlflow_history(out, "reward/mean") == [(m["step"], pytest.approx(m["reward_mean"])) for m in ms]
    old = client.get_run(first)
    assert old.info.status == "KILLED" and old.data.tags["rlboost.superseded_by"] == run_id
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.integration
@pytest.mark.slow
def test_an_offline_wandb_run_sigkilled_mid_way_keeps_its_history(repo_root, tmp_path):
    """Issue 57 item 7 (wandb #9449): W&B buffers a run's ``.wandb`` file for 15 s, and a row waits for the next
    step's: an offline run SIGKILLed (a preempted or requeued job) kept only its first steps. Through ``rlboost-hpc
    run`` with ``WANDB_MODE=offline``: SIGKILLed (its whole process group, W&B's service too) 3 s after its fourth
    step record; the offline file holds every one of those four steps, once each."""
    import os
    import signal

    out = tmp_path / "demo"
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(out), "--no-progress", "--set", 'trainer.report_to=["wandb"]', "--set", "trainer.steps=40",
            *[x for s in FAST for x in ("--set", s)]]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=repo_root,
                            env=env, start_new_session=True)
    try:
        while proc.poll() is None and len(metrics_lines(out) if (out / "metrics.jsonl").exists() else []) < 4:
            time.sleep(0.05)
        time.sleep(3.0)  # 3 × the flush interval
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    steps = [h["_step"] for h in wandb_offline(out)["history"]]
    assert steps[:4] == [0, 1, 2, 3] and steps == sorted(set(steps)), steps


def test_one_side_a_trainer_resumed_online_rewinds_its_wandb_run_to_the_resume_step(tmp_path, monkeypatch):
    """Issue 57 item 7 (W&B by its resume API; no W&B server here, so one side: the arguments ``wandb.init`` gets,
    the real ``wandb`` module's ``init`` replaced by a recorder). A trainer resumed from the checkpoint of step 7 of
    an online run rewinds it (``resume_from="<id>?_step=7"``: the crashed incarnation's steps from 7 on archived,
    the redone ones logged once); offline W&B cannot rewind, the scavenger never does, a new run is made by id."""
    import wandb

    from rlboost_hpc.observe.trackers import WandbTracker

    calls = []

    class Run:
        id, project, entity = "abc123", "p", None

    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw) or Run())
    rd = RunDir(tmp_path / "run").create()
    known = {"id": "abc123", "project": "p", "entity": None}
    for mode, role, k, step in [("online", Role.TRAINER, known, 7), ("offline", Role.TRAINER, known, 7),
                                ("online", Role.SCAVENGER, known, None), ("online", Role.TRAINER, None, None)]:
        monkeypatch.setenv("WANDB_MODE", mode)
        WandbTracker(rd, role, "run", k, step)
    rewound, offline, scavenger, new = calls
    assert rewound["resume_from"] == "abc123?_step=7" and "resume" not in rewound and "id" not in rewound
    assert (offline["id"], offline["resume"]) == ("abc123", "allow") and "resume_from" not in offline
    assert (scavenger["id"], scavenger["resume"]) == ("abc123", "allow") and "resume_from" not in scavenger
    assert new["id"] is None and new["resume"] == "allow" and all(c["project"] == "p" for c in calls[:3])
