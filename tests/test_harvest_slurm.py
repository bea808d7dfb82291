"""One side, the harvest service and several runs' scavengers, on the real local Slurm cluster (4 nodes × 2 GPUs).

Never skips (:func:`ensure_local_slurm` brings the cluster up). The service and the scavengers run in this process,
cycle by cycle, against the real slurmctld; rollout jobs are the stand-in batch script of test_scavenger_slurm.py.
The runs' side is written by hand: each test writes the ``target.json`` a trainer writes (``target()``), so these
prove the service and the scavengers, not the trainer's targets; the whole loop through the users' and the admin's
doors (``sbatch/launch`` runs whose trainers write their own targets) is test_harvest_e2e_slurm.py.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _util import wait_for
from test_scavenger_slurm import ROLLOUT, target

from _slurm_local import ensure_local_slurm, wait_until_idle
from scavenger.config import ScavengerConfig
from scavenger.daemon import Scavenger
from scavenger.harvest import HarvestService
from scavenger.harvest_policy import SitePolicy
from scavenger.slurm import SlurmClient

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]


class CountingSlurm:
    """The real SlurmClient, with the listings each caller made counted."""

    def __init__(self, client: SlurmClient) -> None:
        self.client, self.listings = client, 0

    def sinfo_nodes(self, *a, **k):
        self.listings += 1
        return self.client.sinfo_nodes(*a, **k)

    def squeue_jobs(self, *a, **k):
        self.listings += 1
        return self.client.squeue_jobs(*a, **k)

    def reservations(self):
        self.listings += 1
        return self.client.reservations()

    def sbatch(self, *a, **k):
        return self.client.sbatch(*a, **k)

    def scancel(self, *a, **k):
        return self.client.scancel(*a, **k)


@pytest.fixture
def cluster(slurm_env_module, tmp_path):
    client = SlurmClient(env=slurm_env_module, timeout_s=15)
    wait_until_idle(client, 60)
    script = tmp_path / "rollout.sh"
    script.write_text(ROLLOUT)
    tags: list[str] = []
    yield client, script, tags
    left = [j.job_id for j in client.squeue_jobs(only_mine=True) if j.comment in tags]
    if left:
        client.scancel(left)
        wait_for(lambda: not [j for j in client.squeue_jobs() if j.comment in tags], 30, f"jobs {left} to end")


@pytest.fixture(scope="module")
def slurm_env_module() -> dict[str, str]:
    return ensure_local_slurm()


def _run(tmp_path: Path, name: str, client, script, tags, spool: Path, n: int = 10) -> tuple[Scavenger, Path]:
    run_dir = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir()
    cfg = ScavengerConfig(partition="scavenger", gpus_per_job=1, max_jobs=10, grace_s=3, time_limit="10",
                          poll_s=0.5, command_timeout_s=15, log_dir=str(tmp_path / "logs"), run_id=name,
                          harvest_dir=str(spool), harvest_max_age_s=30)
    target(run_dir, n)
    sc = Scavenger(cfg, run_dir, slurm=CountingSlurm(client), script=script)
    tags.append(sc.tag)
    return sc, run_dir


def _live(client, tag: str, running: bool = False) -> int:
    return sum(1 for j in client.squeue_jobs() if j.comment == tag and (not running or j.state == "RUNNING"))


def test_three_runs_share_by_weight_a_run_that_ends_or_vanishes_releases_and_a_restart_adopts(cluster, tmp_path):
    client, script, tags = cluster
    spool = tmp_path / "spool"
    policy = SitePolicy(spool_dir=str(spool), partitions=["scavenger"], demand_timeout_s=6, cancel_every_s=3,
                        runs={"hc": {"weight": 2.0}})
    svc_slurm = CountingSlurm(client)
    svc = HarvestService(policy, svc_slurm, local_time=lambda: dt.datetime(2026, 12, 2, 12))
    svc.spool.create()
    runs = {name: _run(tmp_path, name, client, script, tags, spool) for name in ("ha", "hb", "hc")}
    scs = {k: v[0] for k, v in runs.items()}

    def cycle(skip: tuple[str, ...] = ()) -> dict[str, int]:
        res = svc.run_cycle()
        assert res.ok and res.slurm_listings == 3, res
        for name, sc in scs.items():
            if name not in skip:
                r = sc.reconcile_once()
                assert r.ok, r
        return res.shares

    # weights 1:1:2, every run asks for 10 of 8 GPUs: 2, 2, 4 running — one listing per cycle for all three
    # (sinfo, squeue, the reservations)
    wait_for(lambda: [cycle(), [_live(client, sc.tag, running=True) for sc in scs.values()] == [2, 2, 4]][1],
             60, "2, 2 and 4 rollout jobs running", interval=0.5,
             state=lambda: str({n: _live(client, sc.tag) for n, sc in scs.items()}))
    assert all(sc.slurm.listings == 0 for sc in scs.values())  # the scavengers listed nothing themselves
    # one more cycle: the service lists at a cycle's start, and jobs the scavengers submitted in that cycle's
    # reconcile may already run by its end (CI once read a share file with no jobs after the jobs ran)
    cycle()
    shares = json.loads((spool / "shares" / "hc.json").read_text())
    assert shares["instances"] == 4 and len(shares["jobs"]) == 4  # its jobs as the service listed them
    cap = json.loads((runs["hc"][1] / "capacity.json").read_text())
    assert cap["live_jobs"] + cap["idle_slots"] == 4  # the trainer's N_prem cap is the run's share

    # hb's run ends: its jobs are cancelled and its share reaches the others within 3 cycles (weights 1:2 of 8)
    target(runs["hb"][1], 10, active=False)
    for n_cycles in range(1, 4):
        shares_after = cycle()
        if shares_after["hb"] == 0:
            break
    assert shares_after["hb"] == 0 and (shares_after["ha"], shares_after["hc"]) == (3, 5), (n_cycles, shares_after)
    wait_for(lambda: [cycle(), _live(client, scs["hb"].tag) == 0
                      and _live(client, scs["ha"].tag, True) + _live(client, scs["hc"].tag, True) == 8][1],
             60, "hb's jobs gone and ha + hc running 8", interval=0.5)

    # ha vanishes (its scavenger stops posting): after demand_timeout_s its jobs are cancelled by the service
    n_ha = _live(client, scs["ha"].tag)
    assert n_ha > 0
    wait_for(lambda: [cycle(skip=("ha",)), _live(client, scs["ha"].tag) == 0][1], 40,
             "the vanished run's jobs to be cancelled", interval=0.5)

    # the service restarts: it rebuilds from the spool and one listing, submits nothing, cancels nothing of hc
    before = sorted(j.job_id for j in client.squeue_jobs() if j.comment == scs["hc"].tag)
    svc = HarvestService(policy, svc_slurm, local_time=lambda: dt.datetime(2026, 12, 2, 12))
    res = svc.run_cycle()
    assert res.ok and res.cancelled == [] and res.shares["hc"] >= len(before)
    scs.pop("ha")
    for _ in range(3):
        cycle()
    after = sorted(j.job_id for j in client.squeue_jobs() if j.comment == scs["hc"].tag)
    assert set(before) <= set(after)  # adopted: none of hc's jobs was touched, none duplicated
    submitted = [json.loads(line) for line in (runs["hc"][1] / "events.jsonl").read_text().splitlines()]
    ids = [e["job_id"] for e in submitted if e["event"] == "submitted"]
    assert len(ids) == len(set(ids))


def _preempt_times(client) -> dict[str, float]:
    """PreemptTime (epoch s) of every job slurmctld currently has marked for preemption."""
    out = {}
    for rec in client.run(["scontrol", "show", "job", "-o"]).splitlines():
        f = dict(kv.split("=", 1) for kv in rec.split() if "=" in kv)
        pt = f.get("PreemptTime", "None")
        if pt not in ("None", "Unknown", ""):
            out[f["JobId"]] = dt.datetime.fromisoformat(pt).timestamp()
    return out


def test_the_report_gives_an_owners_delay_that_agrees_with_sacct_and_slurms_preempt_time(cluster, tmp_path,
                                                                                          slurm_env_module):
    from scavenger.harvest_report import owners_report

    client, _, tags = cluster
    script = tmp_path / "rollout-handoff.sh"  # a preempted job takes 2 s to hand off (PreemptTime is visible then)
    script.write_text(ROLLOUT.replace('  scontrol requeue "$SLURM_JOB_ID"', '  sleep 2; scontrol requeue "$SLURM_JOB_ID"'))
    assert script.read_text() != ROLLOUT
    run_dir = tmp_path / "hr"
    run_dir.mkdir()
    cfg = ScavengerConfig(partition="scavenger", gpus_per_job=1, max_jobs=8, grace_s=3, time_limit="10",
                          poll_s=0.5, command_timeout_s=15, log_dir=str(tmp_path / "logs"), run_id="hreport")
    target(run_dir, 8)
    sc = Scavenger(cfg, run_dir, slurm=client, script=script)
    tags.append(sc.tag)
    sc.reconcile_once()
    wait_for(lambda: _live(client, sc.tag, running=True) == 8, 30, "8 rollout jobs running")
    logs = Path(cfg.log_dir)
    wait_for(lambda: "".join(p.read_text() for p in logs.glob("*.out")).count("start job=") >= 8, 20,
             "the batch shells to start")
    owner = client.sbatch(script, ["--partition=train", "--gres=gpu:2", "--nodes=1", "--time=5", "--job-name=train",
                                   "--output=/dev/null", "--export=ALL,RLBOOST_RUN_DIR=/nonexistent"])
    seen: dict[str, float] = {}

    def started() -> bool:
        seen.update(_preempt_times(client))
        return any(j.job_id == owner and j.state == "RUNNING" for j in client.squeue_jobs(only_mine=True))

    wait_for(started, 40, "the owner's job to start", interval=0.1)
    client.scancel([owner])
    target(run_dir, 8, active=False)
    wait_for(lambda: sc.reconcile_once().live == 0, 30, "the rollout jobs to end")
    ids = [owner, *sorted({j for j in seen})]
    assert len(seen) >= 2, seen  # two 1-GPU rollout jobs made room for the 2-GPU owner

    def report():
        rows = client.sacct_records(job_ids=ids + _rollout_ids(run_dir))
        rep = owners_report(rows)
        return rep if rep.delays else None

    rep = wait_for(report, 20, "sacct to record the preemption", interval=1.0)
    (d,) = rep.delays
    assert d.job_id == owner and set(d.preempted) <= set(seen) and len(d.preempted) >= 2
    rows = {r.job_id: r for r in client.sacct_records(job_ids=[owner])}
    assert d.delay_s == rows[owner].start - rows[owner].eligible  # what sacct says
    preempt_at = min(seen[j] for j in d.preempted)  # when Slurm chose the rollout jobs (scontrol, whole seconds)
    assert abs((rows[owner].start - preempt_at) - d.delay_s) <= 1.0, (preempt_at, rows[owner])
    assert rep.by_run["hreport"].preemptions >= 2 and rep.by_partition["train"].jobs == 1

    # the admin's command says the same (every user's jobs since the test began)
    since = dt.datetime.fromtimestamp(rows[owner].eligible - 120).strftime("%Y-%m-%dT%H:%M:%S")
    cli = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "report", "--since", since, "--json",
                          "--run-dir", str(run_dir)],
                         env={**os.environ, **slurm_env_module, "RLBOOST_RUN_ID": "hreport"}, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    doc = json.loads(cli.stdout)
    got = {x["job_id"]: x for x in doc["delays"]}
    assert got[owner]["delay_s"] == d.delay_s and set(got[owner]["preempted"]) == set(d.preempted)
    assert doc["by_run"]["hreport"]["tokens"] == 0 and doc["by_run"]["hreport"]["gpu_hours"] > 0  # stand-ins


def test_harvest_serve_once_lists_slurm_once_for_every_run(slurm_env_module, tmp_path):
    spool = tmp_path / "spool"
    policy = tmp_path / "harvest.toml"
    policy.write_text('[harvest]\nexclude_features = ["no-such-feature"]\n')  # the features' sinfo runs too
    cli = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "serve", "--once", "--spool",
                          str(spool), "--policy", str(policy)], env={**os.environ, **slurm_env_module},
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["slurm_listings"] == 4 and out["excluded_nodes"] == [] and out["pool_gpus"] >= 0
    assert (spool / "demands").is_dir() and (spool / "shares").is_dir()


def _rollout_ids(run_dir: Path) -> list[str]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted({e["job_id"] for e in events if e["event"] == "submitted"})
