"""GRPO objective options side by side on real runs: held-out reward after training for each loss aggregation
(GRPO's per-sequence token mean, DAPO's token mean, Dr. GRPO's constant normaliser) and the engine–trainer mismatch
with and without importance correction (``trainer.behaviour_correction``) — every variant one ``rlboost-hpc run``
of the same config, seeds and spot-trace replay, measured in one invocation.

Configs:
- ``demo``: ``configs/local.toml`` (stories260K learns to write dialogue; 60 steps by default). The weights travel
  to the engines in bf16 (``weights.dtype``) and the engines compute in fp32 on the CPU while the trainer keeps fp32
  master weights: that is the mismatch measured.
- ``qwen3``: a tiny random Qwen3 (the tests' checkpoint: vocabulary 512, hidden 64, 2 layers, chat template) on
  GSM8K (``task.name = gsm8k``); random weights earn no GSM8K reward, so its rows show the mechanics (mismatch,
  truncation, KL), not learning. Fewer steps and prompts by default (``--qwen3-steps``).

Variants: ``grpo`` (the defaults), ``dapo`` (token_mean), ``dr_grpo_norm`` (seq_mean_token_sum_norm), ``dr_grpo`` (and
no std), ``tis`` / ``mis`` (behaviour correction), ``bf16_engine`` / ``bf16_engine_tis`` (the rollout engines compute in
bf16, ``rollout.dtype``: a larger mismatch, without and with TIS).

Per row: held-out reward before → after (sampled; greedy after), KL to the reference (trainer.kl_estimator), the share
of responses truncated, the mismatch means over the steps (|Δ logprob| mean and largest, k3 KL(engine ‖ trainer),
share of ratios outside the clip band, share past the cap) and wall seconds.

Run: ``.venv/bin/python benchmarks/bench_grpo_options.py [--configs demo,qwen3] [--steps 60] [--qwen3-steps 20]
[--variants grpo,dapo,dr_grpo_norm,dr_grpo,tis,bf16_engine,bf16_engine_tis]``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: variant → its overrides of the config (defaults: GRPO with seq_mean_token_mean, std-normalised advantages, k3).
VARIANTS = {
    "grpo": [],
    "dapo": ["trainer.loss_aggregation='token_mean'"],
    "dr_grpo_norm": ["trainer.loss_aggregation='seq_mean_token_sum_norm'"],
    "dr_grpo": ["trainer.loss_aggregation='seq_mean_token_sum_norm'", "trainer.advantage_std_norm=false"],
    "tis": ["trainer.behaviour_correction='tis'"],
    "mis": ["trainer.behaviour_correction='mis'"],
    # bf16 engines (CPU bf16 compute as a GPU engine would): a larger mismatch, without and with correction
    "bf16_engine": ["rollout.dtype='bfloat16'"],
    "bf16_engine_tis": ["rollout.dtype='bfloat16'", "trainer.behaviour_correction='tis'"],
}


def qwen3_dir(root: Path) -> Path:
    """The tests' tiny random Qwen3 checkpoint (built once into ``root``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import make_model_dir  # the tests' checkpoint maker (a dev tool, not the product)

    d = root / "tiny-qwen3"
    return d if (d / "config.json").exists() else make_model_dir(d, "qwen3", tied=False)


def run(out: Path, sets: list[str]) -> tuple[dict, list[dict], float]:
    """One ``rlboost-hpc run`` with ``configs/local.toml`` and ``sets``: (report, step records, wall seconds)."""
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"), "--out",
           str(out), "--no-progress"] + [x for s in sets for x in ("--set", s)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"run {out.name} exited {p.returncode}: {p.stderr[-2000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "report.json").read_text()), steps, wall


def row(name: str, r: dict, wall: float) -> str:
    m = r["engine_trainer_mismatch"]
    return (f"{name:14} {r['reward_heldout_before']:6.3f} → {r['reward_heldout_after']:5.3f} "
            f"{r['reward_heldout_greedy_after']:6.3f} {r['kl_to_reference_nats_per_token']:7.4f} "
            f"{100 * r['truncated_share']:6.1f}% {m['logprob_diff']:8.4f} {m['logprob_diff_max']:7.3f} "
            f"{m['mismatch_kl']:9.2e} {100 * m['mismatch_outside_clip_share']:7.3f}% "
            f"{100 * m['mismatch_capped_share']:7.3f}% {wall:6.0f}")


HEADER = (f"{'variant':14} {'reward before → after':>21} {'greedy':>6} {'KL ref':>7} {'trunc.':>7} "
          f"{'mean |Δ|':>8} {'max |Δ|':>7} {'k3 KL':>9} {'∉ clip':>8} {'> cap':>8} {'wall s':>6}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default="demo,qwen3", help="comma-separated: demo, qwen3")
    ap.add_argument("--variants", default="grpo,dapo,dr_grpo_norm,dr_grpo,tis,bf16_engine,bf16_engine_tis",
                    help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=60, help="RL steps of the demo runs")
    ap.add_argument("--qwen3-steps", type=int, default=20, help="RL steps of the tiny-Qwen3 GSM8K runs")
    ap.add_argument("--seed", type=int, default=0, help="trainer.seed and cluster.seed")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    tmp = Path(tempfile.mkdtemp(prefix="rlboost-grpo-options-"))
    common = [f"trainer.seed={a.seed}", f"cluster.seed={a.seed}", "trainer.export_model=false"]
    configs = {"demo": [f"trainer.steps={a.steps}"]}
    if "qwen3" in a.configs.split(","):
        configs["qwen3"] = [f"model.path='{qwen3_dir(tmp)}'", "task.name='gsm8k'", f"trainer.steps={a.qwen3_steps}",
                            "task.train_prompts=64", "task.heldout_prompts=16", "rollout.prompts_per_step=4",
                            "rollout.max_new_tokens=64", "trainer.eval_samples=2", "trainer.lr=1e-4"]
    for cfg in [c for c in a.configs.split(",") if c]:
        print(f"\n## {cfg}: {' '.join(configs[cfg])} (seed {a.seed})")
        print(HEADER)
        for v in variants:
            r, _, wall = run(tmp / f"{cfg}-{v}", common + configs[cfg] + VARIANTS[v])
            print(row(v, r, wall), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
