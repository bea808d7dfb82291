"""Bounded staleness side by side on live runs: ``rollout.max_staleness`` k = 0 (strict on-policy, the default),
1 and 2 — every variant one ``rlboost-hpc run`` of the same config, seeds and spot-trace replay (the demo's
preemptible workers come and go), interleaved in one invocation, repeated ``--rounds`` times.

Per row: training wall seconds and completion tokens trained per training second; tokens trained per instance-second
(every instance the manager counted: reserved and preemptible, busy + idle + pulling) and the instances' idle
share — what bounded staleness is for: instances keep generating the next steps while the trainer trains; the
staleness of the trained tokens (share made 0 / 1 / 2 versions before the trained one); the importance weights of
the decoupled objective (mean weight, largest ratio, share past the cap); the staleness shares the simulator predicts
for the same run (``sim/calibrate.py``: same trace window, config, measured decode and training rates; "finish" mode
only) and |Δ logprob| engine vs trainer per
staleness; quality — held-out reward before → after (sampled), KL to the reference, repetition rate, and the
steps each variant needs to reach k = 0's final training reward (5-step mean; "—" when never).

On 2 CPU cores the trainer, the reserved engine and the preemptible workers share the same cores, so generation
that overlaps training also slows it: the gain a GPU cluster gets (disjoint devices) is masked here. That is why
the tokens per instance-second and the idle share are printed beside the wall-clock rate.

Then the simulator at paper scale (``--sim-models``, default 8b; two-hour windows of spot segments A, B and C, pooled):
RLBoost with k = 0, 1, 2 and ``1p`` (k = 1 with the paper's T_seed rule and N_prem law instead of the overlap
controller: the ablation) — throughput, tokens per dollar, tokens per instance-second (preemptible instance-seconds
plus the reserved node's GPUs as instances) and the staleness shares.

Then, with ``--collapse-lrs``, too large a k: k = 0 beside k = 8 (four preemptible workers, so tokens get several
versions old) at each learning rate, with the quality gate (KL to the reference < 1 nat/token, repeated 3-grams
< 0.2: ``trainer.gate_max_kl``, ``trainer.gate_max_repetition``).

Run: ``.venv/bin/python benchmarks/bench_staleness.py [--steps 30] [--rounds 1] [--ks 0,1,1c,2] [--sim-models 8b]
[--collapse-lrs 2e-4,1e-3]`` (``1c``: k = 1 with ``rollout.on_new_version = continue``; ``--ks ''`` or
``--sim-models ''`` skips the live or simulator rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def variant(name: str) -> list[str]:
    """``0``, ``1``, ``2`` … (finish) or ``1c`` (continue): the overrides of that variant."""
    k = int(name.rstrip("c"))
    sets = [f"rollout.max_staleness={k}", "trainer.behaviour_correction='tis'"]
    if name.endswith("c"):
        sets.append("rollout.on_new_version='continue'")
    return sets


def simulated_staleness(run_dir: Path) -> dict[int, float]:
    """The simulator's staleness shares for the same run (``sim/calibrate.py``: its trace window, config, measured
    decode and training rates; the simulator models ``on_new_version = "finish"``)."""
    sys.path.insert(0, str(ROOT))
    from rlboost_hpc.sim.calibrate import simulate_run

    got: dict[int, float] = {}
    for row in simulate_run(run_dir)["steps"]:
        for j, n in row["staleness_tokens"].items():
            got[int(j)] = got.get(int(j), 0.0) + n
    tot = sum(got.values()) or 1.0
    return {j: got.get(j, 0.0) / tot for j in range(3)}


def run(out: Path, sets: list[str]) -> tuple[dict, list[dict]]:
    """One ``rlboost-hpc run`` of ``configs/local.toml`` with ``sets``: (report, step records)."""
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"), "--out",
           str(out), "--no-progress"] + [x for s in sets for x in ("--set", s)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"run {out.name} exited {p.returncode}: {p.stderr[-2000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "report.json").read_text()), steps


def figures(r: dict, steps: list[dict]) -> dict:
    """The row's figures from a run's report and step records."""
    inst = {a: sum(s["instance_s"].get(a, 0.0) for s in steps) for a in ("busy", "idle", "pulling")}
    inst_s = sum(inst.values())
    completion = sum(s["response_len_mean"] * s["responses"] for s in steps)
    st = {int(j): n for j, n in r["tokens_by_staleness"].items()} or {0: 1}
    tot = sum(st.values())
    m = r["engine_trainer_mismatch"]
    rewards = [s["reward_mean"] for s in steps]
    return {"train_s": r["train_wall_s"], "completion_tok_per_s": completion / r["train_wall_s"],
            "tok_per_inst_s": completion / inst_s if inst_s else 0.0, "idle_share": inst["idle"] / inst_s if inst_s else 0.0,
            "staleness": {j: st.get(j, 0) / tot for j in range(3)}, "w_mean": m.get("behaviour_weight_mean", 1.0),
            "ratio_max": m.get("behaviour_ratio_max", 1.0), "capped": m.get("mismatch_capped_share", 0.0),
            "diff": {j: m.get(f"logprob_diff_staleness{j}", m.get("logprob_diff", 0.0) if j == 0 else None)
                     for j in range(3)},
            "before": r["reward_heldout_before"], "after": r["reward_heldout_after"],
            "kl": r["kl_to_reference_nats_per_token"], "rep": r["repetition_rate_after"], "rewards": rewards}


def simulated_rows(models: list[str], segments=("A", "B", "C"), duration_s: float = 7200.0) -> list[str]:
    """RLBoost at k = 0, 1, 2 in the simulator at paper scale, pooled over ``segments``: one printed line each."""
    sys.path.insert(0, str(ROOT))
    from rlboost_hpc.sim.profiles import profile
    from rlboost_hpc.sim.simulator import simulate
    from rlboost_hpc.sim.systems import SYSTEMS
    from rlboost_hpc.sim.workload import segment

    lines = [f"{'model':>5} {'k':>2} {'tok/s':>7} {'× k=0':>6} {'tok/$':>8} {'× k=0':>6} {'tok/inst-s':>10} "
             f"{'× k=0':>6} {'stale 0/1/2 %':>14} {'inst':>5}"]
    for m in models:
        base = None
        for k in (0, 1, 2, "1p"):  # 1p: k = 1 with the paper's controller (the ablation of the overlap law)
            spec = SYSTEMS["rlboost" if k == 0 else f"rlboost_k{str(k)[0]}"]
            if k == "1p":
                spec = dataclasses.replace(spec, name="rlboost_k1_paper_controller", overlap_controller=False)
            p = profile(m)
            runs = [simulate(p, spec, segment(g), duration_s=duration_s, seed=0, model_name=m) for g in segments]
            tokens, wall = sum(r.tokens for r in runs), sum(r.wall_s for r in runs)
            cost = sum(r.cost_usd for r in runs)
            inst_s = sum(r.remote_instance_hours * 3600 + p.n_resv_equiv * r.wall_s for r in runs)
            st: dict[int, float] = {}
            for r in runs:
                for row in r.timeline:
                    for j, n in row["staleness_tokens"].items():
                        st[int(j)] = st.get(int(j), 0.0) + n
            tot = sum(st.values()) or 1.0
            fig = (tokens / wall, tokens / cost, tokens / inst_s)
            base = base or fig
            lines.append(f"{m:>5} {k:>2} {fig[0]:7.0f} {fig[0] / base[0]:6.2f} {fig[1]:8.0f} {fig[1] / base[1]:6.2f} "
                         f"{fig[2]:10.1f} {fig[2] / base[2]:6.2f} "
                         f"{'/'.join(f'{100 * st.get(j, 0.0) / tot:.0f}' for j in range(3)):>14} "
                         f"{sum(r.remote_instance_hours * 3600 for r in runs) / wall:5.1f}")
    return lines


def steps_to(rewards: list[float], target: float, window: int = 5) -> int | None:
    """The first step whose ``window``-step mean training reward reaches ``target`` (None: never)."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1:i + 1]) / window >= target:
            return i + 1
    return None


