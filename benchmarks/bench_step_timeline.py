"""Benchmark: where a step's wall time goes, and the fixed overhead per step, side by side across variants.

Runs ``rlboost_hpc.run.run`` once per variant in this process (``configs/local.toml`` plus the variant's ``--set``
overrides, same seed), then prints per variant: seconds per step, the fixed overhead per step (seconds in which no
engine generated and the trainer did not compute) and its share, the mean seconds per phase, and each variant's
overhead ÷ the first variant's.

Variants (``--variants``, comma-separated; default ``demo,demo-sync-checkpoint,demo-no-checkpoint``):

* ``demo``: the default demo step (8 prompts × 8 responses, 48 new tokens), checkpoints written in the background;
* ``demo-sync-checkpoint``: the same with each checkpoint written before the next step starts;
* ``demo-no-checkpoint``: the same with ``trainer.checkpoint_every=0`` (what the per-step checkpoint costs);
* ``paper``: a paper-like step (32 prompts × 8, 256 new tokens, ``cluster.replay_s=400``), ``--paper-steps`` steps.

Run: ``.venv/bin/python benchmarks/bench_step_timeline.py [--steps 20] [--variants demo,paper] [--set k=v ...]``
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.config import load_config  # noqa: E402
from rlboost_hpc.observe.logs import setup_logging  # noqa: E402
from rlboost_hpc.observe.timeline import Phase  # noqa: E402
from rlboost_hpc.run import run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "demo": [],
    "demo-sync-checkpoint": ["trainer.checkpoint_background=false"],
    "demo-no-checkpoint": ["trainer.checkpoint_every=0"],
    "paper": ["rollout.prompts_per_step=32", "rollout.max_new_tokens=256", "cluster.replay_s=400"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per demo variant (default 20)")
    ap.add_argument("--paper-steps", type=int, default=4, help="steps of the paper-like variant (default 4)")
    ap.add_argument("--variants", default="demo,demo-sync-checkpoint,demo-no-checkpoint")
    ap.add_argument("--config", default=str(ROOT / "configs/local.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    ap.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    args = ap.parse_args()
    setup_logging("bench", level="WARNING")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-timeline-"))
    rows = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            sys.exit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        steps = args.paper_steps if name == "paper" else args.steps
        cfg = load_config(args.config, [f"trainer.steps={steps}", *VARIANTS[name], *args.set])
        rep = run(cfg, out / name, progress=False)
        rows.append((name, rep))
        print(f"  {name}: {rep['steps']} steps, {rep['train_wall_s'] / rep['steps']:.3f} s/step, fixed overhead "
              f"{rep['fixed_overhead_s_per_step']:.4f} s/step ({out / name})", flush=True)
    base = rows[0][1]["fixed_overhead_s_per_step"]
    print(f"\n{'variant':<20} {'s/step':>8} {'overhead s/step':>16} {'share':>7} {'÷ ' + rows[0][0]:>12}")
    for name, rep in rows:
        o = rep["fixed_overhead_s_per_step"]
        print(f"{name:<20} {rep['train_wall_s'] / rep['steps']:>8.3f} {o:>16.4f} {rep['fixed_overhead_share']:>7.1%} "
              f"{(o / base if base > 0 else float('nan')):>12.2f}")
    print(f"\nmean seconds per step by phase (of which fixed overhead)\n{'phase':<20}"
          + "".join(f"{n:>26}" for n, _ in rows))
    for p in Phase:
        vals = [(rep["step_phase_s_mean"].get(p.value), rep["fixed_overhead_s_by_phase"].get(p.value, 0.0))
                for _, rep in rows]
        if any(v is not None for v, _ in vals):
            print(f"{p.value:<20}" + "".join(f"{(v or 0.0):>16.4f} ({o:.4f})" for v, o in vals))
    logging.shutdown()


if __name__ == "__main__":
    main()
