"""Benchmark: LoRA (``trainer.lora``) against full fine-tuning — bytes per version and per new instance, SetVersion →
every instance serving, and the demo's reward curve — side by side, measured in this run.

Parts (``--parts``, default all):

(a) ``tiny``: the tests' random tiny Qwen3 (made here) through the live system (``rlboost-hpc run``, GSM8K, real
    local workers, real trainers), once fine-tuning every weight (deltas on: each version also offered as a delta
    against the one before) and once training a LoRA adapter whose base the workers must pull
    (``trainer.lora.base_source = "pull"``, the node cache kept in a fresh directory): per version the full bytes and
    the delta bytes vs the adapter's bytes (and its own delta); per new instance the network bytes it needs (a full
    version vs the base once per node plus an adapter), from each run's report.
(b) ``shape8b``: the emulated trainer and emulated instances (``trainer.backend = rollout.engine = "emulated"``) at
    Qwen3-8B's shape: a rank-r adapter on every linear (real bf16 tensors of PEFT's shapes; every element moves each
    step), N = 16 and 64 instances hosted 16 to a process, the base on the shared filesystem (emulated: its load is
    the profile's modelled time). Per point: bytes per version (adapter and its delta), trainer egress, SetVersion →
    serving (first / median / last instance, the manager's ``version_serving``), a new instance's start (welcome →
    weights loaded: base load + adapter pull). Beside it the full version at 8B shape — 16.4 GB, which this machine
    cannot hold N times —: its bytes, and its delta at the emulated trainer's density (3 %), measured at S = ``--full-gb``
    and N = 16 with the same machinery (on the wire S bytes, not 16.4 GB — its wire time grows at most linearly in S,
    ``bench_scale.py`` —; the engine's load of each version is modelled for the 8B model's bytes, as an engine of that
    model pays it).
(c) ``curve``: the default demo (stories260K, ``configs/local.toml``) fine-tuning every weight (its lr, 3e-5) beside a
    rank-``--demo-rank`` LoRA on every linear (its own lr, ``--lora-lr``: adapters are trained at higher rates), the
    held-out reward every ``--every`` steps, before/after, KL to the reference, bytes per version, wall time.

Run: ``.venv/bin/python benchmarks/bench_lora.py [--parts tiny,shape8b,curve] [--n 16 64] [--rank 16]
[--steps 4] [--demo-steps 60]``.
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def run(out: Path, sets: list[str], config: str = "configs/local.toml") -> dict:
    """One ``rlboost-hpc run``; its report (SystemExit with the stderr tail when it fails)."""
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / config), "--out", str(out),
            "--no-progress"]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{out.name}: the run exited {p.returncode}:\n{p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    rep["_wall_s"] = time.monotonic() - t0
    return rep


def table(cols: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


def mb(n: float) -> str:
    return f"{n / 1e6:,.3f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


# ---------------------------------------------------------------------------------------------------- (a) tiny Qwen3
def part_tiny(a: argparse.Namespace, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import make_model_dir  # the tests' checkpoint maker (a dev tool, not the product)

    d = make_model_dir(tmp / "tiny-qwen3", "qwen3", tied=False)
    common = [f"model.path='{d}'", "task.name=gsm8k", f"trainer.steps={a.steps}", "task.train_prompts=24",
              "task.heldout_prompts=4", "trainer.eval_samples=1", "rollout.prompts_per_step=4",
              "rollout.max_new_tokens=32", "cluster.max_workers=2", "trainer.checkpoint_every=0"]
    full = run(tmp / "tiny-full", common)
    lora = run(tmp / "tiny-lora", common + [f"trainer.lora.rank={a.tiny_rank}", "trainer.lr=1e-3",
                                            "trainer.lora.base_source=pull",
                                            f"trainer.lora.node_cache_dir='{tmp / 'node-cache'}'"])
    lo = lora["lora"]
    base_loads = lo["base_loads"]
    base_per_node = lo["base_pulled_bytes"] / max(1, base_loads["pulled"])
    rows = [["full", mb(full["weight_bytes"]), mb(full["weight_update_bytes_mean"]),
             f"{full['weight_bytes'] / full['weight_update_bytes_mean']:.1f}×", mb(full["weight_bytes"]),
             "every new instance", full["weight_pulls"]],
            [f"LoRA r={a.tiny_rank}, all linears", mb(lo["adapter_bytes"]), mb(lora["weight_update_bytes_mean"]),
             f"{full['weight_bytes'] / lo['adapter_bytes']:.1f}× (full ÷ adapter)",
             f"{mb(lo['adapter_bytes'])} + base {mb(base_per_node)} once per node",
             f"base loads: {base_loads['pulled']} pulled, {base_loads['cache']} from the node cache, "
             f"{base_loads['trainer']} in the trainer", lora["weight_pulls"]]]
    print(f"\n(a) tiny Qwen3 ({full['model']['parameters']:,} parameters), {a.steps} steps each, live system, "
          "2 local workers:\n")
    table(["variant", "bytes per version (full)", "bytes per version update (what a holder of v−1 receives)",
           "full ÷ update", "network bytes per new instance", "base", "weight loads"], rows)
    print(f"\nheld-out reward after {a.steps} steps: full {full['reward_heldout_after']:.3f}, LoRA "
          f"{lora['reward_heldout_after']:.3f} (a random model: a plumbing figure); lost/dup/off: "
          f"{full['responses_lost']}/{full['responses_duplicated']}/{full['tokens_trained_off_version']} and "
          f"{lora['responses_lost']}/{lora['responses_duplicated']}/{lora['tokens_trained_off_version']}")


# ---------------------------------------------------------------------------------------------------- (b) 8B shape
def startup_s(out: Path) -> float:
    """Median welcome → weights loaded of the instances that started during the run (``instance_ready`` events)."""
    v = []
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "instance_ready" and "welcome->weights_loaded_s" in e:
            v.append(e["welcome->weights_loaded_s"])
    return statistics.median(v) if v else float("nan")


def part_8b(a: argparse.Namespace, tmp: Path) -> None:
    from bench_scale import one_point

    from rlboost_hpc.models.lora import adapter_shapes
    from rlboost_hpc.sim.profiles import profile

    spec = profile("8b").model
    arch = spec.arch()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter_bytes = 2 * sum(r * c for r, c in adapter_shapes(arch, targets, a.rank).values())
    full_bytes = int(spec.weight_bytes)
    load_rate = a.load_gbps * 1e9
    timing = [f"rollout.emulated.load_bytes_per_s={load_rate}", "rollout.emulated.time_scale=1"]
    lora_sets = ["trainer.backend='emulated'", f"trainer.lora.rank={a.rank}", "trainer.checkpoint_every=0", *timing]
    rows = []
    for n in a.n:
        r = one_point(n, a.steps, 16, lora_sets, tmp / f"lora-n{n}", s_gb=0.0)
        rep = json.loads((tmp / f"lora-n{n}" / "report.json").read_text())
        from bench_scale import weight_figures

        w = weight_figures(tmp / f"lora-n{n}", rep, n, adapter_bytes)
        rows.append([f"LoRA r={a.rank}", n, mb(rep["lora"]["adapter_bytes"]), mb(rep["weight_update_bytes_mean"]),
                     f"{w['egress_per_version_S']:.2f}", f"{w['serving_first_s']:.2f} / {w['serving_median_s']:.2f} / "
                     f"{w['serving_last_s']:.2f}", f"{startup_s(tmp / f'lora-n{n}'):.2f}",
                     f"{spec.weight_bytes / load_rate:.2f} + {w['full_pull_s']:.2f}", r["lost/dup/off"]])
        print(f"LoRA N={n}: done in {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    r = one_point(16, a.steps, 16, timing, tmp / "full-n16", s_gb=a.full_gb)
    full_ratio = r["pulled_per_inst_version_S"]
    rep = json.loads((tmp / "full-n16" / "report.json").read_text())
    delta_share = rep["weight_update_bytes_mean"] / rep["weight_bytes"]
    rows.append([f"full at S = {a.full_gb} GB (measured)", 16, mb(rep["weight_bytes"]),
                 mb(rep["weight_update_bytes_mean"]), f"{r['egress_per_version_S']:.2f}",
                 f"{r['serving_first_s']:.2f} / {r['serving_median_s']:.2f} / {r['serving_last_s']:.2f}",
                 f"{startup_s(tmp / 'full-n16'):.2f}", f"{r['full_pull_s']:.2f} (full pull)", r["lost/dup/off"]])
    rows.append(["full at 8B shape (bytes only)", "—", mb(full_bytes), mb(full_bytes * delta_share) + " (same share)",
                 "—", "—", "—", f"{full_bytes / load_rate:.2f} + a {mb(full_bytes)} pull", "—"])
    print(f"\n(b) Qwen3-8B shape ({spec.params / 1e9:.2f} B parameters; adapter of rank {a.rank} on every linear: "
          f"{adapter_bytes / 2:,.0f} parameters), emulated trainer and instances, {a.steps} steps, the profile's "
          f"time (time_scale 1); a load into the engine modelled at {a.load_gbps} GB/s (the base's {mb(full_bytes)} "
          "from the shared filesystem at a LoRA instance's start; every version's bytes at a full instance's):\n")
    table(["variant", "N", "bytes per version", "bytes per update (delta)", "trainer egress per version ÷ version",
           "SetVersion → serving first / median / last s", "new instance: welcome → serving s (median)",
           "new instance: base load + pull s", "lost/dup/off"], rows)
    print(f"\nbytes per version, full ÷ LoRA at 8B shape: {full_bytes / adapter_bytes:,.0f}× (goal ≥ 100×); full with "
          f"its delta ({delta_share:.3f} of a version, measured at S = {a.full_gb} GB) ÷ LoRA: "
          f"{full_bytes * delta_share / adapter_bytes:,.1f}×; pulled per instance per version ÷ S at full: "
          f"{full_ratio:.3f}")


# ---------------------------------------------------------------------------------------------------- (c) the curve
def part_curve(a: argparse.Namespace, tmp: Path) -> None:
    common = [f"trainer.steps={a.demo_steps}", "trainer.checkpoint_every=0"]
    runs = {"full (lr 3e-5)": run(tmp / "demo-full", common),
            f"LoRA r={a.demo_rank} (lr {a.lora_lr:g})": run(tmp / "demo-lora", common + [
                f"trainer.lora.rank={a.demo_rank}", f"trainer.lr={a.lora_lr}"])}
    print(f"\n(c) the demo (stories260K, {a.demo_steps} steps), training reward per step (mean over windows of "
          f"{a.every}) and held-out reward:\n")
    curves = {}
    for name, rep in runs.items():
        out = tmp / ("demo-full" if name.startswith("full") else "demo-lora")
        r = [json.loads(x)["reward_mean"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [statistics.mean(r[i:i + a.every]) for i in range(0, len(r), a.every)]
    cols = ["variant", *[f"steps {i * a.every}–{min(a.demo_steps, (i + 1) * a.every) - 1}"
                         for i in range(len(next(iter(curves.values()))))],
            "held-out before → after", "KL to base (nats/token)", "bytes per version", "update bytes", "wall s"]
    rows = []
    for name, rep in runs.items():
        lo = rep.get("lora")
        per_version = lo["adapter_bytes"] if lo else rep["weight_bytes"]
        rows.append([name, *[f"{x:.3f}" for x in curves[name]],
                     f"{rep['reward_heldout_before']:.3f} → {rep['reward_heldout_after']:.3f}",
                     f"{rep['kl_to_reference_nats_per_token']:.3f}", mb(per_version),
                     mb(rep["weight_update_bytes_mean"]), f"{rep['_wall_s']:.0f}"])
    table(cols, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="tiny,shape8b,curve")
    p.add_argument("--steps", type=int, default=4, help="steps of the tiny and 8B-shape runs")
    p.add_argument("--tiny-rank", type=int, default=8)
    p.add_argument("--n", type=int, nargs="+", default=[16, 64], help="instances of the 8B-shape LoRA runs")
    p.add_argument("--rank", type=int, default=16, help="adapter rank at 8B shape")
    p.add_argument("--full-gb", type=float, default=0.25, help="S of the measured full-version comparison")
    p.add_argument("--load-gbps", type=float, default=5.0,
                   help="modelled rate of a load into the engine: the base from the shared filesystem, a version's "
                        "bytes (GB/s; the emulated engine's default)")
    p.add_argument("--demo-steps", type=int, default=60)
    p.add_argument("--demo-rank", type=int, default=4)
    p.add_argument("--lora-lr", type=float, default=3e-4)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    parts = a.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        tmp = Path(tmp)
        if "tiny" in parts:
            part_tiny(a, tmp)
        if "shape8b" in parts:
            part_8b(a, tmp)
        if "curve" in parts:
            part_curve(a, tmp)


if __name__ == "__main__":
    main()