HEADER = (f"{'k':>3} {'train s':>7} {'tok/s':>6} {'tok/inst-s':>10} {'idle':>5} {'stale 0/1/2 %':>14} {'sim':>10} "
          f"{'w mean':>6} {'ρ max':>5} {'>cap %':>6} {'|Δ| s0/s1/s2':>20} {'reward before→after':>19} "
          f"{'KL ref':>6} {'rep':>5} {'steps to k0':>11}")


def row(name: str, f: dict, target: float) -> str:
    st = "/".join(f"{100 * f['staleness'][j]:.0f}" for j in range(3))
    sim = "—" if f["sim_staleness"] is None else "/".join(f"{100 * f['sim_staleness'][j]:.0f}" for j in range(3))
    diff = "/".join("—" if f["diff"][j] is None else f"{f['diff'][j]:.4f}" for j in range(3))
    reach = steps_to(f["rewards"], target)
    return (f"{name:>3} {f['train_s']:7.1f} {f['completion_tok_per_s']:6.0f} {f['tok_per_inst_s']:10.1f} "
            f"{100 * f['idle_share']:4.0f}% {st:>14} {sim:>10} {f['w_mean']:6.3f} {f['ratio_max']:5.2f} "
            f"{100 * f['capped']:6.2f} {diff:>20} {f['before']:8.3f} → {f['after']:5.3f}    {f['kl']:6.4f} "
            f"{f['rep']:5.3f} {'—' if reach is None else reach:>11}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ks", default="0,1,1c,2", help="comma-separated variants: k, or kc for on_new_version=continue")
    ap.add_argument("--steps", type=int, default=30, help="RL steps of each run")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (each runs every variant once)")
    ap.add_argument("--seed", type=int, default=0, help="trainer.seed and cluster.seed")
    ap.add_argument("--sim-models", default="8b", help="comma-separated simulator profiles ('' skips)")
    ap.add_argument("--collapse-lrs", default="", help="comma-separated learning rates: k = 0 beside k = 8 (four "
                    "workers, 40 steps) at each, with the quality gate ('' skips)")
    a = ap.parse_args(argv)
    names = [k for k in a.ks.split(",") if k]
    tmp = Path(tempfile.mkdtemp(prefix="rlboost-staleness-"))
    common = [f"trainer.seed={a.seed}", f"cluster.seed={a.seed}", "trainer.export_model=false",
              f"trainer.steps={a.steps}"]
    if names:
        live_rows(a, names, tmp, common)
    lrs = [x for x in a.collapse_lrs.split(",") if x]
    if lrs:
        print("\n" + "\n".join(collapse_rows(lrs, tmp, common[:3])))
    models = [m for m in a.sim_models.split(",") if m]
    if models:
        print("\n## the simulator at paper scale: RLBoost, 2 h windows of segments A, B, C pooled, seed 0")
        print("\n".join(simulated_rows(models)))
    return 0


