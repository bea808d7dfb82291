"""Per-step reward time: inline in the trainer vs the RewardPool (worker processes, a deadline per answer).

One step's answers (64 = 8 prompts × 8 responses, as the demo) for the stories task and for GSM8K (math-verify),
scored inline (``task.reward``) and through ``RewardPool.score`` with 1 and 2 workers; median of ``--repeats``.

Usage: python benchmarks/bench_rewards.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

from rlboost_hpc.tasks.base import get_task
from rlboost_hpc.tasks.reward_pool import RewardPool


def answers(name: str, task) -> list[tuple]:
    prompts = task.train_prompts()[:8]
    if name == "gsm8k":
        texts = ["Let me think. 3 + 4 = 7. #### 7", "The answer is 42.", "#### 1/2", "no idea", "#### 18",
                 "So x = 12 and #### 12", "#### 0.5", "#### 1000000"]
    else:
        texts = ['"Hello," said Tom.', "Once upon a time there was a cat.", '"No!"', "", "He ran.", '"Yes" she said',
                 "The end.", '"Why?" asked Lily.']
    return [(p, texts[(i + j) % len(texts)]) for i, p in enumerate(prompts) for j in range(8)]


def median_s(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'task':<10}{'inline':>10}{'pool x1':>10}{'pool x2':>10}{'x1/inline':>11}{'x2/inline':>11}"
          "  (seconds per step of 64 answers)")
    for name in ("stories", "gsm8k"):
        task = get_task(name)
        items = answers(name, task)
        inline = median_s(lambda: [task.reward(p, t) for p, t in items], args.repeats)
        row = [inline]
        for workers in (1, 2):
            with RewardPool(task, workers=workers, timeout_s=5.0) as pool:
                pool.score(items)  # warm: workers imported the task's libraries
                row.append(median_s(lambda: pool.score(items), args.repeats))
        print(f"{name:<10}{row[0]:10.4f}{row[1]:10.4f}{row[2]:10.4f}{row[1] / row[0]:11.2f}{row[2] / row[0]:11.2f}")


if __name__ == "__main__":
    main()
