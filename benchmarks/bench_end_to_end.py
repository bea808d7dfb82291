"""Benchmark: the local demo run end to end, with vs without the preemptible workers.

Runs ``rlboost_hpc.run.run(cfg, out_dir, progress=False)`` twice in this process, same seed and config
(``configs/local.toml`` plus ``--set`` overrides, ``trainer.steps`` = ``--steps``):

(a) as configured: the reserved engine seeds each step, then hands unfinished responses to preemptible worker
    processes replaying the spot trace (preemptions, migrations);
(b) reserved side only: ``cluster.max_workers=0`` — no worker processes, the reserved engine generates
    everything (the co-located fallback).

Prints, per run: tokens trained per second (the report's ``throughput_tokens_per_s`` = tokens trained /
training wall time), wall seconds, responses migrated, preemptions, held-out reward before/after, the CPU
seconds used by this process and by its reaped children (manager, workers), and the ratio (a)/(b).

Caveat printed with the table: on a machine with few cores (``os.sched_getaffinity``) the worker processes,
the manager and the trainer all compete for the same CPUs, so (a) measures the protocol's overhead and the
trace's disruption more than any offload gain; the gain RLBoost targets needs rollout capacity that does not
share the trainer's cores.

Run: ``.venv/bin/python benchmarks/bench_end_to_end.py [--steps 20] [--config configs/local.toml]
[--set key=value ...] [--out DIR] [--only a|b]``
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.config import load_config  # noqa: E402
from rlboost_hpc.observe.logs import setup_logging  # noqa: E402
from rlboost_hpc.run import run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def one_run(name: str, config: str, overrides: list[str], out: Path) -> dict:
    cfg = load_config(config, overrides)
    r0s, r0c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    report = run(cfg, out, progress=False)
    elapsed = time.monotonic() - t0
    r1s, r1c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report["_cpu_self_s"] = (r1s.ru_utime + r1s.ru_stime) - (r0s.ru_utime + r0s.ru_stime)
    report["_cpu_children_s"] = (r1c.ru_utime + r1c.ru_stime) - (r0c.ru_utime + r0c.ru_stime)
    report["_elapsed_s"] = elapsed
    report["_load"] = (load0, os.getloadavg()[0])
    report["_name"] = name
    report["_out"] = str(out)
    report["_max_workers"] = cfg.cluster.max_workers
    print(f"  {name}: {report['throughput_tokens_per_s']:,.0f} tokens trained/s in {report['train_wall_s']:.1f} s "
          f"of training ({out})", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.toml"))
    ap.add_argument("--steps", type=int, default=20, help="trainer.steps of both runs")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for both runs (repeatable)")
    ap.add_argument("--out", default=None, help="directory for the two run directories (default: a temp dir)")
    ap.add_argument("--only", choices=["a", "b"], default=None, help="run only one of the two")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args()
    setup_logging("bench", level=args.log_level)
    logging.getLogger().setLevel(args.log_level)
    os.environ.setdefault("RLBOOST_LOG_LEVEL", args.log_level)  # spawned manager / worker processes
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlboost-e2e-"))
    common = [*args.overrides, f"trainer.steps={args.steps}"]
    ncpu = len(os.sched_getaffinity(0))
    cfg_a = load_config(args.config, common)
    print(f"config {args.config}, steps={args.steps}, seed={cfg_a.trainer.seed}, "
          f"{cfg_a.rollout.prompts_per_step}×{cfg_a.rollout.group_size} responses/step, max_new_tokens="
          f"{cfg_a.rollout.max_new_tokens}, T_seed={cfg_a.policy.t_seed_initial_s} s, preemptible workers ≤ "
          f"{cfg_a.cluster.max_workers}; {ncpu} CPU cores; load average {os.getloadavg()[0]:.2f}")
    runs = []
    if args.only in (None, "a"):
        runs.append(one_run("(a) reserved + preemptible", args.config, common, base / "a_preemptible"))
    if args.only in (None, "b"):
        runs.append(one_run("(b) reserved only", args.config, [*common, "cluster.max_workers=0"],
                            base / "b_reserved_only"))

    cols = [
        ("tokens trained/s", lambda r: f"{r['throughput_tokens_per_s']:,.0f}"),
        ("tokens trained", lambda r: f"{r['tokens_trained']:,}"),
        ("train wall s", lambda r: f"{r['train_wall_s']:.1f}"),
        ("wall s", lambda r: f"{r['wall_s']:.1f}"),
        ("max workers", lambda r: f"{r['_max_workers']}"),
        ("worker starts", lambda r: f"{r['worker_starts']}"),
        ("preemptions", lambda r: f"{r['preemptions']}"),
        ("responses migrated", lambda r: f"{r['responses_migrated']:,}"),
        ("tokens regenerated", lambda r: f"{r['tokens_regenerated']:,}"),
        ("responses lost", lambda r: f"{r['responses_lost']}"),
        ("reward before", lambda r: f"{r['reward_heldout_before']:.3f}"),
        ("reward after", lambda r: f"{r['reward_heldout_after']:.3f}"),
        ("CPU s: trainer proc", lambda r: f"{r['_cpu_self_s']:.1f}"),
        ("CPU s: children", lambda r: f"{r['_cpu_children_s']:.1f}"),
        ("load avg start→end", lambda r: f"{r['_load'][0]:.1f}→{r['_load'][1]:.1f}"),
    ]
    w0 = max(len(c[0]) for c in cols)
    w = max(28, *(len(r["_name"]) for r in runs))
    print(f"\n== end to end: {args.steps} steps each, same seed ==")
    print(f"{'':<{w0}}  " + "  ".join(f"{r['_name']:>{w}}" for r in runs) + ("  (a)/(b)" if len(runs) == 2 else ""))
    for label, fmt in cols:
        line = f"{label:<{w0}}  " + "  ".join(f"{fmt(r):>{w}}" for r in runs)
        if len(runs) == 2 and label in ("tokens trained/s", "train wall s", "wall s", "tokens trained"):
            key = {"tokens trained/s": "throughput_tokens_per_s", "train wall s": "train_wall_s", "wall s": "wall_s",
                   "tokens trained": "tokens_trained"}[label]
            b = runs[1][key]
            line += f"  {runs[0][key] / b:.3f}" if b else "  n/a"
        print(line)
    print(f"\nCaveat: this machine has {ncpu} CPU core(s). In (a) the preemptible worker processes (each a CPU torch "
          "engine), the manager process and the trainer\n(which also hosts the reserved engine and the weight server) "
          "all share those cores, so (a) mostly measures the protocol's overhead and the spot\ntrace's disruption "
          "(preemptions, migrations, weight pulls), not the offload gain RLBoost targets — that needs rollout "
          "capacity that does not\nshare the trainer's CPUs. CPU s: children = manager + worker processes (reaped).")
    if len(runs) == 2:
        a, b = runs
        if a["tokens_trained"] == b["tokens_trained"] and a["reward_heldout_after"] == b["reward_heldout_after"]:
            print("(a) and (b) trained the same number of tokens and reached the same held-out reward: sampling is seeded "
                  "per response, so where a response was\ngenerated (and whether it migrated) did not change what was "
                  "trained — the runs differ only in time.")
        else:
            print("(a) and (b) trained different tokens / reached different rewards: the rollouts differed between "
                  "the runs (placement changed the samples).")
        replay_s = load_config(args.config, common).cluster.replay_s
        if a["wall_s"] < replay_s:
            print(f"Run (a) lasted {a['wall_s']:.0f} s of the {replay_s:.0f} s trace window, so only part of the "
                  "window's preemptions happened; raise --steps to replay all of it.")
    print(f"Run directories: {base}")


if __name__ == "__main__":
    main()
