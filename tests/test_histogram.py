"""Bounded distributions (``observe/histogram.py``) and the manager's scrape that uses them (issue 29 item 4: a
week-long run's memory and scrape time stay bounded)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rlboost_hpc.manager.core import ManagerCore
from rlboost_hpc.observe.histogram import PULL_BUCKETS_S, Histogram
from rlboost_hpc.observe.metrics import ManagerMetrics
from rlboost_hpc.protocol import messages as M


def test_buckets_are_prometheus_le_buckets_and_the_quantile_is_a_bucket_bound():
    h = Histogram((1.0, 2.0, 5.0))
    for x in (0.5, 1.0, 1.5, 2.0, 4.0, 9.0):
        h.observe(x)
    assert h.cumulative() == [("1.0", 2), ("2.0", 4), ("5.0", 5), ("+Inf", 6)]  # 1.0 ≤ le="1.0"
    assert h.count == 6 and h.total == pytest.approx(18.0) and h.mean() == pytest.approx(3.0)
    assert h.quantile_bound(0.5) == 2.0 and h.quantile_bound(5 / 6) == 5.0 and h.quantile_bound(1.0) == float("inf")
    c = h.copy()
    h.observe(0.1)
    assert c.count == 6 and h.count == 7
    assert Histogram((1.0,)).quantile_bound(0.99) == 0.0 and Histogram((1.0,)).mean() == 0.0


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_increase(bounds):
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(bounds)


def _scrape(core: ManagerCore) -> bytes:
    mm = ManagerMetrics("r")
    reg = CollectorRegistry()
    reg.register(mm)
    mm.refresh(core)
    return generate_latest(reg)


def test_a_scrape_after_a_hundred_thousand_pulls_is_as_large_as_after_ten():
    """Regression: the manager kept every weight pull's and every step's duration in a list, copied the lists at
    each scrape and counted them once per bucket — memory and scrape time grew with the run (a week-long run makes
    ~10^6 pulls). Now each is a bounded histogram, and the buckets are the same counts as before."""
    def core_after(pulls: int) -> ManagerCore:
        core = ManagerCore(clock=lambda: 0.0)
        core.on_message(b"t", M.TrainerHello(weights_endpoint="tcp://w:1", model_config={}))
        core.on_message(b"t", M.SetVersion(version=0))
        core.on_message(b"i", M.Register(job_id="j", attempt=0, kind="preemptible", max_batch=4))
        for k in range(pulls):
            core.on_message(b"i", M.WeightsLoaded(version=0, checksum=0, nbytes=1, pull_s=0.03 if k % 10 else 7.0,
                                                  load_s=0.0))
            if k % 10 == 0:
                core.on_message(b"t", M.StepTimes(step=k, wall_s=40.0, phases={}, fixed_overhead_s=0.0))
        return core

    small, large = core_after(10), core_after(100_000)
    text_small, text_large = _scrape(small), _scrape(large)
    assert len(large.dist.pull_seconds.counts) == len(PULL_BUCKETS_S) + 1
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text_large.decode().splitlines()
             if ln.startswith(("rlboost_weight_pull_duration_seconds", "rlboost_step_duration_seconds"))}
    assert lines['rlboost_weight_pull_duration_seconds_bucket{le="0.05",run="r"}'] == 90_000
    assert lines['rlboost_weight_pull_duration_seconds_bucket{le="10.0",run="r"}'] == 100_000
    assert lines['rlboost_weight_pull_duration_seconds_count{run="r"}'] == 100_000
    assert lines['rlboost_step_duration_seconds_bucket{le="30.0",run="r"}'] == 0
    assert lines['rlboost_step_duration_seconds_count{run="r"}'] == 10_000
    assert abs(len(text_large) - len(text_small)) < 200  # the same series; only digits differ
