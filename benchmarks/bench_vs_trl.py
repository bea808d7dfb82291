"""This project beside the peer a user would pick instead: TRL's ``GRPOTrainer`` (``pip install '.[trl]'``: 1.16.0) on
the same model, task, prompts, sampling and step shape, in fp32 on both sides, in two framings (issue 55):

- **same cores** — TRL at its best thread count (``trl_t1``, ``trl_t2``: the faster one of the round is the
  baseline) against this project on the same two cores: ``ours_colocated`` (k = 0, no preemptible capacity: two
  reserved engine processes generate, the trainer trains at two threads) and ``ours_k1`` (bounded staleness
  k = 1 with TIS: one preemptible worker generates the next step while the trainer trains; one reserved engine);
- **harvested** — TRL on one core, the reservation (``trl_core0``: ``taskset -c 0``), against this project on the
  same reserved core (the trainer, the manager and one reserved engine, ``taskset -c 0``) plus one core of
  preemptible workers (``cluster.worker_cpus = [1]``, ``cluster.max_workers = 1``) replaying the spot trace:
  ``ours_harvested_k0`` and ``ours_harvested_k1``.

Two step shapes: ``demo`` (stories260K, 8 prompts × 8, 48 new tokens: every response runs to the limit, so a step's
groups finish together) and ``longtail`` (256 new tokens: the model ends a story with its stop token after 100–370
tokens, so lengths spread and a step has a tail — where streaming and harvesting pay off).

**The limit** beside every row: the best schedule the row's constraints allow, computed from each phase measured
alone on one core (``--calibrate``: this project's engine generating a step's responses, the reward, the forward and
backward passes and the optimizer step, one after the other on CPU 0 at one thread; TRL's: its own phase timers in
the ``trl_t1`` row). Same cores and k ≥ 1: every phase shares both cores, (generation + reward + train + optimizer) ÷
2. Harvested k = 0: generation is split over both cores, the rest waits for it on the reserved core: generation ÷ 2
+ reward + train + optimizer (streaming can beat it on the long-tail shape). A row's figure is its completion tokens
per second; its limit is the calibration's completion tokens per step over the limit's seconds; ``% of limit`` =
figure ÷ limit.

Rows run as fresh processes, interleaved (each round runs every row of both shapes); the table gives each row's
median over the rounds, its spread (min–max) and its median ratio to the round's baseline. Then, per shape, where a
step goes (one definition per phase on both sides — generation = seeding + handoff + remote generation + tail;
reward; train = forward + backward; optimizer; overhead = the rest of the step's wall time) and, for this project,
the rollout by kind of instance (tokens and busy / idle seconds per step of the reserved engines and the preemptible
instances).

Precision is part of the comparison: each TRL worker reports the precision it ran in (``args.bf16``/``fp16``, the
parameters' dtype) and a row that ran in another is refused (:func:`check_precision`).

Run: ``.venv/bin/python benchmarks/bench_vs_trl.py [--steps 30] [--longtail-steps 12] [--rounds 3]
[--shapes demo,longtail] [--rows ...]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"demo": 48, "longtail": 256}  # max new tokens of each step shape
TRL_ROWS = ("trl_t1", "trl_t2", "trl_core0")
#: what the TRL rows that are baselines (and the limit's TRL phases) are
BASELINE = {"same": ("trl_t1", "trl_t2"), "harvested": ("trl_core0",)}
#: one slot of preemptible capacity under the demo's spot trace (a window with a preemption and a restart)
ONE_SLOT = ["cluster.max_workers=1", "cluster.min_changes=2", "cluster.min_removals=1", "cluster.min_starts=1"]
K1 = ["rollout.max_staleness=1", "trainer.behaviour_correction='tis'"]
#: each row of ours: its framing, its config overrides and the CPUs it runs on (None: both)
OURS = {
    "ours_colocated": ("same", ["cluster.max_workers=0", "rollout.reserved_engines=2", "trainer.torch_threads=2"],
                       None),
    "ours_k1": ("same", ONE_SLOT + K1, None),
    "ours_harvested_k0": ("harvested", ONE_SLOT + ["cluster.worker_cpus=[1]"], "0"),
    "ours_harvested_k1": ("harvested", ONE_SLOT + K1 + ["cluster.worker_cpus=[1]"], "0"),
}
ROWS = TRL_ROWS + tuple(OURS)
#: threads and cores of each row, as the table prints them
WHERE = {"trl_t1": "1 thread", "trl_t2": "2 threads", "trl_core0": "1 thread on CPU 0",
         "ours_colocated": "trainer 2 thr, 2 reserved engines", "ours_k1": "trainer, 1 reserved, 1 worker",
         "ours_harvested_k0": "CPU 0: trainer + 1 reserved; CPU 1: 1 worker",
         "ours_harvested_k1": "CPU 0: trainer + 1 reserved; CPU 1: 1 worker"}
#: the phases a step is timed in on both sides (wall seconds per step)
PHASES = ("generation", "reward", "train", "optimizer", "overhead")


def framing(row: str) -> str:
    return OURS[row][0] if row in OURS else ("harvested" if row == "trl_core0" else "same")


# ---------------------------------------------------------------------------------------------------- TRL side
def trl_config_kwargs(steps: int, precision: str, output_dir: str, max_new_tokens: int = 48) -> dict:
    """The ``GRPOConfig`` arguments of a TRL row: the step shape (``max_new_tokens``), and its ``precision`` —
    ``"fp32"`` (``bf16`` and ``fp16`` off: the same arithmetic as ours on a CPU) or ``"default"`` (TRL's own default,
    bf16 autocast). Generation stops on the model's stop tokens (its generation config: ids 2 and 1), as ours does.

    Raises:
        ValueError: another precision.
    """
    kw = dict(output_dir=output_dir, per_device_train_batch_size=64, num_generations=8,
              max_completion_length=max_new_tokens, learning_rate=3e-5, lr_scheduler_type="constant", beta=0.0,
              loss_type="grpo", max_steps=steps, logging_steps=1, use_cpu=True, temperature=1.0, report_to=[],
              save_strategy="no", seed=0, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, disable_tqdm=True)
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


def trl_worker(steps: int, threads: int, precision: str, out: Path, max_new_tokens: int = 48) -> None:
    """Run TRL's GRPOTrainer on the step shape in this process and write ``{"train_s", "completion_tokens",
    "rewards", "precision", "phases", "config"}`` to ``out`` (``precision``: what it ran in — ``bf16``/``fp16``
    flags and the parameters' dtype; ``phases``: seconds summed over the run, :data:`PHASES`)."""
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
    cfg = GRPOConfig(**trl_config_kwargs(steps, precision, str(out.parent / "trl-out"), max_new_tokens))

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
    phases["overhead"] = train_s - sum(phases.values())
    out.write_text(json.dumps({"train_s": train_s, "rewards": [h["reward"] for h in logs], "precision": ran,
                               "phases": phases, "steps": steps,
                               "config": {k: repr(v) for k, v in trl_effective_config(cfg).items()},
                               "completion_tokens": sum(h["completions/mean_length"] * 64 for h in logs)}))


def time_trl_phases(trainer) -> dict[str, float]:
    """Wrap the methods of a TRL ``GRPOTrainer`` that run each of :data:`PHASES` (``_generate_single_turn``;
    ``_calculate_rewards``; ``compute_loss`` and ``accelerator.backward``; the optimizer step between the
    ``on_pre_optimizer_step`` / ``on_optimizer_step`` callbacks) with wall-clock timers; returns the dict they add
    their seconds to (``overhead`` is filled in by the caller)."""
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


def check_precision(row: str, ran: dict) -> str:
    """The precision TRL row ``row`` ran in, as the table prints it.

    Raises:
        RuntimeError: it ran in another than its name says (fp32 rows: bf16 or fp16 on, or parameters not float32;
            a ``_bf16`` row: bf16 off).
    """
    bf16 = row.endswith("_bf16")
    if ran["fp16"] or ran["bf16"] != bf16 or ran["param_dtype"] != "float32":
        raise RuntimeError(f"{row} ran in {ran}, not {'bf16 autocast' if bf16 else 'fp32'}: not this row's baseline")
    return "bf16 autocast" if bf16 else "fp32"


def _pinned(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus is not None else []


def run_trl(tmp: Path, steps: int, row: str, max_new_tokens: int) -> dict:
    threads = 2 if row == "trl_t2" else 1
    out = tmp / f"{row}-{time.monotonic_ns()}.json"
    cmd = _pinned("0" if row == "trl_core0" else None) + [
        sys.executable, __file__, "--trl-worker", "--steps", str(steps), "--threads", str(threads),
        "--precision", "fp32", "--max-new-tokens", str(max_new_tokens), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"TRL ({row}) exited {p.returncode}: {p.stderr[-3000:]}")
    res = json.loads(out.read_text())
    check_precision(row, res["precision"])
    return res


# ---------------------------------------------------------------------------------------------------- our side
def ours_phases(recs: list[dict], train_s: float) -> dict[str, float]:
    """:data:`PHASES` of one of our runs, summed over its steps, from the per-step timeline (``metrics.jsonl``'s
    ``phase_s``, wall seconds summing to each step's wall time): generation = seeding + handoff + remote
    generation + tail (whatever of training overlapped generation is in train), overhead = every other phase
    (submit, export, publish, set_version, policy, checkpoint) and whatever of ``train_s`` the steps' walls do not
    cover."""
    tot: dict[str, float] = {}
    for r in recs:
        for k, v in r["phase_s"].items():
            tot[k] = tot.get(k, 0.0) + v
    out = {"generation": sum(tot.pop(k, 0.0) for k in ("seeding", "handoff", "remote_generation", "tail")),
           "reward": tot.pop("reward", 0.0), "train": tot.pop("train", 0.0), "optimizer": tot.pop("optimizer", 0.0)}
    out["overhead"] = train_s - sum(out.values())
    return out


def rollout_by_kind(recs: list[dict]) -> dict[str, dict[str, float]]:
    """Tokens and busy / idle seconds per step of the reserved engines and the preemptible instances (means over
    the steps of ``metrics.jsonl``'s ``rollout_by_kind``)."""
    out: dict[str, dict[str, float]] = {}
    for r in recs:
        for kind, figs in r.get("rollout_by_kind", {}).items():
            acc = out.setdefault(kind, {})
            for k, v in figs.items():
                acc[k] = acc.get(k, 0.0) + v / len(recs)
    return out


def run_ours(tmp: Path, steps: int, row: str, max_new_tokens: int) -> dict:
    _, sets, cpus = OURS[row]
    out = tmp / f"{row}-{time.monotonic_ns()}"
    cmd = _pinned(cpus) + [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config",
                           str(ROOT / "configs/local.toml"), "--out", str(out), "--no-progress",
                           "--set", f"trainer.steps={steps}", "--set", "trainer.export_model=false",
                           "--set", "trainer.seed=0", "--set", f"rollout.max_new_tokens={max_new_tokens}"]
    cmd += [x for s in sets for x in ("--set", s)]  # on configs/local.toml (max_batch, Θ and passes of 64)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{row} exited {p.returncode}: {p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lost = {k: rep.get(k, 0) for k in ("responses_lost", "responses_duplicated", "tokens_trained_off_version")}
    if any(lost.values()):
        raise RuntimeError(f"{row}: {lost}")
    return {"train_s": rep["train_wall_s"], "rewards": [r["reward_mean"] for r in recs], "steps": len(recs),
            "phases": ours_phases(recs, rep["train_wall_s"]), "by_kind": rollout_by_kind(recs),
            "completion_tokens": sum(r["response_len_mean"] * r["responses"] for r in recs)}


def calibrate(steps: int, max_new_tokens: int, out: Path) -> None:
    """Our phases alone on one core (this process, which the caller pins to CPU 0, at one thread): ``steps`` steps of
    the shape — the torch engine generating the step's 64 responses (one batch, GRPO groups sharing their prefill),
    the rewards, one forward + backward pass over all 64, the optimizer step — timed one after the other; the first
    two steps warm up and are left out. Writes ``{"phases" (seconds per step), "completion_tokens" (per step)}``."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from rlboost_hpc.config import RunConfig
    from rlboost_hpc.models.hf_dir import load_model_dir
    from rlboost_hpc.models.llama2c import ensure_converted
    from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
    from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
    from rlboost_hpc.tasks.base import strip_stop
    from rlboost_hpc.tasks.stories import StoryQuoteTask
    from rlboost_hpc.trainer.algorithms.grpo import group_advantages
    from rlboost_hpc.trainer.backends.base import Sample
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

    pm = load_model_dir(ensure_converted(Path(RunConfig().model.cache_dir).expanduser()))
    task = StoryQuoteTask(64, 32)
    prompts = task.train_prompts()
    stop = tuple(pm.tokenizer.stop_ids)
    backend = TorchBackend(pm.arch, pm.state_dict, lr=3e-5)
    totals = dict.fromkeys(PHASES[:-1], 0.0)
    tokens = 0
    for step in range(steps + 2):
        engine = TorchEngine(pm.arch, {k: v.detach() for k, v in backend.model.state_dict().items()}, max_batch=64,
                             max_len=256 + max_new_tokens)  # (the weights of the step: not timed, a publish)
        chosen = [prompts[(step * 8 + g) % len(prompts)] for g in range(8)]
        ids = [task.prompt_ids(p, pm.tokenizer) for p in chosen]
        reqs = [GenRequest(f"{step}-{g}-{i}", ids[g], max_new_tokens,
                           SamplingParams(temperature=1.0, top_p=1.0, seed=step * 1000 + g * 10 + i, stop_token_ids=stop))
                for g in range(8) for i in range(8)]
        t0 = time.perf_counter()
        got = generate_all(engine, reqs)
        t1 = time.perf_counter()
        samples = []
        for g, p in enumerate(chosen):
            outs = [got[f"{step}-{g}-{i}"] for i in range(8)]
            r = [task.reward(p, pm.tokenizer.decode(strip_stop(o[0], stop))) for o in outs]
            adv = group_advantages(torch.tensor(r, dtype=torch.float32)).tolist()
            samples += [Sample(prompt_ids=ids[g], response_ids=o[0], behaviour_logprobs=o[1], advantage=a)
                        for o, a in zip(outs, adv)]
        t2 = time.perf_counter()
        backend.accumulate(samples, len(samples))
        t3 = time.perf_counter()
        backend.optimizer_step()
        t4 = time.perf_counter()
        if step >= 2:
            for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[k] += dt
            tokens += sum(len(s.response_ids) for s in samples)
    out.write_text(json.dumps({"phases": {k: v / steps for k, v in totals.items()},
                               "completion_tokens": tokens / steps}))


def run_calibration(tmp: Path, steps: int, max_new_tokens: int) -> dict:
    out = tmp / f"calibrate-{time.monotonic_ns()}.json"
    p = subprocess.run(_pinned("0") + [sys.executable, __file__, "--calibrate", "--steps", str(steps),
                                       "--max-new-tokens", str(max_new_tokens), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"calibration exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------------- limits
def limit_rate(row: str, cal: dict, trl1: dict | None) -> float | None:
    """The row's limit in completion tokens per second (module docstring): from the calibration (ours) or the
    ``trl_t1`` row's phases (TRL's)."""
    if row.startswith("trl"):
        if trl1 is None:
            return None
        per_step = {k: v / trl1["steps"] for k, v in trl1["phases"].items()}
        alone = sum(per_step[k] for k in PHASES[:-1])
        cores = 2 if row == "trl_t2" else 1
        return trl1["completion_tokens"] / trl1["steps"] / (alone / cores)
    ph = cal["phases"]
    if row == "ours_harvested_k0":
        limit_s = ph["generation"] / 2 + ph["reward"] + ph["train"] + ph["optimizer"]
    else:
        limit_s = sum(ph.values()) / 2
    return cal["completion_tokens"] / limit_s


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(shape: str, rounds: list[dict[str, dict]], cals: list[dict]) -> None:
    """Print one shape's tables from every round's results (``rounds[i][row]``) and calibrations."""
    rows = [r for r in ROWS if any(r in rd for rd in rounds)]
    rate = {r: [rd[r]["completion_tokens"] / rd[r]["train_s"] for rd in rounds if r in rd] for r in rows}
    ratio: dict[str, list[float]] = {r: [] for r in rows}
    pct: dict[str, list[float]] = {r: [] for r in rows}
    lim: dict[str, list[float]] = {r: [] for r in rows}
    for rd, cal in zip(rounds, cals):
        base = {f: max((rd[b]["completion_tokens"] / rd[b]["train_s"] for b in BASELINE[f] if b in rd), default=None)
                for f in BASELINE}
        for r in rows:
            if r not in rd:
                continue
            x = rd[r]["completion_tokens"] / rd[r]["train_s"]
            b = base[framing(r)]
            if b and not (r.startswith("trl") and framing(r) == "same"):
                ratio[r].append(x / b)
            lr = limit_rate(r, cal, rd.get("trl_t1"))
            if lr:
                lim[r].append(lr)
                pct[r].append(x / lr)
    print(f"\n## {shape} ({SHAPES[shape]} new tokens): completion tokens/s, median of {len(rounds)} round(s) "
          "[min–max]; × the round's baseline (same cores: TRL at its faster thread count; harvested: TRL on CPU 0); "
          "the limit and the row's share of it")
    print(f"{'row':18} {'framing':9} {'threads / cores':42} {'tok/s':>7} {'[min–max]':>13} {'× TRL':>6} "
          f"{'[min–max]':>11} {'limit':>7} {'% limit':>7}  reward at steps 1, 10, 20, …")
    for r in rows:
        xs = rate[r]
        rw = next(rd[r]["rewards"] for rd in rounds if r in rd)
        marks = " ".join(f"{rw[i]:.2f}" for i in [0] + list(range(9, len(rw), 10)))
        rt = f"{_median(ratio[r]):5.2f}×" if ratio[r] else f"{'—':>6}"
        rr = f"[{min(ratio[r]):.2f}–{max(ratio[r]):.2f}]" if ratio[r] else ""
        print(f"{r:18} {framing(r):9} {WHERE[r]:42} {_median(xs):7.0f} {f'[{min(xs):.0f}–{max(xs):.0f}]':>13} "
              f"{rt} {rr:>11} {_median(lim[r]):7.0f} {100 * _median(pct[r]):6.0f}%  {marks}")
    print(f"\n### {shape}: where a step goes (wall seconds per step, median over rounds; one definition per phase on "
          "both sides) — and each phase alone on one core (the limit's input)")
    print(f"{'row':18} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'total':>8}")
    for r in rows:
        per = {p: _median([rd[r]["phases"][p] / rd[r]["steps"] for rd in rounds if r in rd]) for p in PHASES}
        print(f"{r:18} " + " ".join(f"{per[p]:10.3f}" for p in PHASES) + f" {sum(per.values()):8.3f}")
    cal = {p: _median([c["phases"][p] for c in cals]) for p in PHASES[:-1]}
    print(f"{'ours alone, 1 core':18} " + " ".join(f"{cal[p]:10.3f}" for p in PHASES[:-1]) + f" {'—':>10}"
          f" {sum(cal.values()):8.3f}   ({_median([c['completion_tokens'] for c in cals]):.0f} completion tokens "
          "per step)")
    if any(r in rd and r == "trl_t1" for rd in rounds for r in rd):
        t1 = {p: _median([rd["trl_t1"]["phases"][p] / rd["trl_t1"]["steps"] for rd in rounds if "trl_t1" in rd])
              for p in PHASES[:-1]}
        print(f"{'TRL alone, 1 thr':18} " + " ".join(f"{t1[p]:10.3f}" for p in PHASES[:-1]) + f" {'—':>10}"
              f" {sum(t1.values()):8.3f}")
    ours = [r for r in rows if r in OURS]
    if ours:
        print(f"\n### {shape}: rollout by kind of instance, per step (median over rounds)")
        print(f"{'row':18} {'kind':12} {'tokens':>8} {'busy s':>8} {'idle s':>8} {'pulling s':>9}")
        for r in ours:
            for kind in ("reserved", "preemptible"):
                fig = {k: _median([rd[r]["by_kind"].get(kind, {}).get(k, 0.0) for rd in rounds if r in rd])
                       for k in ("tokens", "busy_s", "idle_s", "pulling_s")}
                print(f"{r:18} {kind:12} {fig['tokens']:8.0f} {fig['busy_s']:8.3f} {fig['idle_s']:8.3f} "
                      f"{fig['pulling_s']:9.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="RL steps of every run of the demo shape")
    ap.add_argument("--longtail-steps", type=int, default=12, help="RL steps of every run of the long-tail shape")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--shapes", default="demo,longtail", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--max-new-tokens", type=int, default=48, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        trl_worker(a.steps, a.threads, a.precision, a.out, a.max_new_tokens)
        return 0
    if a.calibrate:
        calibrate(a.steps, a.max_new_tokens, a.out)
        return 0
    rows = [r for r in a.rows.split(",") if r]
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [r for r in rows if r not in ROWS] + [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown row(s) or shape(s) {bad}; rows: {', '.join(ROWS)}; shapes: {', '.join(SHAPES)}")
    if len(os.sched_getaffinity(0)) < 2:
        ap.error("the framings need two CPUs (0 and 1)")
    tmp = Path(tempfile.mkdtemp(prefix="rlboost-vs-trl-"))
    results: dict[str, list[dict]] = {s: [] for s in shapes}
    cals: dict[str, list[dict]] = {s: [] for s in shapes}
    t_start = time.monotonic()
    for rnd in range(a.rounds):
        for shape in shapes:
            n = SHAPES[shape]
            steps = a.steps if shape == "demo" else a.longtail_steps
            cals[shape].append(run_calibration(tmp, 6, n))
            got: dict[str, dict] = {}
            for row in rows:
                got[row] = run_trl(tmp, steps, row, n) if row in TRL_ROWS else run_ours(tmp, steps, row, n)
                x = got[row]["completion_tokens"] / got[row]["train_s"]
                print(f"round {rnd} {shape:8} {row:18} {got[row]['train_s']:7.1f} s {x:7.0f} tok/s "
                      f"({time.monotonic() - t_start:.0f} s in)", flush=True)
            results[shape].append(got)
    for shape in shapes:
        report(shape, results[shape], cals[shape])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
