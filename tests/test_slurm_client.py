"""Slurm CLI client: parsers against real outputs of several releases, and contract tests of our error handling."""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from scavenger.slurm import SlurmClient, SlurmCommandError
from scavenger.slurm_fields import exit_code_of, gres_gpu_count, parse_elapsed, parse_tres
from scavenger.slurm_parsing import (
    parse_sacct, parse_sbatch_parsable, parse_sinfo_json, parse_sinfo_text, parse_squeue_json,
)

DATA = Path(__file__).parent / "data" / "slurm"


SHARED = {"sinfo_out.json", "squeue_out.json"}  # real 21.08 outputs, read from the shared data set


def load(name: str) -> dict:
    """A fixture: the shared data set's real outputs (never copied into the repo), or our own captures."""
    from rlboost_hpc.paths import data_file

    path = data_file(f"slurm_fixtures/squeue_sinfo_json/{name}") if name in SHARED else DATA / name
    return json.loads(path.read_text())


# -------------------------------------------------------------------------------------------------- sinfo
def test_sinfo_2108_shape():
    nodes = {n.name: n for n in parse_sinfo_json(load("sinfo_out.json"))}
    assert len(nodes) == 4
    cs2 = nodes["cs2.example.company.com"]
    assert (cs2.state, cs2.partitions, cs2.cpus, cs2.alloc_cpus) == ("MIXED", ("hw",), 64, 4)
    assert cs2.gres_total_gpus == 0 and cs2.free_gpus == 0 and cs2.free_cpus == 60
    assert nodes["cs5.example.company.com"].state == "DOWN" and not nodes["cs5.example.company.com"].usable
    assert nodes["cs3.example.company.com"].usable


def test_sinfo_2205_real_local_cluster():
    nodes = {n.name: n for n in parse_sinfo_json(load("sinfo_2205.json"))}
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    n1, n4 = nodes["n1"], nodes["n4"]
    assert n4.partitions == ("train", "scavenger") and n4.state == "MIXED"
    assert (n4.gres_total_gpus, n4.gres_used_gpus, n4.free_gpus, n4.alloc_cpus) == (2, 2, 0, 2)
    assert (n1.state, n1.free_gpus, n1.cpus, n1.usable) == ("IDLE", 2, 4, True)


def test_sinfo_2405_shape_merges_partitions_and_honours_drain():
    nodes = {n.name: n for n in parse_sinfo_json(load("sinfo_2405_derived.json"))}
    assert sorted(nodes) == ["gpu001", "gpu002", "gpu003"]
    g2 = nodes["gpu002"]
    assert g2.partitions == ("scavenger", "train")  # two records merged
    assert (g2.state, g2.gres_total_gpus, g2.gres_used_gpus, g2.free_gpus) == ("MIXED", 4, 3, 1)
    assert nodes["gpu001"].free_gpus == 4
    g3 = nodes["gpu003"]
    assert g3.state_flags == ("DRAIN",) and not g3.usable and g3.free_gpus == 0


def test_sinfo_text_fallback_real_output():
    nodes = {n.name: n for n in parse_sinfo_text((DATA / "sinfo_2205_text.txt").read_text())}
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    assert nodes["n1"].partitions == ("scavenger", "train")  # the default marker '*' is dropped
    assert (nodes["n1"].gres_total_gpus, nodes["n1"].gres_used_gpus, nodes["n1"].alloc_cpus) == (2, 2, 2)
    assert nodes["n1"].state == "MIXED"


def test_sinfo_text_state_suffixes_and_long_states():
    text = "\n".join([
        "a|p*|idle*|8|0/8/0/8|gpu:2|gpu:0|",
        "b|p|drained|8|0/0/8/8|gpu:2|gpu:0|",
        "c|p|mixed+drain|8|4/0/4/8|gpu:2|gpu:1|",
        "d|p|allocated|8|8/0/0/8|gpu:2(S:0)|gpu:2(IDX:0-1)|",
        "garbage line",
    ])
    nodes = {n.name: n for n in parse_sinfo_text(text)}
    assert nodes["a"].state_flags == ("NOT_RESPONDING",) and not nodes["a"].usable
    assert (nodes["b"].state, nodes["b"].state_flags) == ("IDLE", ("DRAIN",))
    assert not nodes["c"].usable
    assert nodes["d"].usable and nodes["d"].free_gpus == 0
    assert len(nodes) == 4


