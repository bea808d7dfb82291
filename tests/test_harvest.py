"""The harvest service's pure parts (scavenger/shares.py, scavenger/harvest_policy.py) and its cycle over recorded
Slurm listings (scavenger/harvest.py; the real cluster is in test_harvest_slurm.py)."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest

from scavenger.harvest import DemandFile, HarvestLink, HarvestService
from scavenger.harvest_policy import HarvestPolicyError, SitePolicy, load_site_policy
from scavenger.shares import RunDemand, harvestable_gpus, weighted_shares
from scavenger.slurm_records import JobInfo, NodeInfo


def node(name: str, used: int = 0, total: int = 2, part: str = "scavenger", state: str = "IDLE") -> NodeInfo:
    return NodeInfo(name, state, (part,), 8, total, used)


def job(jid: str, tag: str, state: str = "RUNNING", node_: str = "n1", gpus: int = 1) -> JobInfo:
    return JobInfo(jid, "rlboost-rollout-x", tag, state, "", "scavenger", 0, node_, 1.0, 2.0, gpus=gpus)


# ---------------------------------------------------------------------------------------------- shares
def test_weighted_max_min_splits_by_weight_when_every_run_asks_for_more():
    d = [RunDemand("a", 10), RunDemand("b", 10), RunDemand("c", 10, weight=2.0)]
    assert weighted_shares(d, 8) == {"a": 2, "b": 2, "c": 4}
    assert weighted_shares(d, 9) == {"a": 2, "b": 2, "c": 5}  # within one instance of the weighted split


def test_a_run_never_gets_more_than_it_asks_and_the_rest_goes_to_the_others():
    d = [RunDemand("a", 1), RunDemand("b", 10), RunDemand("c", 10, weight=2.0)]
    assert weighted_shares(d, 8) == {"a": 1, "b": 2, "c": 5} or weighted_shares(d, 8) == {"a": 1, "b": 3, "c": 4}
    assert sum(weighted_shares(d, 8).values()) == 8
    assert weighted_shares([RunDemand("a", 3)], 100) == {"a": 3}


def test_instance_sizes_caps_and_account_caps_hold():
    d = [RunDemand("big", 10, gpus_per_instance=4), RunDemand("small", 10, gpus_per_instance=1)]
    s = weighted_shares(d, 12)
    assert s == {"big": 1, "small": 8}  # 4 vs 8 GPUs: a second big instance would leave small at 4 — as far apart
    d = [RunDemand("a", 10, account="x", max_gpus=3), RunDemand("b", 10, account="y"), RunDemand("c", 10, account="y")]
    assert weighted_shares(d, 12, {"y": 4}) == {"a": 3, "b": 2, "c": 2}


def test_shares_reject_a_non_positive_weight():
    with pytest.raises(ValueError, match="weight"):
        weighted_shares([RunDemand("a", 1, weight=0.0)], 4)


def test_the_pool_is_idle_plus_held_less_the_share_left_free():
    nodes = [node("n1", used=2), node("n2"), node("n3", part="train"), node("n4", state="DOWN"), node("n5")]
    jobs = [job("1", "rlboost:a@1", node_="n1"), job("2", "rlboost:a@1", node_="n1"),
            job("3", "rlboost:a@1", state="PENDING", node_=""), job("4", "rlboost:other@2", node_="n2")]
    pool, idle, held = harvestable_gpus(nodes, jobs, partitions=["scavenger"], run_tags={"rlboost:a@1"},
                                        exclude_nodes=["n5"])
    assert (pool, idle, held) == (4, 2, 2)  # n2's 2 idle + a's 2 running on n1; n3 other partition, n4 down, n5 out
    assert harvestable_gpus(nodes, jobs, partitions=["scavenger"], run_tags={"rlboost:a@1"}, exclude_nodes=["n5"],
                            idle_share_free=0.25)[0] == 3
    assert harvestable_gpus(nodes, jobs, partitions=["scavenger"], run_tags=set(), blackout=True)[0] == 0
    # a job squeue still lists as running while sinfo already shows its GPUs free counts once
    assert harvestable_gpus([node("n1")], jobs[:2], partitions=["scavenger"], run_tags={"rlboost:a@1"})[:2] == (2, 2)


# ---------------------------------------------------------------------------------------------- policy
POLICY = """
[harvest]
spool_dir = "{spool}"
partitions = ["scavenger"]
idle_share_free = 0.1
[harvest.accounts.physics]
weight = 2.0
max_gpus = 6
[harvest.runs.r1]
weight = 0.5
[[harvest.blackout]]
start = "22:00"
end = "06:00"
days = ["fri"]
"""


def test_a_site_policy_loads_and_blackout_windows_span_midnight(tmp_path):
    p = tmp_path / "harvest.toml"
    p.write_text(POLICY.format(spool=tmp_path / "spool"))
    pol = load_site_policy(p)
    assert pol.accounts["physics"].max_gpus == 6 and pol.runs["r1"].weight == 0.5
    fri_late, sat_early, sat_late = dt.datetime(2026, 12, 4, 23), dt.datetime(2026, 12, 5, 5), dt.datetime(2026, 12, 5, 23)
    assert pol.in_blackout(fri_late) and pol.in_blackout(sat_early) and not pol.in_blackout(sat_late)


@pytest.mark.parametrize("text,key", [
    ('idle_share_free = 1.5', "idle_share_free"),
    ('partitions = []', "partitions"),
    ('polls = 3', "polls"),
    ('[[blackout]]\nstart = "25:00"\nend = "06:00"', "blackout.0.start"),
    ('[accounts.x]\nweight = 0', "accounts.x.weight"),
    ('[runs.y]\nmax_gpus = -1', "runs.y.max_gpus"),
])
def test_a_bad_site_policy_names_the_file_and_key(tmp_path, text, key):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(HarvestPolicyError) as e:
        load_site_policy(p)
    assert str(p) in str(e.value) and key in str(e.value)


def test_a_bad_key_of_a_harvest_table_is_named_as_the_file_spells_it(tmp_path):
    """Regression (issue 50): in a policy with a ``[harvest]`` table the error said ``idle_share_free``, not the
    ``harvest.idle_share_free`` the file uses; a policy at the top level keeps the bare key."""
    p = tmp_path / "bad.toml"
    p.write_text("[harvest]\nidle_share_free = -1\n[harvest.accounts.x]\nweight = 0\n")
    with pytest.raises(HarvestPolicyError) as e:
        load_site_policy(p)
    assert "harvest.idle_share_free:" in str(e.value) and "harvest.accounts.x.weight:" in str(e.value)
    p.write_text("idle_share_free = -1\n")
    with pytest.raises(HarvestPolicyError) as e:
        load_site_policy(p)
    assert " idle_share_free:" in str(e.value) and "harvest." not in str(e.value)


def test_harvest_serve_exits_2_on_a_bad_policy_naming_file_and_key(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[harvest]\nidle_share_free = -1\n")
    r = subprocess.run([sys.executable, "-m", "rlboost_hpc.cli", "harvest", "serve", "--policy", str(p), "--once"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and str(p) in r.stderr and "idle_share_free" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------- one cycle
class RecordedSlurm:
    """Recorded listings in place of sinfo/squeue/scontrol (scancel recorded): the service's bookkeeping, not Slurm's."""

    def __init__(self, nodes: list[NodeInfo], jobs: list[JobInfo]) -> None:
        self.nodes, self.jobs, self.listings, self.cancelled = nodes, jobs, 0, []
        self.reservations_: list = []
        self.features_: dict = {}

    def sinfo_nodes(self, partition=None):
        self.listings += 1
        return list(self.nodes)

    def squeue_jobs(self, name_prefix=None, comment_tag=None, all_states=False, only_mine=True):
        self.listings += 1
        assert all_states and not only_mine
        return list(self.jobs)

    def reservations(self):
        self.listings += 1
        return list(self.reservations_)

    def node_features(self):
        self.listings += 1
        return dict(self.features_)

    def scancel(self, job_ids, signal=None, batch=False):
        self.cancelled += list(job_ids)
        self.jobs = [j for j in self.jobs if j.job_id not in job_ids]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _service(tmp_path, slurm, clock, **kw):
    pol = SitePolicy(spool_dir=str(tmp_path / "spool"), demand_timeout_s=30, cancel_every_s=10, **kw)
    svc = HarvestService(pol, slurm, clock=clock, local_time=lambda: dt.datetime(2026, 12, 2, 12))
    svc.spool.create()
    return svc


def test_one_listing_per_cycle_whatever_the_number_of_runs_and_shares_by_weight(tmp_path):
    slurm, clock = RecordedSlurm([node(f"n{i}") for i in range(4)], []), Clock()
    svc = _service(tmp_path, slurm, clock, runs={"c": {"weight": 2.0}})
    for rid in ("a", "b", "c", "d", "e", "f")[:3]:
        svc.spool.post_demand(DemandFile(rid, f"rlboost:{rid}@0", instances=10, ts=1.0))
    res = svc.run_cycle()
    assert res.shares == {"a": 2, "b": 2, "c": 4} and slurm.listings == 3 == res.slurm_listings
    share = svc.spool.read_share("c")
    assert share.instances == 4 and share.seq == 0 and share.pool_gpus == 8


def test_a_run_that_leaves_releases_its_share_and_one_that_vanishes_is_cancelled(tmp_path):
    jobs = [job("11", "rlboost:a@0"), job("12", "rlboost:a@0"), job("21", "rlboost:b@0", node_="n2")]
    slurm, clock = RecordedSlurm([node("n1", used=2), node("n2", used=1), node("n3")], jobs), Clock()
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=4, ts=1.0))
    svc.spool.post_demand(DemandFile("b", "rlboost:b@0", instances=4, ts=1.0))
    assert svc.run_cycle().shares == {"a": 3, "b": 3}  # pool 6: 3 idle + 3 held
    svc.spool.withdraw("b")  # b's run ended
    assert svc.run_cycle().shares == {"a": 4} and svc.spool.read_share("b") is None
    clock.t += 31  # a stops posting
    res = svc.run_cycle()
    assert res.vanished == ["a"] and sorted(res.cancelled) == ["11", "12"] and svc.spool.read_share("a").instances == 0
    assert svc.spool.read_share("a").reason == "vanished"
    clock.t += 1
    assert svc.run_cycle().cancelled == []  # its jobs are gone: forgotten
    assert svc.spool.read_demands() == {} and svc.spool.read_share("a") is None


def test_a_restarted_service_gives_the_same_shares_from_the_spool_and_one_listing(tmp_path):
    slurm, clock = RecordedSlurm([node("n1"), node("n2")], [job("11", "rlboost:a@0")]), Clock()
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=3, ts=1.0))
    svc.spool.post_demand(DemandFile("b", "rlboost:b@0", instances=3, ts=1.0))
    first = svc.run_cycle().shares
    again = _service(tmp_path, slurm, clock).run_cycle()
    assert again.shares == first and again.cancelled == [] and slurm.cancelled == []


def test_an_unlisted_account_gets_nothing_when_only_listed_accounts(tmp_path):
    slurm, clock = RecordedSlurm([node("n1"), node("n2")], []), Clock()
    svc = _service(tmp_path, slurm, clock, only_listed_accounts=True, accounts={"ok": {"max_gpus": 1}})
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=3, account="ok", ts=1.0))
    svc.spool.post_demand(DemandFile("b", "rlboost:b@0", instances=3, account="nope", ts=1.0))
    assert svc.run_cycle().shares == {"a": 1, "b": 0}
    assert "not listed" in svc.spool.read_share("b").reason


def test_a_malformed_demand_is_skipped_and_the_others_are_served(tmp_path):
    slurm, clock = RecordedSlurm([node("n1")], []), Clock()
    svc = _service(tmp_path, slurm, clock)
    (svc.spool.demands / "x.json").write_text("{not json")
    (svc.spool.demands / "y.json").write_text(json.dumps({"run_id": "z", "tag": "t", "instances": 1}))
    # a demand that names another run's jobs (tag) under its own name is not served: it could have them cancelled
    (svc.spool.demands / "x2.json").write_text(json.dumps({"run_id": "x2", "tag": "rlboost:a@0", "instances": 1}))
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=1, ts=1.0))
    assert svc.run_cycle().shares == {"a": 1}


def test_the_link_acts_only_on_a_listing_taken_after_its_last_action(tmp_path):
    slurm, clock = RecordedSlurm([node("n1")], []), Clock()
    svc = _service(tmp_path, slurm, clock)
    t = [0.0]
    link = HarvestLink(svc.spool.root, "a", "rlboost:a@0", max_age_s=20, clock=lambda: t[0])
    assert link.exchange(2, 1, True)[1:] == (f"no share from the harvest service in {svc.spool.shares} yet", False)
    t[0] += 21
    assert link.exchange(2, 1, True)[2] is True  # still none after max_age_s: stale (fall back, submit nothing)
    svc.run_cycle()
    share, why, stale = link.exchange(2, 1, True)
    assert share is not None and share.instances == 2 and not stale
    link.acted()  # it submitted
    assert link.exchange(2, 1, True)[:2] == (None, "waiting for a listing taken after the last action")
    svc.run_cycle()  # reads the demand posted after the action, then lists
    assert link.exchange(2, 1, True)[0].seq == 1
    t[0] += 21  # the service stopped
    assert link.exchange(2, 1, True)[2] is True
    link.leave()
    assert svc.spool.read_demands() == {}


# ---------------------------------------------------------------------------------------------- the owners' report
def _row(jid, name, state, start, end, node, eligible=None, partition="scavenger", account="acct", gpus=1):
    from scavenger.slurm_records import SacctRecord

    return SacctRecord(jid, None, name, state, start, end, node, (end or start) - start, {"gres/gpu": str(gpus)},
                       partition, account, eligible)


def test_the_owners_delay_is_start_minus_eligible_of_jobs_that_preempted_rollout_work():
    from scavenger.harvest_report import owners_report

    t = 1_764_000_000.0
    rows = [
        _row("10", "rlboost-rollout-r1", "REQUEUED", t, t + 100, "n1"),  # preempted by job 20
        _row("10", "rlboost-rollout-r1", "RUNNING", t + 130, None or t + 400, "n3"),  # its next attempt
        _row("11", "rlboost-rollout-r2", "REQUEUED", t, t + 300, "n2", account="other"),  # requeued alone
        _row("20", "train", "COMPLETED", t + 110, t + 200, "n[1-2]", eligible=t + 95, partition="train"),
        _row("21", "train", "COMPLETED", t + 50, t + 60, "n4", eligible=t + 40, partition="train"),  # took idle GPUs
    ]
    rep = owners_report(rows, spot_price_per_gpu_hour=1.0, on_demand_price_per_gpu_hour=3.0)
    assert [(d.job_id, d.delay_s, d.preempted) for d in rep.delays] == [("20", 15.0, ("10",))]
    assert rep.by_partition["train"].jobs == 1 and rep.by_partition["train"].max_s == 15.0
    r1 = rep.by_run["r1"]
    assert r1.attempts == 2 and r1.preemptions == 1 and r1.gpu_hours == pytest.approx(370 / 3600)
    assert r1.saved == pytest.approx(2 * 370 / 3600) and rep.by_run["r2"].preemptions == 0
    assert set(rep.by_account) == {"acct", "other"}


def test_delay_percentiles_are_nearest_rank():
    from scavenger.harvest_report import _stats

    s = _stats([float(i) for i in range(1, 201)])
    assert (s.jobs, s.p50_s, s.p99_s, s.max_s) == (200, 100.0, 198.0, 200.0)


def test_the_service_metrics_cover_its_grafana_dashboard_and_follow_the_conventions(tmp_path):
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scavenger.metrics import HarvestMetrics

    slurm, clock = RecordedSlurm([node("n1"), node("n2")], []), Clock()
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=3, ts=1.0))
    m = HarvestMetrics()
    m.refresh(svc.run_cycle())
    from scavenger.harvest_report import owners_report

    t = 1_764_000_000.0
    m.refresh_report(owners_report([_row("10", "rlboost-rollout-a", "REQUEUED", t, t + 100, "n1"),
                                    _row("20", "train", "COMPLETED", t + 104, t + 200, "n1", eligible=t + 98,
                                         partition="train")]))
    reg = CollectorRegistry()
    reg.register(m)
    text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["rlboost_harvest_share_instances"].samples[0].labels == {"run": "a"}
    assert fams["rlboost_harvest_share_instances"].samples[0].value == 3.0
    assert fams["rlboost_harvest_slurm_listings"].type == "counter" and "rlboost_harvest_slurm_listings_total 3.0" in text
    delay = {s.labels["quantile"]: s.value for s in fams["rlboost_harvest_owner_delay_seconds"].samples}
    assert delay == {"0.5": 6.0, "0.99": 6.0, "1": 6.0}
    assert fams["rlboost_harvest_run_gpu_seconds"].samples[0].labels == {"run": "a"}
    assert not any("instance" in s.labels for f in fams.values() for s in f.samples)
    dash = json.loads((Path(__file__).parents[1] / "rlboost_hpc/observe/grafana/rlboost-harvest.json").read_text())
    used = {x for p in dash["panels"] for t in p["targets"] for x in re.findall(r"rlboost_\w+", t["expr"])}
    exported = set(re.findall(r"^(rlboost_\w+)", text, flags=re.M))
    assert used and used <= exported, sorted(used - exported)


def test_nodes_of_a_reservation_that_begins_within_the_horizon_are_not_harvested(tmp_path):
    from scavenger.slurm_reservations import parse_reservations

    text = ("ReservationName=maint StartTime=2026-12-05T12:30:00 EndTime=2026-12-05T14:00:00 Duration=01:30:00 "
            "Nodes=n[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) Flags=MAINT State=INACTIVE\n"
            "ReservationName=later StartTime=2026-12-06T12:30:00 EndTime=2026-12-06T14:00:00 Nodes=n3 NodeCnt=1\n")
    resv = parse_reservations(text)
    assert [r.name for r in resv] == ["maint", "later"] and resv[0].nodes == {"n1", "n2"}
    assert parse_reservations("No reservations in the system\n") == []
    slurm, clock = RecordedSlurm([node("n1"), node("n2"), node("n3"), node("n4")], []), Clock()
    slurm.reservations_ = resv
    clock.t = dt.datetime(2026, 12, 5, 12, 0).timestamp()  # maint begins in 30 min, later tomorrow
    svc = _service(tmp_path, slurm, clock)
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=8, ts=1.0))
    res = svc.run_cycle()
    assert res.reserved_nodes == ["n1", "n2"] and res.pool_gpus == 4 and res.shares == {"a": 4}


def test_a_run_on_a_partition_or_qos_the_policy_does_not_harvest_gets_nothing(tmp_path):
    slurm, clock = RecordedSlurm([node("n1"), node("n2")], []), Clock()
    svc = _service(tmp_path, slurm, clock, qos=["scavenger"])
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=2, partition="scavenger", qos="scavenger", ts=1.0))
    svc.spool.post_demand(DemandFile("b", "rlboost:b@0", instances=2, partition="train", qos="scavenger", ts=1.0))
    svc.spool.post_demand(DemandFile("c", "rlboost:c@0", instances=2, partition="scavenger", qos="normal", ts=1.0))
    assert svc.run_cycle().shares == {"a": 2, "b": 0, "c": 0}
    assert "partition 'train'" in svc.spool.read_share("b").reason and "QoS 'normal'" in svc.spool.read_share("c").reason


def test_the_report_plot_is_a_png(tmp_path):
    from scavenger.harvest_report import owners_report, plot_report

    t = 1_764_000_000.0
    rep = owners_report([_row("10", "rlboost-rollout-a", "REQUEUED", t, t + 100, "n1"),
                         _row("20", "train", "COMPLETED", t + 104, t + 200, "n1", eligible=t + 98, partition="train")])
    out = tmp_path / "owners.png"
    plot_report(rep, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_a_scavenger_under_the_service_keeps_its_default_tag():
    from scavenger.config import ScavengerConfigError, load_scavenger_config

    with pytest.raises(ScavengerConfigError, match="tag: leave it unset with harvest_dir"):
        load_scavenger_config(None, harvest_dir="/tmp/spool", tag="mine")


def test_nodes_with_an_excluded_feature_are_not_harvested(tmp_path):
    from scavenger.slurm_parsing import parse_node_features

    feats = parse_node_features("n1|(null)\nn2|a100,ib\nn2|a100,ib\nn3|debug\nbroken line\n")
    assert feats == {"n1": frozenset(), "n2": {"a100", "ib"}, "n3": {"debug"}}
    slurm, clock = RecordedSlurm([node("n1"), node("n2"), node("n3")], []), Clock()
    slurm.features_ = feats
    svc = _service(tmp_path, slurm, clock, exclude_features=["debug"], exclude_nodes=["n1"])
    svc.spool.post_demand(DemandFile("a", "rlboost:a@0", instances=8, ts=1.0))
    res = svc.run_cycle()
    assert res.excluded_nodes == ["n1", "n3"] and res.pool_gpus == 2 and res.slurm_listings == 4 == slurm.listings


def test_a_runs_tokens_come_from_its_run_directory(tmp_path):
    from rlboost_hpc.rundir import RunDirError
    from scavenger.harvest_report import OwnersReport, add_run_tokens, format_report

    rep = OwnersReport()
    run = tmp_path / "r7"
    run.mkdir()
    add_run_tokens(rep, [str(run)])
    assert rep.by_run["r7"].tokens == 0 and "run r7" in format_report(rep)
    with pytest.raises(RunDirError):
        add_run_tokens(rep, [str(tmp_path / "missing")])
