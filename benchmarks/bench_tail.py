"""The step's tail on heterogeneous GPUs, continuous balancing on vs off (issue 29 item 7), on emulated instances.

Each point is one real ``rlboost-hpc run`` (trainer, manager, weight server, the local cluster replaying the p3 spot
trace) whose N preemptible instances are *emulated* on a mix of three GPU kinds of relative speeds 3 : 2 : 1
(``rollout.emulated.gpu_speeds = [1, 2/3, 1/3]`` of the 8B profile at ``time_scale`` 0.5), hosted N/4 (at most 16)
to a worker process. The same run is made with ``policy.balance`` on and off, interleaved, ``--reps`` times.

Printed per (N, balance): mean step wall time; the response tail per step (``response_tail_s`` of the step record:
the last response's completion − the completion by which 90 % were done, at the manager); the seconds per step of
the trainer's ``tail`` phase (waiting for the last 10 % of the groups) and ``remote_generation`` phase; the
balancer's moves, migrations, and lost / duplicated / off-version; then tail(on) ÷ tail(off). Step 0 (every
instance's first weight load) is left out.

The last column is how late the emulated instances ran against their profile (the report's ``emulated_late_ratio``:
wall time ÷ the profile's); a run past 1.2 is marked "not the profile" — its tail is the host's, not the GPUs'.

Usage: python benchmarks/bench_tail.py [--n 16 64] [--steps 6] [--reps 1] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlboost_hpc.observe.run_report import late_label  # noqa: E402

SPEEDS = "[1.0, 0.6667, 0.3333]"


def settings(n: int, steps: int, balance: bool) -> list[str]:
    k = max(1, min(16, n // 4))
    return [f"trainer.steps={steps}", "rollout.engine='emulated'", "rollout.emulated.time_scale=0.5",
            "rollout.emulated.response_median=96", "rollout.max_new_tokens=192",
            "rollout.emulated.load_bytes_per_s=1e12", f"rollout.emulated.gpu_speeds={SPEEDS}",
            f"cluster.max_workers={n}", f"cluster.instances_per_worker={k}", "cluster.time_scale=320",
            "cluster.replay_s=8", "policy.cap=false", f"rollout.prompts_per_step={max(4, n // 2)}",
            "manager.pending_limit=4", f"policy.balance={'true' if balance else 'false'}"]


def one_run(n: int, steps: int, balance: bool, extra: list[str], out: Path) -> dict:
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"),
            "--out", str(out), "--no-progress"]
    for o in settings(n, steps, balance) + extra:
        args += ["--set", o]
    t0 = time.monotonic()
    p = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"N={n} balance={balance}: the run exited {p.returncode}:\n{p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    steps_rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rec = steps_rec[1:] or steps_rec  # step 0 includes every instance's first weight load
    return {"N": n, "balance": balance, "run_s": time.monotonic() - t0,
            "wall_s": statistics.fmean(r["wall_s"] for r in steps_rec),
            "tail_s": statistics.fmean(r["response_tail_s"] for r in steps_rec),
            "tail_phase_s": statistics.fmean(r["phase_s"].get("tail", 0.0) for r in steps_rec),
            "remote_s": statistics.fmean(r["phase_s"].get("remote_generation", 0.0) for r in steps_rec),
            "moves": rep["balancer_moves"], "migrated": rep["responses_migrated"],
            "late": rep.get("emulated_late_ratio"),
            "lost/dup/off": f"{rep['responses_lost']}/{rep['responses_duplicated']}/"
                            f"{rep['tokens_trained_off_version']}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="more config overrides (key=value)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tail-"))
    rows: dict[tuple[int, bool], list[dict]] = {}
    for n in a.n:
        for rep in range(a.reps):
            for balance in (True, False):  # interleaved
                r = one_run(n, a.steps, balance, a.set, tmp / f"n{n}-b{int(balance)}-r{rep}")
                rows.setdefault((n, balance), []).append(r)
                print(f"N={n} balance={balance} rep {rep}: {r['run_s']:.0f} s", file=sys.stderr, flush=True)
    print("| N | balance | step wall s | response tail s / step | tail phase s / step | remote generation s / step "
          "| balancer moves | migrated | lost / dup / off | late × (wall ÷ profile) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (n, balance), rs in rows.items():
        print(f"| {n} | {'on' if balance else 'off'} | {statistics.fmean(r['wall_s'] for r in rs):.2f} | "
              f"{statistics.fmean(r['tail_s'] for r in rs):.3f} | {statistics.fmean(r['tail_phase_s'] for r in rs):.3f} "
              f"| {statistics.fmean(r['remote_s'] for r in rs):.2f} "
              f"| {sum(r['moves'] for r in rs)} | {sum(r['migrated'] for r in rs)} | "
              f"{', '.join(r['lost/dup/off'] for r in rs)} | {', '.join(late_label(r['late']) for r in rs)} |")
    for n in a.n:
        on = statistics.fmean(r["tail_s"] for r in rows[(n, True)])
        off = statistics.fmean(r["tail_s"] for r in rows[(n, False)])
        print(f"N={n}: tail with the balancer ÷ without: {on / off:.2f}×" if off > 0 else f"N={n}: no tail")


if __name__ == "__main__":
    main()