@pytest.mark.parametrize("gres,n", [
    ("", 0), ("(null)", 0), ("N/A", 0), ("gpu:2", 2), ("gpu", 1), ("gpu:a100:4(S:0-1)", 4),
    ("gpu:(null):0(IDX:N/A)", 0), ("gpu:1080ti:1(IDX:0),gpu:980gtx:1(IDX:1)", 2),
    ("tmpsize:7T,gpu:l40s:4(S:0-1)", 4), ("gpu:l40s:3(IDX:0,2-3),tmpsize:10737418240", 3), ("mps:100", 0),
    (["gpu:2(IDX:0-1)"], 2), ("gres/gpu:2", 2), ("gpu:h100:0(IDX:N/A)", 0),
])
def test_gres_gpu_count(gres, n):
    assert gres_gpu_count(gres) == n


# -------------------------------------------------------------------------------------------------- squeue
def test_squeue_2108_and_2405_shapes():
    old, new = parse_squeue_json(load("squeue_out.json"))
    assert (old.job_id, old.state, old.restart_cnt, old.nodes, old.partition) == ("26515966", "RUNNING", 0, "cs75",
                                                                                   "hw-l")
    assert old.submit_time == 1684114900.0 and old.start_time == 1684114921.0 and old.state_reason == ""
    assert old.live and not old.terminal and old.requeue is True
    # 24.05: numbers as {"set","infinite","number"}, a pending array's meta record
    assert new.job_id == "58948420_[1-10]" and new.state == "PENDING" and new.state_reason == "Dependency"
    assert new.submit_time == 1729715848.0 and new.start_time is None and new.exit_code == 0


def test_squeue_2205_real_records():
    jobs = {j.job_id: j for j in parse_squeue_json(load("squeue_2205.json"))}
    run, pend = jobs["64"], jobs["72"]
    assert run.state == "RUNNING" and run.gpus == 1 and run.nodes == "n1" and run.partition == "scavenger"
    assert run.tres == "cpu=1,node=1,billing=1,gres/gpu=1"
    assert pend.state == "PENDING" and pend.state_reason == "Resources" and pend.gpus == 1
    assert pend.comment == "rlboost:capture" and pend.name == "rlboost-rollout-capture"
    requeued = jobs["63"]
    assert (requeued.state, requeued.restart_cnt, requeued.state_reason) == ("CANCELLED", 1, "BeginTime")
    assert requeued.terminal
    # 22.05 exit codes are raw wait statuses: 15 = killed by SIGTERM, 12 = by SIGUSR2
    assert (jobs["76"].exit_code, jobs["76"].exit_signal) == (None, 15)
    assert (jobs["16"].state, jobs["16"].exit_signal) == ("FAILED", 12)
    assert (jobs["4"].state, jobs["4"].exit_code) == ("COMPLETED", 0)
    # `scontrol requeue`: pending again with restart_cnt 1, held for cred_expire (reason BeginTime); its
    # start_time is Slurm's estimate, not a start
    r = jobs["113"]
    assert (r.state, r.restart_cnt, r.state_reason, r.live, r.nodes) == ("PENDING", 1, "BeginTime", True, "")
    # a job that exits by itself on the warning signal is COMPLETED (case S3)
    assert (jobs["114"].state, jobs["114"].exit_code) == ("COMPLETED", 0)
    assert (jobs["116"].state, jobs["116"].exit_code, jobs["116"].state_reason) == ("FAILED", 3, "NonZeroExitCode")
    assert jobs["115"].state == "RUNNING" and jobs["115"].start_time == 1795950926.0


