"""Turn GSM8K's own files (openai/grade-school-math, MIT: ``{"question", "answer"}`` per line) into the JSON-lines a
user brings to rlboost-hpc: one row per problem with the prompt as the model sees it (``prompt``), the gold number
(``answer``) and the reference solution (``solution``) — the same prompts and columns as the built-in ``gsm8k`` task.

    python examples/gsm8k_jsonl/make_jsonl.py ../shared/data/gsm8k/train.jsonl train.jsonl --rows 256
"""
from __future__ import annotations

import argparse
import json
import re


def gold(answer: str) -> str:
    """The number on the last line ``#### <n>`` of a GSM8K answer, thousands commas removed."""
    last = [ln.strip() for ln in answer.strip().splitlines() if ln.strip()][-1]
    m = re.fullmatch(r"####\s*(-?[\d,]*\d(?:\.\d+)?)", last)
    if m is None:
        raise ValueError(f"no final '#### <number>' line: {last!r}")
    return m.group(1).replace(",", "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--rows", type=int, default=None, help="keep the first ROWS problems")
    a = p.parse_args()
    with open(a.src, encoding="utf-8") as f, open(a.dst, "w", encoding="utf-8") as out:
        for i, line in enumerate(ln for ln in f if ln.strip()):
            if a.rows is not None and i >= a.rows:
                break
            row = json.loads(line)
            out.write(json.dumps({"prompt": f"Question: {row['question'].strip()}\nAnswer:",
                                  "answer": gold(row["answer"]), "solution": row["answer"]}) + "\n")


if __name__ == "__main__":
    main()