def collapse_rows(lrs: list[str], tmp: Path, common: list[str]) -> list[str]:
    """k = 0 and k = 8 (four preemptible workers, so tokens get several versions old) at each learning rate, 40
    steps: held-out reward, KL to the reference, repeated 3-grams, the quality gate and the oldest staleness trained."""
    lines = ["## too large a k: k = 0 beside k = 8 (4 workers, 40 steps) by learning rate",
             f"{'lr':>7} {'k':>2} {'reward after':>12} {'KL ref':>7} {'rep':>6} {'gate':>5} {'max stale':>9} "
             f"{'stale ≥ 3 %':>11}"]
    for lr in lrs:
        for k in (0, 8):
            r, _ = run(tmp / f"collapse-{lr}-k{k}", common + [f"trainer.lr={lr}", "trainer.steps=40",
                                                           "cluster.max_workers=4"] + variant(str(k)))
            st = {int(j): n for j, n in r["tokens_by_staleness"].items()} or {0: 1}
            old = sum(n for j, n in st.items() if j >= 3) / sum(st.values())
            lines.append(f"{lr:>7} {k:>2} {r['reward_heldout_after']:12.3f} {r['kl_to_reference_nats_per_token']:7.3f} "
                         f"{r['repetition_rate_after']:6.3f} {'pass' if r['quality_gate_passed'] else 'FAIL':>5} "
                         f"{max(st):>9} {100 * old:10.0f}%")
    return lines


def live_rows(a, names: list[str], tmp: Path, common: list[str]) -> None:
    """The live demo rows: every variant of ``names`` once per round, interleaved; printed with ratios to k = 0."""
    results: dict[str, list[dict]] = {n: [] for n in names}
    t0 = time.monotonic()
    for rnd in range(a.rounds):
        for n in names:
            r, steps = run(tmp / f"r{rnd}-k{n}", common + variant(n))
            results[n].append(figures(r, steps))
            results[n][-1]["sim_staleness"] = None if n.endswith("c") else simulated_staleness(tmp / f"r{rnd}-k{n}")
    ref = results.get("0") or results[names[0]]
    print(f"## demo, {a.steps} steps, seed {a.seed}, {a.rounds} round(s) interleaved ({time.monotonic() - t0:.0f} s)")
    print(HEADER)
    for rnd in range(a.rounds):
        rw = ref[rnd]["rewards"]
        target = sum(rw[-5:]) / min(5, len(rw))
        for n in names:
            print(row(n, results[n][rnd], target))
    base = sum(f["completion_tok_per_s"] for f in ref) / len(ref)
    base_i = sum(f["tok_per_inst_s"] for f in ref) / len(ref)
    print("ratios to k = 0 (mean over rounds): " + ", ".join(
        f"k={n}: {sum(f['completion_tok_per_s'] for f in fs) / len(fs) / base:.2f}× tok/s, "
        f"{sum(f['tok_per_inst_s'] for f in fs) / len(fs) / base_i:.2f}× tok/inst-s" for n, fs in results.items()))


if __name__ == "__main__":
    raise SystemExit(main())
