"""llama2.c legacy checkpoints (``stories260K.bin`` + ``tok512.bin``) → a Hugging Face model directory.

The converted directory is an ordinary HF Llama directory (``config.json``, ``model.safetensors``,
``tokenizer.json``/``tokenizer_config.json``, ``generation_config.json``) that the run loads like any user's
checkpoint (:mod:`rlboost_hpc.models.hf_dir`).

Invariants:
- :func:`read_llama2c` returns fp32, contiguous tensors under exactly the HF names of
  :meth:`ModelArch.expected_shapes` (``lm_head.weight`` included: a copy of the embedding when the
  checkpoint is tied, so ``LlamaForCausalLM.load_state_dict(..., strict=True)`` works).
- The model never emits EOS (id 2): it ends a story with BOS (id 1), so ``config.json`` and
  ``generation_config.json`` write ``eos_token_id: [2, 1]`` (generation stops at either).
- :func:`hf_tokenizer` reproduces llama2.c's encoder exactly (a byte-fallback BPE whose merges are ranked by
  the merged piece's score; dummy-prefix ``▁``; every space kept, none collapsed) and adds BOS; decoding keeps
  a response's leading space (no ``Strip`` decoder), as llama2.c prints a continuation.
- q_proj / k_proj rows are permuted per head from llama2.c's interleaved-pair RoPE layout to HF's
  rotate-half layout (``[n_heads, hd/2, 2, D]`` → swap axes 1, 2 → back); nothing else is transformed.
  So HF (and :class:`rlboost_hpc.models.llama.LlamaModel`) reproduce llama2.c's logits.
- A file is accepted only if its size equals exactly what its header implies; anything else raises
  :class:`ModelFormatError` saying expected vs actual bytes. Header values are validated through
  :class:`ModelArch` before any size arithmetic.
- :func:`ensure_converted` is idempotent and atomic: the HF directory appears complete (written to a temp
  dir in the same parent, then renamed) or not at all; concurrent callers all end up with one complete dir.
  Its name carries the format version, so a cache written by an older converter is never mistaken for it.
- Shared data files are resolved with :func:`rlboost_hpc.paths.data_file`, so a missing one raises
  :class:`rlboost_hpc.paths.DataFileMissing` (not wrapped).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from rlboost_hpc import paths
from rlboost_hpc.models.arch import ModelArch, ModelFormatError
from rlboost_hpc.models.hf_dir import WEIGHTS_NAME
from rlboost_hpc.models.tokenizer import Llama2cTokenizer

__all__ = [
    "ModelFormatError",
    "read_llama2c",
    "convert_llama2c",
    "hf_tokenizer",
    "ensure_converted",
    "STORIES260K_DIRNAME",
]

_HEADER = struct.Struct("<7i")
STORIES260K_DIRNAME = "stories260K-hf-v2"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tok512.bin"
#: The stop tokens of stories260K: EOS (2), which it never emits, and BOS (1), which ends its stories.
STORIES_EOS = (2, 1)


def _permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama2.c interleaved-pair rows → HF rotate-half rows, per head. ``w``: [n_heads*hd, D]."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def _expected_llama2c_bytes(cfg: ModelArch, seq_len: int, shared: bool) -> int:
    D, H, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.kv_dim
    n = V * D + L * D + L * D * D + 2 * L * kv * D + L * D * D + L * D + 2 * L * H * D + L * D * H + D
    n += seq_len * cfg.head_dim  # two legacy RoPE tables of seq_len*hd/2 floats each
    if not shared:
        n += V * D
    return _HEADER.size + 4 * n


def read_llama2c(path: str | os.PathLike[str]) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Read a llama2.c legacy (version-0) checkpoint.

    Returns:
        ``(config, state_dict)``: the state dict maps HF names to fp32 CPU tensors of the shapes in
        ``config.expected_shapes()`` (``lm_head.weight`` a separate copy of the embedding when tied).

    Raises:
        ModelFormatError: the file does not exist; is shorter than the 28-byte header; has a nonsense header
            (non-positive dims, hidden not divisible by heads, heads not a multiple of kv heads, odd head_dim);
            or its size differs from what the header implies (truncated / trailing bytes; expected vs actual).
    """
    p = Path(path)
    if not p.is_file():
        raise ModelFormatError(f"{p}: llama2.c checkpoint not found")
    raw = p.read_bytes()
    if len(raw) < _HEADER.size:
        raise ModelFormatError(
            f"{p}: file too short for a llama2.c header: expected at least {_HEADER.size} bytes, got {len(raw)}"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = _HEADER.unpack_from(raw)
    shared = vocab > 0
    try:
        if n_heads > 0 and dim % n_heads:
            raise ModelFormatError(f"hidden_size={dim} is not divisible by num_attention_heads={n_heads}")
        cfg = ModelArch(
            family="llama",
            vocab_size=abs(vocab),
            hidden_size=dim,
            intermediate_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=dim // n_heads if n_heads > 0 else 0,
            max_position_embeddings=seq_len,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=shared,
            bos_token_id=Llama2cTokenizer.bos_id,
            eos_token_ids=STORIES_EOS,
        )
    except ModelFormatError as e:
        raise ModelFormatError(
            f"{p}: nonsense llama2.c header (dim={dim}, hidden_dim={hidden}, n_layers={n_layers}, "
            f"n_heads={n_heads}, n_kv_heads={n_kv}, vocab_size={vocab}, seq_len={seq_len}): {e}"
        ) from None
    expected = _expected_llama2c_bytes(cfg, seq_len, shared)
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing bytes"
        raise ModelFormatError(
            f"{p}: file {what}: header (dim={dim}, hidden_dim={hidden}, n_layers={n_layers}, n_heads={n_heads}, "
            f"n_kv_heads={n_kv}, vocab_size={vocab}, seq_len={seq_len}) implies {expected} bytes, got {len(raw)}"
        )

    floats = torch.from_numpy(np.frombuffer(raw, dtype="<f4", offset=_HEADER.size).astype(np.float32))
    off = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal off
        n = int(np.prod(shape))
        t = floats[off:off + n].reshape(shape)
        off += n
        return t

    D, H, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.kv_dim
    emb = take(V, D)
    attn_norm = take(L, D)
    wq = take(L, D, D)
    wk = take(L, kv, D)
    wv = take(L, kv, D)
    wo = take(L, D, D)
    ffn_norm = take(L, D)
    w1 = take(L, H, D)
    w2 = take(L, D, H)
    w3 = take(L, H, D)
    final_norm = take(D)
    take(seq_len * cfg.head_dim)  # legacy freq_cis_real + freq_cis_imag, unused
    head = emb if shared else take(V, D)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb.clone()}
    for i in range(L):
        pre = f"model.layers.{i}."
        sd[pre + "self_attn.q_proj.weight"] = _permute_rope_rows(wq[i], cfg.num_attention_heads)
        sd[pre + "self_attn.k_proj.weight"] = _permute_rope_rows(wk[i], cfg.num_key_value_heads)
        sd[pre + "self_attn.v_proj.weight"] = wv[i].clone()
        sd[pre + "self_attn.o_proj.weight"] = wo[i].clone()
        sd[pre + "mlp.gate_proj.weight"] = w1[i].clone()
        sd[pre + "mlp.up_proj.weight"] = w3[i].clone()
        sd[pre + "mlp.down_proj.weight"] = w2[i].clone()
        sd[pre + "input_layernorm.weight"] = attn_norm[i].clone()
        sd[pre + "post_attention_layernorm.weight"] = ffn_norm[i].clone()
    sd["model.norm.weight"] = final_norm.clone()
    sd["lm_head.weight"] = head.clone()
    return cfg, sd


