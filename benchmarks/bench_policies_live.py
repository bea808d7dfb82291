"""Live local demo: RLBoost's adaptive policies vs fixed T_seed + round-robin dispatch, same trace and seed.

(a) default config: adaptive T_seed (η rule + memory), N_prem cap, JSQ with Θ, continuous balancer;
(b) the same without the balancer (``policy.balance=false``);
(c) ablation: fixed T_seed = policy.t_seed_initial_s, no cap, round-robin dispatch, no balancer.
Prints tokens trained per second of each and the ratios to (c), measured in one invocation.

Usage: python benchmarks/bench_policies_live.py [--steps 60] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rlboost_hpc.config import load_config
from rlboost_hpc.run import run

ABLATION = ["policy.adaptive_seeding=false", "policy.cap=false", "policy.dispatch=round_robin", "policy.balance=false"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    out = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    rows = {}
    for i, (name, extra) in enumerate([("RLBoost (+ balancer)", []), ("RLBoost, no balancer", ["policy.balance=false"]),
                                       ("fixed T_seed + round robin", ABLATION)]):
        cfg = load_config(root / "configs/local.toml", [f"trainer.steps={args.steps}", *args.set, *extra])
        rows[name] = run(cfg, out / f"v{i}", progress=False)
    keys = [("throughput_tokens_per_s", "tokens trained/s", "{:,.0f}"), ("train_wall_s", "train wall s", "{:.1f}"),
            ("responses_migrated", "responses migrated", "{}"), ("balancer_moves", "balancer moves", "{}"),
            ("preemptions", "preemptions", "{}"),
            ("reward_heldout_after", "reward after", "{:.3f}")]
    names = list(rows)
    print(f"{'':24}" + "".join(f"{n:>30}" for n in names))
    for k, label, fmt in keys:
        print(f"{label:24}" + "".join(f"{fmt.format(rows[n][k]):>30}" for n in names))
    base = rows[names[-1]]["throughput_tokens_per_s"]
    for n in names[:-1]:
        print(f"ratio ({n} / {names[-1]}) tokens trained/s: {rows[n]['throughput_tokens_per_s'] / base:.3f}")
    print("note: 2 cores shared by trainer, manager and workers; run-to-run spread of this ratio is ~±10%.")


if __name__ == "__main__":
    main()
