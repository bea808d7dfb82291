"""Tiny Hugging Face checkpoints made by the tests themselves (random init through ``transformers``).

Each is a real model directory as ``save_pretrained`` writes it: ``config.json``, safetensors *shards* with their
index, ``generation_config.json`` and a byte-level BPE tokenizer trained here with ``tokenizers`` on GSM8K text,
with ChatML special tokens and a chat template. Small enough for CPU tests (vocabulary 512, hidden 64).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rlboost_hpc.paths import data_file

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-3 style: the template writes the BOS itself and the tokenizer also adds one to plain text.
CHATML_WITH_BOS = "{{ bos_token }}" + CHATML
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin|>"]
VOCAB = 512


def gsm8k_text(n: int = 1500) -> list[str]:
    """Questions and answers of the first ``n`` GSM8K training problems (the tokenizer's training text)."""
    out = []
    with open(data_file("gsm8k/train.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            rec = json.loads(line)
            out += [rec["question"], rec["answer"]]
    return out


def train_tokenizer(*, bos: bool):
    """A byte-level BPE (the Qwen2/Llama-3 kind) with ChatML tokens; ``bos``: adds ``<|begin|>`` to plain text
    and the chat template writes it too (a doubled BOS would show)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(gsm8k_text(), trainers.BpeTrainer(
        vocab_size=VOCAB - 16, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if bos:
        t.post_processor = processors.TemplateProcessing(single="<|begin|> $A",
                                                         special_tokens=[("<|begin|>", t.token_to_id("<|begin|>"))])
        kw["bos_token"] = "<|begin|>"
    else:
        t.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, **kw)
    tok.chat_template = CHATML_WITH_BOS if bos else CHATML
    return tok


def make_model_dir(path: Path, family: str, *, tied: bool, seed: int = 0, rope_scaling: dict | None = None,
                   shard_kb: int = 150) -> Path:
    """A tiny random ``family`` (``llama``, ``qwen2``, ``qwen3``) checkpoint in ``path`` (sharded safetensors).

    Qwen3 gets an explicit ``head_dim`` with heads × head_dim ≠ hidden_size (as Qwen3-0.6B); every family has two
    stop ids (``<|im_end|>``, ``<|endoftext|>``) in ``config.json`` and ``generation_config.json``.
    """
    import transformers

    tok = train_tokenizer(bos=family != "qwen3")
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, eos_token_id=eos, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6)
    else:
        rp = {"rope_type": "default", "rope_theta": 5e5} if rope_scaling is None else {**rope_scaling, "rope_theta": 5e5}
        cfg = transformers.LlamaConfig(**common, rope_parameters=rp)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: perturb them so they matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=f"{shard_kb}KB")
    model.generation_config.eos_token_id = eos
    model.generation_config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hf_model(path: Path):
    """The ``transformers`` model of a model directory (eager attention, fp32, eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