def hf_tokenizer(tok: Llama2cTokenizer):
    """``tok`` as a ``transformers`` fast tokenizer encoding exactly as llama2.c does (module docstring).

    Pieces: id 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3–258 ``<0xNN>``, then BPE pieces with ``▁`` for a space;
    merges are every pair of pieces whose concatenation is a piece, ranked by that piece's score (highest
    first), as llama2.c merges the best-scoring adjacent pair.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    special = {0: "<unk>", tok.bos_id: "<s>", tok.eos_id: "</s>"}
    pieces = [special.get(i) or p.decode("utf-8").replace(" ", "\u2581") for i, p in enumerate(tok.pieces)]
    vocab = {p: i for i, p in enumerate(pieces)}
    first_bpe = tok.byte_offset + 256
    ranked = []
    for i in range(tok.byte_offset, len(pieces)):
        for j in range(tok.byte_offset, len(pieces)):
            k = vocab.get(pieces[i] + pieces[j])
            if k is not None and k >= first_bpe:
                ranked.append((-tok.scores[k], k, i, j))
    ranked.sort()
    bpe = models.BPE(vocab=vocab, merges=[(pieces[i], pieces[j]) for _, _, i, j in ranked], byte_fallback=True,
                     unk_token="<unk>", fuse_unk=True)
    t = Tokenizer(bpe)
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", tok.bos_id)])
    t.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def convert_llama2c(bin_path: str | os.PathLike[str], tok_path: str | os.PathLike[str],
                    out_dir: str | os.PathLike[str]) -> Path:
    """Write an HF model directory: ``model.safetensors``, ``config.json``, ``generation_config.json``,
    ``tokenizer.json``/``tokenizer_config.json`` (see :func:`hf_tokenizer`) and a copy of ``tok512.bin``.

    ``out_dir`` is created if needed; existing files of the same names are overwritten (not atomic: use
    :func:`ensure_converted` for a cache). The llama2.c licence next to ``bin_path``, if any, is copied too.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ModelFormatError: see :func:`read_llama2c` and :meth:`Llama2cTokenizer.from_file`.
    """
    from safetensors.torch import save_file

    cfg, sd = read_llama2c(bin_path)
    tok = Llama2cTokenizer.from_file(tok_path, vocab_size=cfg.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "eos_token_id": list(STORIES_EOS), "do_sample": True}, indent=2) + "\n")
    hf_tokenizer(tok).save_pretrained(str(out))
    shutil.copyfile(tok_path, out / TOKENIZER_NAME)
    for lic in Path(bin_path).parent.glob("LICENSE*"):
        shutil.copyfile(lic, out / lic.name)
    return out


def check_sources(cache_dir: str | os.PathLike[str]) -> None:
    """What :func:`ensure_converted` will read, checked without reading it: nothing when ``cache_dir`` holds the
    complete conversion, else the shared checkpoint and tokenizer must be there and readable.

    Raises:
        rlboost_hpc.paths.DataFileMissing / InputUnreadable: ``stories260K/stories260K.bin`` or ``tok512.bin``.
    """
    if not _complete(Path(cache_dir) / STORIES260K_DIRNAME):
        paths.data_file("stories260K/stories260K.bin")
        paths.data_file("stories260K/tok512.bin")


def ensure_converted(cache_dir: str | os.PathLike[str]) -> Path:
    """Convert the shared ``stories260K`` checkpoint into ``cache_dir/stories260K-hf-v2`` once; return that dir.

    Inputs are resolved with :func:`rlboost_hpc.paths.data_file`. An existing complete directory is reused
    without re-reading the checkpoint. Writing goes to a temp dir in ``cache_dir`` then an atomic rename.

    Raises:
        rlboost_hpc.paths.DataFileMissing: ``stories260K/stories260K.bin`` or ``tok512.bin`` is absent.
        ModelFormatError: the checkpoint is malformed.
    """
    cache = Path(cache_dir)
    target = cache / STORIES260K_DIRNAME
    if _complete(target):
        return target
    bin_path = paths.data_file("stories260K/stories260K.bin")
    tok_path = paths.data_file("stories260K/tok512.bin")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{STORIES260K_DIRNAME}.", dir=cache))
    try:
        convert_llama2c(bin_path, tok_path, tmp)
        if target.exists() and not _complete(target):
            shutil.rmtree(target, ignore_errors=True)  # leftover of a foreign partial write
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):  # lost a race to a writer that is not complete: genuine failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(d: Path) -> bool:
    return all((d / n).is_file() for n in (CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json", "generation_config.json"))
