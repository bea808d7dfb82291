"""Re-run every benchmark behind ``benchmarks/RESULTS.md`` and print one table.

Each benchmark runs as its own process (``sys.executable``), one after another (they measure; they must not share
the CPUs), with its full arguments or, with ``--quick``, small arguments that finish on a 2-core machine in a few
minutes in all (numbers from ``--quick`` show that the benchmarks run and roughly where the ratios are; RESULTS.md
records full runs). Benchmarks that need the local Slurm cluster, the SGLang CPU route or a GPU run only when named
in ``--with`` (``slurm``, ``sglang``, ``gpu``). Every benchmark's output is written to ``--out/<name>.txt``; the
table gives its exit status, wall time and the last lines it printed (its side-by-side result).

Run: ``.venv/bin/python benchmarks/run_all.py [--quick] [--only bench_delta,bench_relay] [--with slurm,sglang]
[--out DIR] [--tail 6]``. Exit status: 0 when every benchmark that ran exited 0, else 1.
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    """One benchmark: its script, full and quick arguments, and what it needs beyond this machine's CPUs."""

    name: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    needs: str = ""  # "", "slurm", "sglang" or "gpu"


BENCHES = [
    Bench("bench_sim", (), ("--models", "8b", "--traces", "p3", "--hours", "2", "--repeat", "1")),
    Bench("bench_policies_live", (), ("--steps", "12")),
    Bench("bench_engine", (), ("--batches", "1", "8", "--new", "32", "--repeat", "2", "--no-hf")),
    Bench("bench_weights", (), ("--sizes-mib", "32", "--streams", "1", "4", "--reps", "2")),
    Bench("bench_tensor_count", (), ("--sizes-mib", "4", "--reps", "2")),
    Bench("bench_export", (), ("--sizes-mib", "32", "--reps", "2")),
    Bench("bench_delta", (), ("--size-mib", "32", "--reps", "1", "--demo-steps", "8")),
    Bench("bench_relay", (), ("--size-mib", "8", "--pullers", "1", "4")),
    Bench("bench_curve", (), ("--sizes-mib", "32", "--reps", "2", "--ks", "4", "--instances", "2", "--groups", "16",
                              "--max-new-tokens", "64", "--min-run-s", "0.5", "--max-steps", "5")),
    Bench("bench_nccl", (), ("--sizes-mib", "32", "--reps", "2")),
    Bench("bench_manager_ingest", (), ("--ks", "4", "--instances", "4", "--groups", "16", "--max-new-tokens", "64",
                                       "--min-run-s", "0.5", "--max-steps", "5", "--reps", "1")),
    Bench("bench_rewards", (), ("--repeats", "2")),
    Bench("bench_worker_startup", (), ("--repeats", "1")),
    Bench("bench_end_to_end", (), ("--steps", "6")),
    Bench("bench_step_timeline", (), ("--steps", "8", "--variants", "demo,demo-sync-checkpoint")),
    Bench("bench_megatron", (), ("--steps", "1", "--warmup", "0")),
    Bench("bench_multiturn", ("--steps", "16"), ("--steps", "6")),
    Bench("bench_grpo_options", (), ("--steps", "8", "--qwen3-steps", "3", "--variants", "grpo,tis")),
    Bench("bench_mismatch", (), ("--batch", "2", "--new", "64", "--caps", "2")),
    Bench("bench_staleness", (), ("--steps", "6", "--ks", "0,1", "--sim-models", "")),
    Bench("bench_lora", (), ("--parts", "tiny,shape8b", "--steps", "2", "--n", "16", "--rank", "8")),
    Bench("bench_ettr", ("--pairs", "3"), ("--pairs", "1", "--steps", "20")),
    Bench("bench_sglang", (), ("--prompts", "4", "--new", "16", "--repeat", "1", "--stream-intervals", "1", "8",
                               "--weight-hidden", "256"), needs="sglang"),
    Bench("bench_slurm_phases", (), ("--repeats", "1"), needs="slurm"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/run_all.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small arguments (a few minutes in all on 2 cores)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (none: all)")
    ap.add_argument("--with", dest="with_", default="", help="also run benchmarks needing: slurm, sglang, gpu")
    ap.add_argument("--out", default=None, help="where each benchmark's output goes (none: a temporary directory)")
    ap.add_argument("--tail", type=int, default=6, help="lines of each benchmark's output in the table")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per benchmark")
    a = ap.parse_args(argv)
    only = {x for x in a.only.split(",") if x}
    unknown = only - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    extra = {x for x in a.with_.split(",") if x}
    out = Path(a.out or tempfile.mkdtemp(prefix="rlboost-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"# benchmarks {'(quick) ' if a.quick else ''}{datetime.date.today()} commit {commit.strip() or '?'}; "
          f"outputs in {out}\n", flush=True)
    rows = []
    for b in BENCHES:
        if only and b.name not in only:
            continue
        if b.needs and b.needs not in extra:
            rows.append((b.name, "skipped", 0.0, f"needs {b.needs} (--with {b.needs})"))
            continue
        args = list(b.quick if a.quick else b.full)
        cmd = [sys.executable, str(HERE / f"{b.name}.py"), *args]
        print(f"## {b.name} {' '.join(args)}", flush=True)
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=a.timeout_s)
            rc, text = p.returncode, p.stdout + ("\n--- stderr\n" + p.stderr if p.returncode else "")
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        wall = time.monotonic() - t0
        (out / f"{b.name}.txt").write_text(text)
        tail = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("{")][-a.tail:]
        print("\n".join("    " + ln for ln in tail) + f"\n    → exit {rc}, {wall:.0f} s\n", flush=True)
        rows.append((b.name, str(rc), wall, tail[-1] if tail else ""))
    print(f"{'benchmark':<24} {'exit':>8} {'wall s':>8}  last line")
    for name, rc, wall, last in rows:
        print(f"{name:<24} {rc:>8} {wall:>8.0f}  {last[:90]}")
    return 0 if all(rc in ("0", "skipped") for _, rc, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
