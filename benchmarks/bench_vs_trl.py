"""This project beside the peer a user would pick instead: TRL's ``GRPOTrainer`` (``pip install '.[trl]'``: 1.16.0) on the
same model, task and step shape — the demo: stories260K, 8 prompts × group 8, 48 new tokens, lr 3e-5 constant,
β = 0, GRPO's per-sequence token mean (TRL ``loss_type = "grpo"``), temperature 1 — interleaved in one invocation.

Rows, each a fresh process per round:
- ``trl tN``: TRL on the CPU with ``torch.set_num_threads(N)`` (N = 1, 2), in fp32 as ours (``bf16 = False``,
  ``fp16 = False``): generation with ``model.generate``, then the loss, one optimizer step per RL step, all in one
  process.
- ``trl t2 bf16``: TRL as its ``GRPOConfig`` defaults it (``bf16 = True``: training under bf16 autocast, which a CPU
  without fast bf16 pays for) — what a user who keeps TRL's default gets; never the ratio's baseline.
- ``ours colocated``: ``rlboost-hpc run`` with no preemptible worker (``cluster.max_workers = 0``): the reserved
  engine generates, the trainer trains (streamed micro-batches of 16); ``ours colocated t2``: the same with
  ``trainer.torch_threads = 2`` (both cores for the process's intra-op threads: the reserved engine's and the
  trainer's).
- ``ours workers``: the demo as shipped — two preemptible worker processes replaying the spot trace beside it.
- ``ours k=1``: the same with ``rollout.max_staleness = 1`` (TIS, the decoupled objective): the next step's prompts
  generate while the trainer trains.

Precision is part of the comparison: the TRL worker reports the precision it ran in (``args.bf16``/``fp16``, the
parameters' dtype) and the benchmark refuses a row that ran in another than its name says. TRL's effective config
(every field that differs from ``GRPOConfig``'s defaults) is printed before the table, and every row states its torch
threads per process.

Per row: training wall seconds (``trainer.train()`` for TRL; the report's ``train_wall_s`` — every step from the
first submission to the last version change — for ours), completion tokens trained per second of it, the ratio to
``trl t1`` of the same round, and the training reward at steps 1, 10, 20, … (mean of the step's 64 responses). Both
sides load the same checkpoint (this project's converted stories260K directory) and score with the same reward.

All of it shares this machine's cores: on 2 CPU cores generation and training of ours run on the same cores, so the
overlap that a GPU cluster gains from is not free here.

Run: ``.venv/bin/python benchmarks/bench_vs_trl.py [--steps 30] [--rounds 2] [--rows trl_t1,trl_t2,ours_colocated,
ours_workers,ours_k1]``.
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
ROWS = ("trl_t1", "trl_t2", "trl_t2_bf16", "ours_colocated", "ours_colocated_t2", "ours_workers", "ours_k1")
#: torch threads per process of each of our rows (the demo's: the trainer process, which also runs the reserved
#: engine, and each preemptible worker)
OURS_THREADS = {"ours_colocated": "trainer 1", "ours_colocated_t2": "trainer 2", "ours_workers": "trainer 1, 2 "
                "workers × 1", "ours_k1": "trainer 1, 2 workers × 1"}
OURS = {"ours_colocated": ["cluster.max_workers=0"],
        "ours_colocated_t2": ["cluster.max_workers=0", "trainer.torch_threads=2"], "ours_workers": [],
        "ours_k1": ["rollout.max_staleness=1", "trainer.behaviour_correction='tis'"]}


def trl_config_kwargs(steps: int, precision: str, output_dir: str) -> dict:
    """The ``GRPOConfig`` arguments of a TRL row: the demo's step shape, and its ``precision`` — ``"fp32"`` (``bf16``
    and ``fp16`` off: the same arithmetic as ours on a CPU) or ``"default"`` (TRL's own default, bf16 autocast).

    Raises:
        ValueError: another precision.
    """
    kw = dict(output_dir=output_dir, per_device_train_batch_size=64, num_generations=8, max_completion_length=48,
              learning_rate=3e-5, lr_scheduler_type="constant", beta=0.0, loss_type="grpo", max_steps=steps,
              logging_steps=1, use_cpu=True, temperature=1.0, report_to=[], save_strategy="no", seed=0,
              warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, disable_tqdm=True)
    if precision == "fp32":
        return {**kw, "bf16": False, "fp16": False}
    if precision == "default":
        return kw
    raise ValueError(f"precision {precision!r}: fp32 or default")


def trl_effective_config(cfg) -> dict:
    """Every field of a ``GRPOConfig`` that differs from the defaults, and its precision flags either way."""
    from trl import GRPOConfig

    ref = GRPOConfig(output_dir=cfg.output_dir, use_cpu=True)
    out = {k: v for k, v in vars(cfg).items() if not k.startswith("_") and getattr(ref, k, object()) != v
           and k not in ("output_dir", "logging_dir")}
    return {**out, "bf16": cfg.bf16, "fp16": cfg.fp16}


def trl_worker(steps: int, threads: int, precision: str, out: Path) -> None:
    """Run TRL's GRPOTrainer on the demo's shape in this process and write ``{"train_s", "completion_tokens",
    "rewards", "precision", "config"}`` to ``out`` (``precision``: what it ran in — ``bf16``/``fp16`` flags and the
    parameters' dtype)."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlboost_hpc.config import RunConfig
    from rlboost_hpc.models.llama2c import ensure_converted
    from rlboost_hpc.tasks.stories import StoryQuoteTask, quote_reward

    hf = ensure_converted(Path(RunConfig().model.cache_dir).expanduser())  # the directory the demo's run loads
    task = StoryQuoteTask(64, 32)
    ds = Dataset.from_list([{"prompt": p.text} for p in task.train_prompts()])
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    cfg = GRPOConfig(**trl_config_kwargs(steps, precision, str(out.parent / "trl-out")))

    def reward(completions, **_kw) -> list[float]:
        return [quote_reward(c) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=tok)
    phases = time_trl_phases(trainer)
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    ran = {"bf16": bool(trainer.args.bf16), "fp16": bool(trainer.args.fp16),
           "param_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch.")}
    phases["rest"] = train_s - sum(phases.values())
    out.write_text(json.dumps({"train_s": train_s, "rewards": [h["reward"] for h in logs], "precision": ran,
                               "phases": phases,
                               "config": {k: repr(v) for k, v in trl_effective_config(cfg).items()},
                               "completion_tokens": sum(h["completions/mean_length"] * 64 for h in logs)}))


#: the phases of a step both sides are timed in (wall seconds, summed over the run): generation (sampling the
#: responses), reward, train (the forward passes that give the policy's logprobs and the loss, and the backward
#: passes), optimizer (the optimizer step), rest (everything else of the training wall time)
PHASES = ("generation", "reward", "train", "optimizer", "rest")


def time_trl_phases(trainer) -> dict[str, float]:
    """Wrap the methods of a TRL ``GRPOTrainer`` that run each of :data:`PHASES` (``_generate_single_turn``;
    ``_calculate_rewards``; ``compute_loss`` and ``accelerator.backward``; the optimizer step between the
    ``on_pre_optimizer_step`` and ``on_optimizer_step`` callbacks) with wall-clock timers; returns the dict they add
    their seconds to (``rest`` is filled in by the caller)."""
    from transformers import TrainerCallback

    phases = dict.fromkeys(PHASES[:-1], 0.0)

    def timed(phase: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[phase] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer.compute_loss = timed("train", trainer.compute_loss)
    trainer.accelerator.backward = timed("train", trainer.accelerator.backward)

    class OptimizerTimer(TrainerCallback):
        t = 0.0

        def on_pre_optimizer_step(self, *a, **kw):
            self.t = time.perf_counter()

        def on_optimizer_step(self, *a, **kw):
            phases["optimizer"] += time.perf_counter() - self.t

    trainer.add_callback(OptimizerTimer())
    return phases


def ours_phases(recs: list[dict], train_s: float) -> dict[str, float]:
    """:data:`PHASES` of one of our runs from its per-step timeline (``metrics.jsonl``'s ``phase_s``, wall seconds
    summing to each step's wall time): generation = seeding + handoff + remote generation (the responses still
    running after the seeding window), train = the micro-batches' forward and backward passes left after the last
    response arrived (those that overlapped generation are in generation), rest = the other phases and whatever
    of ``train_s`` the steps' walls do not cover."""
    tot: dict[str, float] = {}
    for r in recs:
        for k, v in r["phase_s"].items():
            tot[k] = tot.get(k, 0.0) + v
    out = {"generation": sum(tot.pop(k, 0.0) for k in ("seeding", "handoff", "remote_generation")),
           "reward": tot.pop("reward", 0.0), "train": tot.pop("train", 0.0), "optimizer": tot.pop("optimizer", 0.0)}
    out["rest"] = train_s - sum(out.values())
    return out


def check_precision(row: str, ran: dict) -> str:
    """The precision TRL row ``row`` ran in, as the table prints it.

    Raises:
        RuntimeError: it ran in another than its name says (fp32 rows: bf16 or fp16 on, or parameters not float32).
    """
    bf16 = row.endswith("_bf16")
    if ran["fp16"] or ran["bf16"] != bf16 or ran["param_dtype"] != "float32":
        raise RuntimeError(f"{row} ran in {ran}, not {'bf16 autocast' if bf16 else 'fp32'}: not this row's baseline")
    return "bf16 autocast" if bf16 else "fp32"


def run_trl(tmp: Path, steps: int, threads: int, precision: str) -> dict:
    out = tmp / f"trl-t{threads}-{precision}-{time.monotonic_ns()}.json"
    p = subprocess.run([sys.executable, __file__, "--trl-worker", "--steps", str(steps), "--threads", str(threads),
                        "--precision", precision, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"TRL (threads {threads}) exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_ours(tmp: Path, steps: int, sets: list[str]) -> dict:
    out = tmp / f"ours-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"), "--out",
           str(out), "--no-progress", "--set", f"trainer.steps={steps}", "--set", "trainer.export_model=false",
           "--set", "trainer.seed=0"] + [x for s in sets for x in ("--set", s)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"run exited {p.returncode}: {p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"train_s": rep["train_wall_s"], "precision": "fp32", "rewards": [r["reward_mean"] for r in recs],
            "phases": ours_phases(recs, rep["train_wall_s"]),
            "completion_tokens": sum(r["response_len_mean"] * r["responses"] for r in recs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="RL steps of every run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        trl_worker(a.steps, a.threads, a.precision, a.out)
        return 0
    rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown row(s) {bad}; choose from {', '.join(ROWS)}")
    tmp = Path(tempfile.mkdtemp(prefix="rlboost-vs-trl-"))
    print(f"## the demo's step shape, {a.steps} steps, {a.rounds} interleaved round(s); ratios to TRL in fp32 "
          "(trl_t1 and trl_t2), never to the bf16 row")
    print(f"{'round':>5} {'row':17} {'precision':13} {'threads':25} {'train s':>8} {'tok/s':>7} {'vs trl t1':>9} "
          f"{'vs trl t2':>9}  reward at steps 1, 10, 20, …")
    shown, phases = False, {row: [] for row in rows}
    for rnd in range(a.rounds):
        base: dict[str, float] = {}
        for row in rows:
            if row.startswith("trl"):
                threads = int(row.split("_")[1][1:])
                res = run_trl(tmp, a.steps, threads, "default" if row.endswith("_bf16") else "fp32")
                precision, where = check_precision(row, res["precision"]), f"{threads}"
                if not shown:
                    print("TRL's GRPOConfig, fields that differ from its defaults (fp32 rows):",
                          {k: v for k, v in res["config"].items() if k not in ("bf16", "fp16")}, flush=True)
                    shown = True
            else:
                res, precision, where = run_ours(tmp, a.steps, OURS[row]), "fp32", OURS_THREADS[row]
            rate = res["completion_tokens"] / res["train_s"]
            phases[row].append(res["phases"])
            if row in ("trl_t1", "trl_t2"):
                base[row] = rate
            ratio = "  ".join(f"{rate / base[b]:8.2f}×" if b in base else f"{'—':>9}" for b in ("trl_t1", "trl_t2"))
            rw = res["rewards"]
            marks = " ".join(f"{rw[i]:.2f}" for i in [0] + list(range(9, len(rw), 10)))
            print(f"{rnd:>5} {row:17} {precision:13} {where:25} {res['train_s']:8.1f} {rate:7.0f} {ratio}  {marks}",
                  flush=True)
    print(f"\n## where a step goes: wall seconds per step by phase, mean of {a.rounds} round(s) (wall-clock timers "
          "around the same phases on both sides: TRL's methods, our trainer's timeline)")
    print(f"{'row':17} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'total':>8}")
    for row, got in phases.items():
        mean = {p: sum(g[p] for g in got) / len(got) / a.steps for p in PHASES}
        print(f"{row:17} " + " ".join(f"{mean[p]:10.3f}" for p in PHASES) + f" {sum(mean.values()):8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