def test_job_state_lists_and_flags():
    doc = {"jobs": [
        {"job_id": 1, "job_state": ["PENDING", "REQUEUED"], "restart_cnt": 2, "comment": "t",
         "submit_time": {"set": True, "infinite": False, "number": 5}, "tres_per_node": "gres/gpu:2", "node_count":
             {"set": True, "infinite": False, "number": 1}},
        {"job_id": 2, "job_state": ["COMPLETED"], "exit_code": {"status": ["EXIT"], "return_code":
            {"set": True, "infinite": False, "number": 3}, "signal": {"id": {"set": False, "infinite": False,
                                                                          "number": 0}, "name": ""}}},
        {"job_id": 3, "job_state": "TIMEOUT", "exit_code": 256, "tres_alloc_str": "cpu=1,gres/gpu:a100=2"},
        {"job_id": 4},
        "not a job",
    ]}
    a, b, c, d = parse_squeue_json(doc)
    assert (a.state, a.state_flags, a.restart_cnt, a.gpus, a.submit_time) == ("PENDING", ("REQUEUED",), 2, 2, 5.0)
    assert (b.state, b.exit_code, b.exit_signal) == ("COMPLETED", 3, None)
    assert (c.state, c.exit_code, c.gpus, c.terminal) == ("TIMEOUT", 1, 2, True)
    assert (d.state, d.gpus, d.restart_cnt) == ("UNKNOWN", 0, 0)


# Every job state Slurm 21.08–25.x prints, in the two JSON shapes: a string (21.08–23.02: the base state, or a
# flag name in its place) and a list (23.11+: base state then flags). Records DERIVED from Slurm's documented
# output (squeue(1) JOB STATE CODES, slurm/slurm.h job_state_string); only 22.05 is installable here (its real
# records are in test_squeue_2205_real_records).
_CLASSES = {
    "PENDING": "pending", "REQUEUED": "pending", "REQUEUE_FED": "pending", "SPECIAL_EXIT": "pending",
    "REQUEUE_HOLD": "held", "RESV_DEL_HOLD": "held",
    "RUNNING": "running", "SUSPENDED": "running", "COMPLETING": "running", "CONFIGURING": "running",
    "SIGNALING": "running", "STAGE_OUT": "running", "STOPPED": "running", "RESIZING": "running",
    "POWER_UP_NODE": "running", "UPDATE_DB": "running",
    "COMPLETED": "terminal", "CANCELLED": "terminal", "FAILED": "terminal", "TIMEOUT": "terminal",
    "NODE_FAIL": "terminal", "PREEMPTED": "terminal", "BOOT_FAIL": "terminal", "DEADLINE": "terminal",
    "OUT_OF_MEMORY": "terminal", "REVOKED": "terminal", "LAUNCH_FAILED": "terminal", "RECONFIG_FAIL": "terminal",
}
_FLAG_BASE = {"REQUEUED": "PENDING", "REQUEUE_FED": "PENDING", "SPECIAL_EXIT": "PENDING", "REQUEUE_HOLD": "PENDING",
              "RESV_DEL_HOLD": "PENDING", "COMPLETING": "RUNNING", "CONFIGURING": "RUNNING", "SIGNALING": "RUNNING",
              "STAGE_OUT": "RUNNING", "STOPPED": "RUNNING", "RESIZING": "RUNNING", "POWER_UP_NODE": "RUNNING",
              "UPDATE_DB": "RUNNING", "REVOKED": "CANCELLED", "LAUNCH_FAILED": "FAILED", "RECONFIG_FAIL": "FAILED"}


@pytest.mark.parametrize("shape", ["string-2108-2302-derived", "list-2311-25x-derived"])
@pytest.mark.parametrize("state", sorted(_CLASSES))
def test_every_job_state_is_classified_in_every_json_shape(state, shape):
    value = state if shape.startswith("string") else (
        [_FLAG_BASE[state], state] if state in _FLAG_BASE else [state])
    [job] = parse_squeue_json({"jobs": [{"job_id": 9, "job_state": value}]})
    assert job.job_class == _CLASSES[state]
    assert job.live == (_CLASSES[state] != "terminal") and job.terminal == (_CLASSES[state] == "terminal")


def test_held_by_reason_and_unknown_states():
    held = {"job_id": 1, "job_state": "PENDING", "state_reason": "JobHeldUser"}
    admin = {"job_id": 2, "job_state": ["PENDING"], "state_reason": "JobHeldAdmin"}
    odd = {"job_id": 3, "job_state": ["FROBNICATING"]}
    a, b, c = parse_squeue_json({"jobs": [held, admin, odd]})
    assert (a.job_class, b.job_class, c.job_class) == ("held", "held", "unknown")
    assert c.live and not c.terminal  # an unknown state may hold capacity: never ignored


