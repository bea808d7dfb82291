"""Simulator behaviour: determinism, speed, exactly-once, fallback, the paper table and ablation ordering."""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest

from rlboost_hpc.cluster.traces import TraceEvent
from rlboost_hpc.sim.cli import main as sim_main
from rlboost_hpc.sim.engine import Engine, Req
from rlboost_hpc.sim.experiments import preemption_overhead
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.sim.simulator import simulate
from rlboost_hpc.sim.systems import COLOCATED, RLBOOST, SYSTEMS
from rlboost_hpc.sim.table import paper_table
from rlboost_hpc.sim.workload import Availability, availability, segment, step_work

P8 = profile("8b")


# ---------------------------------------------------------------------------------------------- engine


def test_engine_fluid_decode_matches_token_by_token_stepping():
    """The closed-form advance equals summing t_iter over individual iterations (to < 0.1%)."""
    perf = P8.instance_perf()
    done: list = []
    e = Engine("e", "remote", perf, lambda r, t: done.append((r.rid, t)))
    lens = [(300, 50), (500, 120), (200, 400)]
    for i, (p, n) in enumerate(lens):
        e.take(Req(i, 0, p, n))
    e.admit(0.0)
    t_pf = e.t
    # reference: token stepping with the same prefill stall
    t, ctx, left, ref = t_pf, [p for p, _ in lens], [n for _, n in lens], {}
    while any(x > 0 for x in left):
        live = [i for i in range(3) if left[i] > 0]
        t += perf.iter_time(len(live), sum(ctx[i] for i in live))
        for i in live:
            ctx[i] += 1
            left[i] -= 1
            if left[i] == 0:
                ref[i] = t
    while e.B:
        e.on_event(e.next_event())
    got = dict(done)
    for i in ref:
        assert got[i] == pytest.approx(ref[i], rel=1e-3)


def test_engine_retracts_when_kv_cache_fills_and_keeps_tokens():
    perf = replace(P8.instance_perf(), kv_capacity=4000.0, reserve_tokens=0.0)
    done: list = []
    e = Engine("e", "remote", perf, lambda r, t: done.append(r.rid))
    for i in range(4):
        e.take(Req(i, 0, 500, 1500))
    e.admit(0.0)
    assert e.B == 4  # 2000 tokens of context fit
    t = e.next_event()
    e.on_event(t)     # KV full: the requests with the fewest tokens go back to waiting
    assert e.B < 4 and e.waiting
    assert all(r.n > 0 for r in e.waiting)
    steps = 0
    while e.B or e.waiting:
        e.on_event(e.next_event())
        steps += 1
        assert steps < 1000
    assert sorted(done) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- runs


def test_simulation_is_deterministic():
    a = simulate(P8, RLBOOST, segment("B"), duration_s=3600.0)
    b = simulate(P8, RLBOOST, segment("B"), duration_s=3600.0)
    assert a.timeline == b.timeline
    assert (a.tokens, a.cost_usd, a.events) == (b.tokens, b.cost_usd, b.events)


def test_workload_is_identical_across_systems_and_bounded():
    w = step_work(P8.workload, 0, 3)
    assert len(w.response) == 128 * 8
    assert w.response.max() <= P8.workload.max_response and w.response.min() >= P8.workload.min_response
    assert (step_work(P8.workload, 0, 3).response == w.response).all()


def test_twelve_hour_trace_simulates_in_under_a_minute():
    av = availability("p3", 0.0, 43200.0)
    t0 = time.perf_counter()
    r = simulate(P8, RLBOOST, av, duration_s=43200.0)
    wall = time.perf_counter() - t0
    assert r.wall_s >= 43200.0 and r.steps > 100
    assert wall < 60.0, f"12-hour trace took {wall:.1f} s"


def test_zero_preemptible_instances_falls_back_to_colocated_without_stalling():
    co = simulate(P8, COLOCATED, None, duration_s=3600.0)
    rl = simulate(P8, RLBOOST, Availability.none(), duration_s=3600.0)
    assert rl.steps >= co.steps - 1
    assert rl.throughput == pytest.approx(co.throughput, rel=0.1)
    assert rl.remote_usd == 0.0


def test_total_outage_mid_step_reopens_reserved_rollout():
    """Every remote instance vanishes while the trainer waits: the reserved GPUs go back to rollout."""
    base = simulate(P8, RLBOOST, Availability.fixed(2), max_steps=3, duration_s=1e9)
    s1 = base.timeline[1]
    t_rm = s1["t_start"] + P8.switch_to_rollout_s + s1["t_seed_s"] + P8.switch_to_train_s + 20.0
    assert s1["t_start"] + s1["rollout_s"] > t_rm + 30  # the rollout is still running then
    names = Availability.fixed(2).initial
    av = Availability(names, (TraceEvent(t_rm, "remove", names[0]), TraceEvent(t_rm, "remove", names[1]),
                              TraceEvent(t_rm + 1500.0, "add", "late")), "outage")
    r = simulate(P8, RLBOOST, av, max_steps=4, duration_s=1e9)
    assert r.counters["fallbacks"] >= 1
    co = simulate(P8, COLOCATED, None, max_steps=3, duration_s=1e9)
    assert r.timeline[1]["step_s"] < 1.5 * max(s["step_s"] for s in co.timeline)


