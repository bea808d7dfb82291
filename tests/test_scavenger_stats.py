"""`rlboost-hpc stats`: numbers from a synthetic event log, the rich table, JSON, and the sacct cross-check."""
from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from rlboost_hpc.events import append_event, drain_requested, drain_marker_path, read_events
from scavenger.slurm_parsing import parse_sacct
from scavenger.stats import compute_stats, cross_check_sacct, load_run_stats, sacct_requeues, stats_main

T = 1_800_000_000.0


def ev(t: float, event: str, job: str, rc: int = 0, **kw) -> dict:
    d = {"ts": T + t, "event": event, "source": "scavenger", "tag": "rlboost:r", "job_id": job, "restart_cnt": rc}
    d.update(kw)
    return d


def synthetic_events() -> list[dict]:
    """4 jobs: 10 preempted once (2 attempts of 2 GPUs), 11 drained by us (its requeue is not a preemption),
    12 still running, 13 preempted without requeue (PreemptMode=CANCEL); plus the rollout jobs' own events."""
    return [
        ev(0, "submitted", "10", name="rlboost-rollout-r"), ev(0, "submitted", "11", name="rlboost-rollout-r"),
        ev(0, "adopted", "13", state="PENDING"),
        ev(5, "started", "13", start_time=T + 5, gpus=1, node="n4"),
        ev(10, "started", "10", start_time=T + 10, gpus=2, node="n1"),
        {"ts": T + 11, "event": "started", "job_id": "10", "attempt": 0, "gpus": "0,1"},  # the worker's own
        ev(20, "started", "11", start_time=T + 20, gpus=1, node="n2"),
        ev(35, "finished", "13", state="PREEMPTED", end_time=T + 35),
        ev(50, "cancelled", "11", mode="signal", signal="USR2", reason="surplus"),
        ev(55, "requeued", "11", 1, cause="drain"),
        ev(56, "cancelled", "11", 1, mode="cancel", reason="drain_grace_expired"),
        ev(57, "finished", "11", 1, state="CANCELLED", end_time=T + 57),
        {"ts": T + 68, "event": "warned", "job_id": "10", "attempt": 0, "signal": "SIGUSR2"},
        {"ts": T + 69, "event": "tokens", "job_id": "10", "attempt": 0, "produced": 100, "handed_off": 20},
        ev(70, "requeued", "10", 1, cause="preempted_or_requeued", reason="BeginTime"),
        ev(90, "started", "10", 1, start_time=T + 90, gpus=2, node="n3"),
        ev(100, "submitted", "12"), ev(110, "started", "12", start_time=T + 110, gpus=1, node="n1"),
        {"ts": T + 40, "event": "tokens", "job_id": "11", "attempt": 0, "produced": 10, "cumulative": True},
        {"ts": T + 54, "event": "tokens", "job_id": "11", "attempt": 0, "produced": 40, "handed_off": 5,
         "cumulative": True},
        {"ts": T + 189, "event": "tokens", "job_id": "10", "attempt": 1, "produced": 300, "handed_off": 0},
        ev(190, "finished", "10", 1, state="COMPLETED", exit_code=0, end_time=T + 190),
    ]