def test_exit_code_shapes():
    assert exit_code_of({"exit_code": 0}) == (0, None)
    assert exit_code_of({"exit_code": 256 * 2}) == (2, None)
    assert exit_code_of({"exit_code": 9}) == (None, 9)
    assert exit_code_of({"exit_code": {"set": True, "infinite": False, "number": 256}}) == (1, None)
    assert exit_code_of({}) == (None, None)


# -------------------------------------------------------------------------------------------------- sacct & co
def test_sacct_real_rows():
    rows = parse_sacct((DATA / "sacct_2205.txt").read_text())
    assert [r.job_id for r in rows] == ["4", "63", "64", "72", "113", "114", "115", "116", "113"]  # no steps
    r4, r63, r64, r72 = rows[:4]
    requeued, final = rows[4], rows[8]  # -D: one row per attempt, the requeued one first
    assert (requeued.state, requeued.elapsed_s, final.state) == ("REQUEUED", 3, "CANCELLED")
    assert requeued.start < final.start
    assert r4.state == "COMPLETED" and r4.elapsed_s == 40 and r4.gpus == 1 and r4.nodelist == "n1"
    assert r4.end - r4.start == 40
    assert r63.state == "PREEMPTED" and r64.end is None
    assert r72.state == "CANCELLED" and r72.start is None and r72.gpus == 0
    assert len(parse_sacct((DATA / "sacct_2205.txt").read_text(), include_steps=True)) == 17


def test_sacct_requeued_rows():
    text = ("9|r|REQUEUED|2024-05-01T10:00:00|2024-05-01T10:05:00|n1|00:05:00|cpu=1,gres/gpu=2,node=1\n"
            "9|r|REQUEUED|2024-05-01T10:06:00|2024-05-01T10:07:30|n2|00:01:30|cpu=1,gres/gpu=2,node=1\n"
            "9|r|RUNNING|2024-05-01T10:08:00|Unknown|n3|1-00:00:01|cpu=1,gres/gpu=2,node=1\n")
    rows = parse_sacct(text)
    assert [r.state for r in rows] == ["REQUEUED", "REQUEUED", "RUNNING"]
    assert rows[2].elapsed_s == 86401 and rows[0].gpus == 2


def test_small_parsers():
    assert parse_sbatch_parsable("123\n") == "123"
    assert parse_sbatch_parsable("123;cluster\n") == "123"
    with pytest.raises(ValueError):
        parse_sbatch_parsable("Submitted batch job 5")
    assert parse_tres("cpu=2,mem=4G,gres/gpu=1") == {"cpu": "2", "mem": "4G", "gres/gpu": "1"}
    assert parse_elapsed("01:02:03") == 3723 and parse_elapsed("2-00:00:00") == 172800
    assert parse_elapsed("05:30") == 330 and parse_elapsed("garbage") == 0


# -------------------------------------------------------------------------------------------------- contract tests
def fake_cmd(bin_dir: Path, name: str, body: str) -> Path:
    """A fake Slurm command: a bash script named ``name`` in ``bin_dir``."""
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    return d


def test_contract_timeout_kills_hung_command(fake_bin):
    """Contract test of OUR error handling (not of Slurm): a command that hangs — like every Slurm client
    while slurmctld is down — is killed at the timeout, with its children, and reported as timed out."""
    fake_cmd(fake_bin, "squeue", "sleep 30 & sleep 30; wait")  # a grandchild keeps the pipes open too
    c = SlurmClient(timeout_s=0.5, bin_dir=fake_bin)
    t0 = time.monotonic()
    with pytest.raises(SlurmCommandError) as ei:
        c.squeue_jobs()
    assert time.monotonic() - t0 < 5
    e = ei.value
    assert e.timed_out and "timed out" in str(e) and "slurmctld" in str(e) and e.cmd[0].endswith("squeue")


def test_contract_nonzero_exit_carries_stderr_and_hint(fake_bin, tmp_path):
    """Contract test of OUR error handling (not of Slurm): a failing sbatch raises with its return code,
    stderr and an actionable hint."""
    fake_cmd(fake_bin, "sbatch", 'echo "sbatch: error: invalid partition specified: nope" >&2; exit 1')
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    with pytest.raises(SlurmCommandError) as ei:
        SlurmClient(bin_dir=fake_bin).sbatch(script, ["--partition=nope"])
    e = ei.value
    assert (e.returncode, e.timed_out) == (1, False)
    assert "invalid partition specified: nope" in e.stderr and "--partition" in str(e)


