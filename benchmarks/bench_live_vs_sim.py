"""Live = simulated at scale (issue 29 item 6): one emulated live run and the simulator on its own terms, step by step.

The live side is a real ``rlboost-hpc run`` (trainer, manager, weight server, the local cluster replaying the p3 spot
trace) whose N preemptible instances are *emulated* (``rollout.engine = "emulated"``: the 8B profile's timing, no
compute), hosted N/4 to a worker process, with the N_prem controller on (``policy.cap = true``). The simulated side
is ``rlboost_hpc/sim/calibrate.py:simulate_run`` on that run directory: the decode law fitted to the manager's
measured rates, the run's training seconds per token, the same trace window, config and policy.

Printed per step: wall seconds, tokens trained, T_seed, N_prem after the step and the preemptible instances that
served the step, live and simulated; then, over the steps after the first (whose start-up the simulator does not
model), simulated ÷ live of throughput (tokens / wall seconds), of the mean T_seed, of the mean N_prem and of the
mean instances serving — the issue's target is each within 10 %.

Usage: python benchmarks/bench_live_vs_sim.py [--n 16] [--steps 12] [--set key=value ...]
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

from rlboost_hpc.sim.calibrate import simulate_run  # noqa: E402
from rlboost_hpc.observe.run_report import late_label  # noqa: E402


def settings(n: int, steps: int) -> list[str]:
    return [f"trainer.steps={steps}", "rollout.engine='emulated'", "rollout.emulated.response_median=24",
            "rollout.emulated.time_scale=0.25", "rollout.emulated.load_bytes_per_s=1e12",
            f"cluster.max_workers={n}", f"cluster.instances_per_worker={max(1, min(16, n // 4))}",
            "cluster.time_scale=320", "cluster.replay_s=8", "policy.cap=true",
            f"rollout.prompts_per_step={max(4, n // 2)}", "manager.pending_limit=4"]


def live_run(n: int, steps: int, extra: list[str], out: Path) -> list[dict]:
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"),
            "--out", str(out), "--no-progress"]
    for o in settings(n, steps) + extra:
        args += ["--set", o]
    p = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"the live run exited {p.returncode}:\n{p.stderr[-3000:]}")
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def ratio(sim: float, live: float) -> str:
    return f"{sim / live:.2f}" if live else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16, help="preemptible instances N")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--set", action="append", default=[], help="more config overrides (key=value)")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-live-sim-")) / "run"
    t0 = time.monotonic()
    live = live_run(a.n, a.steps, a.set, out)
    sim = simulate_run(out)
    print(f"N = {a.n}, {len(live)} steps, live run {time.monotonic() - t0:.0f} s; profile fitted: "
          f"{json.dumps({k: round(v, 6) for k, v in sim['profile'].items()})}")
    print("| step | wall s live / sim | tokens live / sim | T_seed live / sim | N_prem live / sim "
          "| serving live / sim |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m, s in zip(live, sim["steps"]):
        print(f"| {m['step']} | {m['wall_s']:.2f} / {s['step_s']:.2f} | {m['tokens']} / {s['tokens']:.0f} | "
              f"{m['t_seed_s']:.2f} / {s['t_seed_s']:.2f} | {m.get('n_prem_cap')} / {s['cap_next']} | "
              f"{m.get('n_remote')} / {s['n_remote']} |")
    pairs = list(zip(live, sim["steps"]))[1:]
    lw, sw = sum(m["wall_s"] for m, _ in pairs), sum(s["step_s"] for _, s in pairs)
    lt, st = sum(m["tokens"] for m, _ in pairs), sum(s["tokens"] for _, s in pairs)
    mean = statistics.fmean
    caps = [(m["n_prem_cap"], s["cap_next"]) for m, s in pairs
            if m.get("n_prem_cap") is not None and s["cap_next"] is not None]
    print(f"\nsimulated ÷ live, steps 1..{len(live) - 1}:")
    print(f"  throughput (tokens / wall s)   {ratio(st / sw, lt / lw)}  (live {lt / lw:,.0f}, sim {st / sw:,.0f})")
    print(f"  mean step wall s               {ratio(sw, lw)}")
    print(f"  mean T_seed                    {ratio(mean(s['t_seed_s'] for _, s in pairs), mean(m['t_seed_s'] for m, _ in pairs))}")
    if caps:
        print(f"  mean N_prem                    {ratio(mean(c[1] for c in caps), mean(c[0] for c in caps))}"
              f"  (equal in {sum(1 for c in caps if c[0] == c[1])} of {len(caps)} steps)")
    print(f"  mean instances serving a step  "
          f"{ratio(mean(s['n_remote'] for _, s in pairs), mean(m.get('n_remote') or 0 for m, _ in pairs))}")
    rep = json.loads((out / "report.json").read_text())
    print(f"  live instances' lateness       {late_label(rep.get('emulated_late_ratio'))}  (wall time ÷ the "
          "profile's; past 1.2 the live column is the host's timing, not the profile's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
