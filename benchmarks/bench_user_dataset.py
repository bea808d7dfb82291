"""Start-up time and trainer memory of a user's prompt file: 1,000,000 rows against a 1,000-row baseline (issue 48).

A generated GSM8K-like JSON-lines file (``prompt`` ~190 characters, ``answer``, ``data_source``; ~0.2 GB for 1M rows)
is loaded as a run's trainer loads it — ``UserTask.load`` (read once into a memory-mapped Arrow file with
content-hash ids, in a child process; the held-out split drawn from the ids), the data frontier over the training
split, and the first 8 steps' prompts (64 rows) read and tokenised with stories260K's tokenizer — each in a fresh
process, twice: cold (no prepared copy yet) and warm (the prepared copy reused, as on a requeue or resume). Printed
side by side: start-up seconds, the trainer's resident memory after start-up — split into its private (anonymous)
memory and the mapped pages of the prepared file (page cache, shared and reclaimable; the kernel maps whole large
folios, ~2 MB, around each row read) — and its peak (VmRSS, RssAnon, RssFile, VmHWM; the baseline's figures include
the same imports), and the peak of the child that prepared the file. Goal: < 10 s and
< 300 MB over the small-file baseline.

    python benchmarks/bench_user_dataset.py [--rows 1000000] [--dir /tmp/bench_user_dataset]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("apple banana cherry dog egg fig grape house ice jam kite lemon mango nut orange pear queen rose sun tree "
         "umbrella violin water box yarn zebra how many does she have left after giving").split()


def make_file(path: Path, rows: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            q = " ".join(rnd.choice(WORDS) for _ in range(32))
            f.write(json.dumps({"prompt": f"Question: {q} {i}?\nAnswer:", "answer": str(i % 997),
                                "data_source": "synthetic"}) + "\n")


def measure(data: str, cache: str) -> dict:
    """In this (fresh) process: load the task as the trainer does; the figures as a dict."""
    import resource
    import time

    import torch  # noqa: F401 - the trainer has it loaded: part of both baselines

    from rlboost_hpc.config_task import TaskCfg
    from rlboost_hpc.models.hf_dir import load_model_dir
    from rlboost_hpc.models.llama2c import ensure_converted
    from rlboost_hpc.tasks.user_task import make_task
    from rlboost_hpc.trainer.loop import DataFrontier

    tok = load_model_dir(ensure_converted(Path("~/.cache/rlboost-hpc/models").expanduser())).tokenizer
    t0 = time.perf_counter()
    task = make_task(TaskCfg(data={"path": data, "cache_dir": cache, "heldout_fraction": 0.01},
                             rewards={"functions": [f"{Path(data).parent / 'rewards.py'}:has_quote"]}))
    frontier = DataFrontier(task.train_prompts(), 0)
    ids = [task.prompt_ids(p, tok) for p in frontier.take(64)]
    secs = time.perf_counter() - t0
    status = Path("/proc/self/status").read_text()
    kb = {k: int(status.split(k + ":")[1].split()[0]) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"rows": len(task.table), "start_s": secs, "rss_mb": kb["VmRSS"] / 1024, "peak_mb": kb["VmHWM"] / 1024,
            "anon_mb": kb["RssAnon"] / 1024, "file_mb": kb["RssFile"] / 1024,
            "child_peak_mb": child / 1024, "prompt_tokens_mean": sum(map(len, ids)) / len(ids)}


def _fresh(data: Path, cache: Path) -> dict:
    p = subprocess.run([sys.executable, __file__, "--measure", str(data), str(cache)], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=1_000)
    ap.add_argument("--dir", default="/tmp/bench_user_dataset")
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(*a.measure)))
        return
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "rewards.py").write_text("def has_quote(completions, **kw):\n    return [float('\"' in c) for c in completions]\n")
    res = {}
    for name, n in (("small", a.small), ("large", a.rows)):
        f = d / f"{name}-{n}.jsonl"
        if not f.exists():
            make_file(f, n)
        cache = d / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        res[name] = {"file_mb": f.stat().st_size / 1e6, "cold": _fresh(f, cache), "warm": _fresh(f, cache)}
    s, g = res["small"], res["large"]
    print(f"{'':34}{'small (' + str(a.small) + ' rows)':>22}{'large (' + str(a.rows) + ' rows)':>24}{'large - small':>16}")
    print(f"{'file (MB)':34}{s['file_mb']:>22.1f}{g['file_mb']:>24.1f}")
    for run in ("cold", "warm"):
        for key, label, unit in (("start_s", "start-up", "s"), ("rss_mb", "trainer RSS after start-up", "MB"),
                                 ("anon_mb", "  of which private (anon)", "MB"),
                                 ("file_mb", "  of which mapped file pages", "MB"),
                                 ("peak_mb", "trainer peak RSS", "MB"), ("child_peak_mb", "preparing child's peak", "MB")):
            if run == "warm" and key == "child_peak_mb":
                continue
            sv, gv = s[run][key], g[run][key]
            print(f"{run + ' ' + label + ' (' + unit + ')':34}{sv:>22.2f}{gv:>24.2f}{gv - sv:>+16.2f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