def test_contract_controller_down_message(fake_bin):
    """Contract test of OUR error handling (not of Slurm): the message of a down controller names it."""
    fake_cmd(fake_bin, "sinfo", 'echo "slurm_load_partitions: Unable to contact slurm controller '
                                '(connect failure)" >&2; exit 1')
    with pytest.raises(SlurmCommandError, match="slurmctld is down"):
        SlurmClient(bin_dir=fake_bin, json="always").sinfo_nodes()


def test_contract_missing_binary(tmp_path):
    """Contract test of OUR error handling (not of Slurm): no Slurm client on PATH → a clear error."""
    with pytest.raises(SlurmCommandError) as ei:
        SlurmClient(bin_dir=tmp_path).squeue_jobs()
    assert ei.value.returncode is None and "PATH" in str(ei.value)


def test_contract_missing_script(fake_bin, tmp_path):
    """Contract test of OUR error handling (not of Slurm): submitting a missing script fails before sbatch."""
    fake_cmd(fake_bin, "sbatch", "echo 1")
    with pytest.raises(SlurmCommandError, match="rollout sbatch script is missing"):
        SlurmClient(bin_dir=fake_bin).sbatch(tmp_path / "nope.sbatch")


def test_contract_garbage_output(fake_bin, tmp_path):
    """Contract test of OUR error handling (not of Slurm): unparsable output is an error, not a crash."""
    fake_cmd(fake_bin, "squeue", 'echo "{truncated"')
    fake_cmd(fake_bin, "sbatch", 'echo "Submitted batch job"')
    with pytest.raises(SlurmCommandError, match="unparsable JSON"):
        SlurmClient(bin_dir=fake_bin, json="always").squeue_jobs()
    script = tmp_path / "j.sbatch"
    script.write_text("#!/bin/bash\n")
    with pytest.raises(SlurmCommandError, match="no job id"):
        SlurmClient(bin_dir=fake_bin).sbatch(script)


def test_contract_sinfo_json_unavailable_falls_back_to_text(fake_bin):
    """Contract test of OUR error handling (not of Slurm): a sinfo without --json makes the client switch to
    the text format for good (one failed JSON call, then text only)."""
    text = (DATA / "sinfo_2205_text.txt").read_text()
    (fake_bin / "sinfo.txt").write_text(text)
    log = fake_bin / "calls.log"
    fake_cmd(fake_bin, "sinfo", f'echo "$@" >> {log}\n'
                                'for a in "$@"; do [ "$a" = --json ] && { echo "sinfo: unrecognized option '
                                "'--json'\" >&2; exit 1; }; done\n"
                                f'cat {fake_bin / "sinfo.txt"}')
    c = SlurmClient(bin_dir=fake_bin)
    for _ in range(2):
        nodes = c.sinfo_nodes("scavenger")
        assert sorted(n.name for n in nodes) == ["n1", "n2", "n3", "n4"]
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and "--json" in calls[0] and "--json" not in calls[1] + calls[2]
    assert "-O" in calls[1]