def test_instance_arriving_mid_step_takes_work_in_that_step():
    av = Availability((), (TraceEvent(60.0, "add", "newcomer"),), "join")
    r = simulate(P8, RLBOOST, av, max_steps=1, duration_s=1e9)
    assert r.timeline[0]["n_remote"] == 1
    assert r.timeline[0]["seeds"] > 0


def test_recompute_ablation_regenerates_tokens_migration_does_not():
    mig = simulate(P8, RLBOOST, segment("A"), duration_s=7200.0)
    rec = simulate(P8, SYSTEMS["rlboost_recompute"], segment("A"), duration_s=7200.0)
    assert mig.counters["preemptions"] > 0 and rec.counters["preemptions"] > 0
    assert mig.counters["tokens_regenerated"] == 0 and mig.counters["tokens_migrated"] > 0
    assert rec.counters["tokens_regenerated"] > 0


def test_migration_cuts_preemption_overhead_more_later_in_the_step():
    res = preemption_overhead("8b", at_s=(100.0, 200.0))
    for at, v in res.items():
        assert v["migration_overhead_s"] < v["recompute_overhead_s"], at
    assert res[200.0]["reduction"] > res[100.0]["reduction"]


# ---------------------------------------------------------------------------------------------- table


@pytest.fixture(scope="module")
def small_table():
    return paper_table(models=("8b",), segments=("A",), duration_s=3600.0)


def test_paper_table_has_keys_per_model_and_system(small_table):
    entry = small_table["8b"]
    for s in ("colocated", "verl_2x", "disaggregated", "rlboost", "rlboost_no_seeding", "rlboost_no_memory",
              "rlboost_recompute", "rlboost_round_robin", "rlboost@fixed4"):
        assert "throughput_ratio_vs_colocated" in entry[s]
        assert "cost_efficiency_ratio_vs_colocated" in entry[s]
        assert math.isfinite(entry[s]["throughput_ratio_vs_colocated"])
    assert entry["colocated"]["throughput_ratio_vs_colocated"] == 1.0
    assert "meta" in small_table and "targets" in small_table["meta"]


def test_ablation_ordering(small_table):
    e = small_table["8b"]
    ratio = lambda s: e[s]["throughput_ratio_vs_colocated"]  # noqa: E731
    assert ratio("rlboost") > 1.3                      # harvesting spot capacity pays
    assert e["rlboost"]["cost_efficiency_ratio_vs_colocated"] > 1.1
    assert ratio("rlboost@fixed4") > ratio("rlboost_no_seeding@fixed4")  # seeding matters on a fixed pool
    assert ratio("rlboost") > ratio("rlboost_fixed_seed")                # adapting T_seed matters
    assert e["rlboost"]["tokens_per_dollar"] > e["rlboost_no_cap"]["tokens_per_dollar"]  # the cap saves money
    assert e["rlboost"]["tokens_per_dollar"] > e["disaggregated"]["tokens_per_dollar"]
    assert e["verl_2x"]["cost_efficiency_ratio_vs_colocated"] < 1.0


def test_bounded_staleness_rows_overlap_rollout_with_training_and_never_exceed_k(small_table):
    """Issue 34: k = 1 and 2 beside RLBoost — more throughput at the same prices (the pool never waits for the
    trainer), every step trained exactly once (the simulator asserts it), no token more than k versions old."""
    e = small_table["8b"]
    assert e["rlboost_k1"]["throughput_tokens_per_s"] > 1.2 * e["rlboost"]["throughput_tokens_per_s"]
    assert e["rlboost_k2"]["throughput_tokens_per_s"] >= e["rlboost_k1"]["throughput_tokens_per_s"]
    for k in (0, 1, 2):
        spec = SYSTEMS["rlboost"] if k == 0 else SYSTEMS[f"rlboost_k{k}"]
        r = simulate(profile("8b"), spec, segment("A"), duration_s=3600.0, seed=0)
        stale = {int(j) for row in r.timeline for j, n in row["staleness_tokens"].items() if n > 0}
        assert max(stale) == k and min(stale) >= 0, (k, stale)


def test_cli_paper_table_json(capsys):
    rc = sim_main(["--paper-table", "--json", "--models", "8b", "--segments", "A", "--duration", "1800"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["8b"]["rlboost"]["throughput_ratio_vs_colocated"] > 1.0
    assert "cost_efficiency_ratio_vs_colocated" in out["8b"]["colocated"]


def test_cli_single_run_writes_timeline_and_plot(tmp_path, capsys):
    tl, png = tmp_path / "tl.jsonl", tmp_path / "run.png"
    rc = sim_main(["--model", "8b", "--trace", "parcae-ll", "--duration", "1800", "--keep-every", "1",
                   "--timeline", str(tl), "--plot", str(png)])
    assert rc == 0
    recs = [json.loads(line) for line in tl.read_text().splitlines()]
    assert recs and {"t_seed_s", "n_start", "cap_next", "t_wait_train_s"} <= set(recs[0])
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["--system", "nope"], ["--model", "99b"], ["--trace", "no/such/trace.csv"]])
def test_cli_bad_input_exits_2(argv, capsys):
    assert sim_main(argv + ["--duration", "600"]) == 2
    assert "rlboost-hpc simulate:" in capsys.readouterr().err