def write_log(run_dir: Path, events: list[dict], junk: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for e in events:
        append_event(run_dir, e, fsync=False)
    if junk:
        with open(run_dir / "events.jsonl", "a") as f:
            f.write('{"ts": 1, "event": "tok')  # a torn last line (crash mid-write)


def test_numbers_from_synthetic_log(tmp_path):
    write_log(tmp_path, synthetic_events())
    st = load_run_stats(tmp_path, now=T + 210)
    assert (st.jobs, st.attempts, st.open_attempts) == (4, 5, 1)
    assert (st.requeues, st.preemptions, st.drains, st.cancelled_by_us, st.warned) == (2, 2, 1, 1, 1)
    assert st.lifetime_mean_s == pytest.approx((60 + 100 + 35 + 30) / 4)
    assert st.lifetime_median_s == pytest.approx((35 + 60) / 2)
    assert st.gpu_hours == pytest.approx((60 * 2 + 100 * 2 + 35 + 30 + 100) / 3600)
    assert (st.tokens_produced, st.tokens_handed_off) == (100 + 300 + 40, 20 + 5)
    assert st.tokens_regenerated is None
    assert st.final_states == {"COMPLETED": 1, "CANCELLED": 1, "RUNNING": 1, "PREEMPTED": 1}
    assert st.bad_lines == 1
    j10 = st.per_job["10"]
    assert (j10.attempts, j10.requeues, j10.preemptions, j10.nodes) == (2, 1, 1, ["n1", "n3"])


def test_regenerated_from_events_or_report(tmp_path):
    evs = synthetic_events()
    (tmp_path / "report.json").write_text(json.dumps({"tokens_regenerated": 7}))
    write_log(tmp_path, evs, junk=False)
    st = load_run_stats(tmp_path, now=T + 210)
    assert (st.tokens_regenerated, st.tokens_regenerated_source) == (7, "report.json")
    st2 = compute_stats(evs + [{"ts": T, "event": "tokens", "job_id": "12", "attempt": 0, "produced": 1,
                                "regenerated": 3}], now=T + 210)
    assert (st2.tokens_regenerated, st2.tokens_regenerated_source) == (3, "events")


def test_empty_and_garbage_logs(tmp_path):
    st = load_run_stats(tmp_path)
    assert (st.jobs, st.attempts, st.gpu_hours, st.lifetime_mean_s) == (0, 0, 0.0, None)
    (tmp_path / "events.jsonl").write_text('[1,2]\n\n"x"\n{"no_event": 1}\n{"event": "tokens", "produced": "many"}\n')
    st = load_run_stats(tmp_path)
    assert st.bad_lines == 3 and st.tokens_produced == 0


def test_stats_main_table_and_json(tmp_path, capsys):
    write_log(tmp_path, synthetic_events())
    assert stats_main([str(tmp_path), "--per-job"]) == 0
    out = capsys.readouterr().out
    for want in ("preemptions", "harvested GPU-hours", "tokens handed off", "attempt lifetime median", "per job"):
        assert want in out
    assert stats_main([str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["jobs"], d["preemptions"], d["tokens_produced"]) == (4, 2, 440)
    assert stats_main([str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------------------------- sacct check
SACCT_OK = """\
10|rlboost-rollout-r|REQUEUED|2027-01-15T08:00:10|2027-01-15T08:01:10|n1|00:01:00|billing=1,cpu=1,gres/gpu=2,node=1
10.batch|batch|CANCELLED|2027-01-15T08:00:10|2027-01-15T08:01:10|n1|00:01:00|cpu=1,gres/gpu=2,mem=0,node=1
11|rlboost-rollout-r|REQUEUED|2027-01-15T08:00:20|2027-01-15T08:00:55|n2|00:00:35|billing=1,cpu=1,gres/gpu=1,node=1
12|rlboost-rollout-r|RUNNING|2027-01-15T08:01:50|Unknown|n1|00:01:40|billing=1,cpu=1,gres/gpu=1,node=1
13|rlboost-rollout-r|PREEMPTED|2027-01-15T08:00:05|2027-01-15T08:00:35|n4|00:00:30|billing=1,cpu=1,gres/gpu=1,node=1
10|rlboost-rollout-r|COMPLETED|2027-01-15T08:01:30|2027-01-15T08:03:10|n3|00:01:40|billing=1,cpu=1,gres/gpu=2,node=1
11|rlboost-rollout-r|CANCELLED by 0|None|2027-01-15T08:00:57|None assigned|00:00:00|
"""


def fake_sacct(bin_dir: Path, by_ids: str, by_name: str) -> Path:
    """A fake `sacct` printing canned rows: ``by_name`` for --name queries, ``by_ids`` otherwise."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ids.txt").write_text(by_ids)
    (bin_dir / "name.txt").write_text(by_name)
    p = bin_dir / "sacct"
    p.write_text(f'#!/bin/bash\necho "$@" >> {bin_dir}/calls.log\n'
                 f'for a in "$@"; do case "$a" in --name=*) cat {bin_dir}/name.txt; exit 0;; esac; done\n'
                 f'cat {bin_dir}/ids.txt\n')
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_contract_sacct_cross_check_agrees(tmp_path, monkeypatch, capsys):
    """Contract test of OUR cross-check (not of Slurm): canned `sacct -D` rows that match the event log →
    agreement, exit 0; the job ids and the job name of the run are what is asked for."""
    run = tmp_path / "run"
    write_log(run, synthetic_events())
    bin_dir = tmp_path / "bin"
    fake_sacct(bin_dir, SACCT_OK, SACCT_OK)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert stats_main([str(run), "--sacct"]) == 0
    out = capsys.readouterr().out
    assert "sacct agrees: 4 jobs, 6 attempts, 2 requeues" in out
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert "-D" in calls[0] and "--jobs=10,11,12,13" in calls[0]
    assert "--name=rlboost-rollout-r" in calls[1] and "--starttime=" in calls[1]
    assert stats_main([str(run), "--sacct", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sacct"]["agree"] is True and d["sacct"]["sacct_gpu_hours"] == pytest.approx(
        (60 * 2 + 35 + 100 + 30 + 100 * 2) / 3600)


def test_contract_sacct_cross_check_reports_differences(tmp_path, monkeypatch, capsys):
    """Contract test of OUR cross-check (not of Slurm): missing jobs, extra jobs and requeue-count mismatches
    are listed, and the exit code is 1."""
    run = tmp_path / "run"
    write_log(run, synthetic_events())
    rows = [ln for ln in SACCT_OK.splitlines() if not ln.startswith("12|")]
    rows.insert(0, "10|rlboost-rollout-r|REQUEUED|2027-01-15T07:59:00|2027-01-15T08:00:00|n1|00:01:00|"
                   "billing=1,cpu=1,gres/gpu=2,node=1")
    extra = "14|rlboost-rollout-r|COMPLETED|2027-01-15T08:00:00|2027-01-15T08:00:10|n2|00:00:10|gres/gpu=1\n"
    bin_dir = tmp_path / "bin"
    fake_sacct(bin_dir, "\n".join(rows) + "\n", SACCT_OK + extra)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert stats_main([str(run), "--sacct"]) == 1
    out = capsys.readouterr().out
    assert "job 10: 1 requeue(s) in the event log, 2 in sacct" in out
    assert "job 12: in the event log, not in sacct" in out
    assert "job 14: a job of this run in sacct (by name), not in the event log" in out


def test_contract_sacct_failure_exits_1(tmp_path, monkeypatch, capsys):
    """Contract test of OUR error handling (not of Slurm): sacct without a database → exit 1 and the reason."""
    run = tmp_path / "run"
    write_log(run, synthetic_events())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    p = bin_dir / "sacct"
    p.write_text('#!/bin/bash\necho "sacct: error: Problem talking to the database: Connection refused" >&2\nexit 1\n')
    p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert stats_main([str(run), "--sacct"]) == 1
    assert "Connection refused" in capsys.readouterr().err


def test_sacct_requeue_counting():
    rows = parse_sacct(SACCT_OK)
    by = {}
    for r in rows:
        by.setdefault(r.job_id, []).append(r)
    assert {k: sacct_requeues(v) for k, v in by.items()} == {"10": 1, "11": 1, "12": 0, "13": 0}
    st = compute_stats(synthetic_events(), now=T + 210)
    assert cross_check_sacct(st, rows).agree


# ---------------------------------------------------------------------------------------------- event log
def test_append_event_is_atomic_under_concurrency(tmp_path):
    """Many threads appending at once never interleave lines."""
    def writer(k: int) -> None:
        for i in range(200):
            append_event(tmp_path, {"event": "tokens", "job_id": str(k), "attempt": 0, "produced": i,
                                    "pad": "x" * (100 * k)}, fsync=False)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats: dict = {}
    evs = read_events(tmp_path, stats)
    assert len(evs) == 1600 and stats["bad_lines"] == 0
    assert all(isinstance(e["ts"], float) for e in evs)


def test_a_writer_stopped_while_holding_the_lock_never_stalls_the_others(tmp_path, caplog):
    """Regression (CI, chaos run with stalls): a rollout worker SIGSTOPped while it held the event log's lock
    blocked the trainer's local-cluster thread in ``lockf`` — the very thread that would have continued it — for
    585 s, until the test's timeout. A writer now waits for the lock at most ``LOCK_WAIT_S`` (2 s) and appends without
    it; the record is there, whole."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "events.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)  # stopped while holding it, as the chaos run's stalls do
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="rlboost.events"):
            append_event(tmp_path, {"event": "finished", "job_id": "local-slot1", "restart_cnt": 1})
        assert time.monotonic() - t0 < 5
        assert [e["job_id"] for e in read_events(tmp_path)] == ["local-slot1"]
        assert "appending without it" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_append_event_rejects_bad_records(tmp_path):
    with pytest.raises(ValueError):
        append_event(tmp_path, {"job_id": "1"})
    with pytest.raises(ValueError):
        append_event(tmp_path, {"event": "x", "v": float("nan")})
    with pytest.raises(ValueError):
        append_event(tmp_path, {"event": "x", "v": object()})
    with pytest.raises(ValueError, match="too long"):
        append_event(tmp_path, {"event": "x", "v": "y" * 70_000})
    assert not (tmp_path / "events.jsonl").exists() or read_events(tmp_path) == []


def test_drain_marker_helpers(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    assert not drain_requested(tmp_path)
    drain_marker_path(tmp_path, 55).parent.mkdir(parents=True)
    drain_marker_path(tmp_path, 55).write_text("{}")
    assert drain_requested(tmp_path) and not drain_requested(tmp_path, "56")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert not drain_requested(tmp_path)


def test_a_job_reaching_its_time_limit_is_not_a_preemption():
    """Regression (issue 13): a rollout job's own --time end got the same USR2 as a preemption and was counted
    as one. Its worker classifies the warning from the job's end time; the requeue of that attempt counts as a
    time limit."""
    events = [
        ev(0, "submitted", "20"), ev(1, "started", "20", start_time=T + 1, gpus=1),
        {"ts": T + 60, "event": "warned", "job_id": "20", "attempt": 0, "signal": "SIGUSR2", "cause": "time_limit"},
        ev(62, "requeued", "20", 1, cause="preempted_or_requeued"),
        ev(70, "started", "20", 1, start_time=T + 70, gpus=1),
        {"ts": T + 80, "event": "warned", "job_id": "20", "attempt": 1, "signal": "SIGUSR2", "cause": "preempted"},
        ev(82, "requeued", "20", 2, cause="preempted_or_requeued"),
    ]
    st = compute_stats(events, now=T + 100)
    assert (st.requeues, st.preemptions, st.time_limits) == (2, 1, 1)
    assert st.warned_by_cause == {"time_limit": 1, "preempted": 1}


def test_local_cluster_slots_are_jobs_with_one_terminal_event_per_attempt():
    """Regression (issue 13): `stats` on a local run printed jobs 0, attempts 0, preemptions 0 next to warnings
    and tokens, because only the scavenger wrote life-cycle events."""
    def lc(t, event, slot, attempt, **kw):
        return {"ts": T + t, "event": event, "source": "local-cluster", "job_id": f"local-slot{slot}",
                "restart_cnt": attempt, **kw}

    events = [
        lc(0, "started", 0, 0, gpus=0), lc(0, "started", 1, 0, gpus=0),
        lc(5, "finished", 0, 0, state="PREEMPTED", cause="preempt"),
        lc(6, "started", 0, 1, gpus=0),
        lc(8, "finished", 1, 0, state="PREEMPTED", cause="kill"),
        lc(9, "finished", 0, 1, state="CANCELLED", cause="drain"),
        lc(12, "started", 1, 1, gpus=0), lc(20, "finished", 1, 1, state="CANCELLED", cause="run_end"),
    ]
    st = compute_stats(events, now=T + 30)
    assert (st.jobs, st.attempts, st.open_attempts, st.preemptions, st.drains) == (2, 4, 0, 2, 1)


def test_capacity_series_and_plot_from_the_trainer_and_the_scavengers_logs(tmp_path, capsys):
    """`stats --plot`: the controller's N_prem target per step, the scavenger's live jobs and live + idle slots."""
    run = tmp_path / "run"
    (run / "scavenger").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in [
        {"step": 0, "ts": T + 10, "n_prem_target": 1}, {"step": 1, "ts": T + 20, "n_prem_target": 3}]) + "\n")
    (run / "scavenger" / "reconcile.jsonl").write_text("\n".join(json.dumps(v) for v in [
        {"ts": T + 5, "target": 3, "live": 3, "draining": 0, "idle_slots": 1},
        {"ts": T + 11, "target": 1, "live": 3, "draining": 2, "idle_slots": 0},
        '{"ts": torn'] if isinstance(v, dict)) + "\n")
    from scavenger.stats import capacity_series

    s = capacity_series(run)
    assert s["target"] == [(5.0, 1), (15.0, 3)] and s["live"] == [(0.0, 3), (6.0, 1)]
    assert s["capacity"] == [(0.0, 4), (6.0, 1)]
    assert stats_main([str(run), "--plot", str(tmp_path / "cap.png")]) == 0
    assert (tmp_path / "cap.png").stat().st_size > 10_000
    capsys.readouterr()
    steps_only = tmp_path / "no-steps"  # a run directory without a step record: nothing to plot
    (steps_only / "scavenger").mkdir(parents=True)
    (steps_only / "target.json").write_text('{"n_prem": 1, "active": true, "step": 0}')
    assert stats_main([str(steps_only), "--plot", str(tmp_path / "x.png")]) == 2
    assert "no per-step N_prem target" in capsys.readouterr().err


def test_stats_of_a_directory_that_holds_no_run_exits_2_naming_it(tmp_path, capsys):
    """Regression (issue 28): ``stats`` of a mistyped directory printed an all-zero table and exited 0."""
    assert stats_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "holds no run" in err