def test_contract_commands_and_arguments(fake_bin, tmp_path):
    """Contract test of OUR command lines (not of Slurm): what each method runs, and that squeue filters
    are applied client-side (22.05 ignores some of them in JSON mode)."""
    log = fake_bin / "calls.log"
    squeue_json = json.dumps({"jobs": [
        {"job_id": 1, "name": "rlboost-rollout-a", "comment": "rlboost:a", "job_state": "RUNNING"},
        {"job_id": 2, "name": "rlboost-rollout-a", "comment": "rlboost:a", "job_state": "COMPLETED"},
        {"job_id": 3, "name": "other", "comment": "rlboost:b", "job_state": "PENDING"},
    ]})
    (fake_bin / "squeue.json").write_text(squeue_json)
    for name in ("scancel", "scontrol"):
        fake_cmd(fake_bin, name, f'echo "{name} $@" >> {log}')
    fake_cmd(fake_bin, "squeue", f'echo "squeue $@" >> {log}; cat {fake_bin / "squeue.json"}')
    fake_cmd(fake_bin, "sbatch", f'echo "sbatch $@ RUN=$RLBOOST_X" >> {log}; echo "4242;cluster"')
    fake_cmd(fake_bin, "sacct", f'echo "sacct $@" >> {log}; cat {DATA / "sacct_2205.txt"}')
    c = SlurmClient(bin_dir=fake_bin)
    assert [j.job_id for j in c.squeue_jobs(comment_tag="rlboost:a")] == ["1"]
    assert [j.job_id for j in c.squeue_jobs(comment_tag="rlboost:a", all_states=True)] == ["1", "2"]
    assert [j.job_id for j in c.squeue_jobs(name_prefix="rlboost-")] == ["1"]
    script = tmp_path / "r.sbatch"
    script.write_text("#!/bin/bash\n")
    assert c.sbatch(script, ["--partition=scavenger"], env={"RLBOOST_X": "y"}) == "4242"
    c.scancel(["5", "6"], signal="USR2", batch=True)
    c.scancel(["7"])
    c.scancel([])
    c.requeue("8")
    rows = c.sacct_records(job_ids=["4", "63"])
    assert [r.job_id for r in rows][:2] == ["4", "63"]
    calls = log.read_text().splitlines()
    assert calls[0] == "squeue --me --json"
    assert calls[1] == "squeue --me -t all --json"
    assert calls[3] == f"sbatch --parsable --partition=scavenger {script} RUN=y"
    assert calls[4] == "scancel --signal=USR2 --batch 5 6"
    assert calls[5] == "scancel 7"
    assert calls[6] == "scontrol requeue 8"
    assert calls[7] == ("sacct -D -P -n --format=JobID,JobName,State,Start,End,NodeList,Elapsed,AllocTRES,"
                        "Partition,Account,Eligible --jobs=4,63")
    assert len(calls) == 8


def test_contract_env_reaches_commands(fake_bin):
    """Contract test of OUR plumbing (not of Slurm): the client's env (e.g. SLURM_CONF) reaches commands."""
    fake_cmd(fake_bin, "squeue", 'echo "{\\"jobs\\": [{\\"job_id\\": 1, \\"name\\": \\"$SLURM_CONF\\"}]}"')
    [j] = SlurmClient(bin_dir=fake_bin, env={"SLURM_CONF": "/x/slurm.conf"}).squeue_jobs()
    assert j.name == "/x/slurm.conf"


def test_contract_scavenger_cli_once(fake_bin, tmp_path, monkeypatch, capsys):
    """Contract test of OUR CLI wiring (not of Slurm): `scavenger RUN_DIR --once` reads the target, lists,
    sizes capacity from sinfo and submits through sbatch with the run directory exported."""
    from scavenger.cli import main

    log = fake_bin / "calls.log"
    fake_cmd(fake_bin, "squeue", 'echo \'{"jobs": []}\'')
    fake_cmd(fake_bin, "sinfo", f"cat {DATA / 'sinfo_2205.json'}")  # n1-n3 have 2 free GPUs each
    fake_cmd(fake_bin, "sbatch", f'echo "$@" >> {log}; echo $((RANDOM + 10))')
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    script = tmp_path / "rollout.sbatch"
    script.write_text("#!/bin/bash\n")
    run_dir = tmp_path / "runA"
    run_dir.mkdir()
    (run_dir / "target.json").write_text('{"n_prem": 2, "active": true}')
    rc = main([str(run_dir), "--once", "--script", str(script), "--gpus-per-job", "2", "--max-jobs", "8"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and len(out["submitted"]) == 2 and out["free_slots"] == 3
    calls = log.read_text().splitlines()
    assert all(f"RLBOOST_RUN_DIR={run_dir.resolve()}" in c and "--gres=gpu:2" in c for c in calls)
    # a failing step exits 1 with the reason; a bad config exits 2
    fake_cmd(fake_bin, "squeue", 'echo "Unable to contact slurm controller" >&2; exit 1')
    assert main([str(run_dir), "--once", "--script", str(script)]) == 1
    assert "slurmctld" in capsys.readouterr().err
    assert main([str(run_dir), "--once", "--script", str(script), "--signal", "USR1"]) == 2
    assert main([str(run_dir), "--once", "--script", str(tmp_path / "missing")]) == 2
