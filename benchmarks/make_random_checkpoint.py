"""Write a randomly initialised model directory of a real model's *shape* with a real tokenizer (GPU checks).

The weights are random (responses run to ``max_new_tokens``), the shapes and the tokenizer are the real model's,
so throughput, MFU, transfer sizes and the whole run's mechanics are those of the real checkpoint.

Usage: ``python benchmarks/make_random_checkpoint.py OUT --shape qwen3-0.6b --tokenizer DIR [--dtype bfloat16]``
(``DIR``: a tokenizer directory, e.g. the Qwen2 one of ``scripts/fetch-test-tokenizers.sh``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

SHAPES = {  # config.json fields of the released checkpoints
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    import transformers

    cfg = transformers.AutoConfig.for_model(**SHAPES[a.shape])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype))
    model.save_pretrained(a.out, max_shard_size="500MB")
    (a.out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    for f in a.tokenizer.iterdir():
        if f.is_file():
            shutil.copyfile(f, a.out / f.name)
    print(f"{a.out}: {a.shape} random weights ({sum(t.numel() for t in model.parameters()) / 1e6:.0f} M), "
          f"tokenizer from {a.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
