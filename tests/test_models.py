"""stories260K loader, tokenizer and pure-torch Llama against llama2.c's reference text and transformers."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from rlboost_hpc import paths
import transformers
from _util import fp32_atol, load_hf_dir, torch_threads

from rlboost_hpc.models.arch import ModelArch, ModelFormatError, arch_from_hf, validate_state_dict
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.models.llama2c import (
    STORIES260K_DIRNAME,
    convert_llama2c,
    ensure_converted,
    read_llama2c,
)
from rlboost_hpc.models.tokenizer import Llama2cTokenizer

torch.set_num_threads(1)  # a 260K-parameter model: threads only add contention on a shared 2-core box

STEPS = 200


@pytest.fixture(scope="module")
def loaded(stories260k_hf_dir: Path):
    return load_hf_dir(stories260k_hf_dir)


@pytest.fixture(scope="module")
def model(loaded) -> LlamaModel:
    cfg, sd = loaded
    return LlamaModel.from_state_dict(cfg, sd).eval()


@pytest.fixture(scope="module")
def hf_eager(stories260k_hf_dir: Path):
    return transformers.LlamaForCausalLM.from_pretrained(stories260k_hf_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tok(stories260k_hf_dir: Path) -> Llama2cTokenizer:
    return Llama2cTokenizer.from_file(stories260k_hf_dir / "tok512.bin")


@pytest.fixture(scope="module")
def expected_text() -> str:
    return paths.data_file("stories260K/expected_greedy_200.txt").read_text()


def runc_stdout(tok: Llama2cTokenizer, generated: list[int], steps: int = STEPS) -> str:
    """What llama2.c's run.c ``generate()`` prints for an empty prompt, minus its final ``printf("\\n")``.

    run.c encodes "" as [BOS]; ``pos`` runs 0..steps-1 with the forward pass on ``token`` at ``pos`` giving
    ``next`` (so ``steps`` forward passes and up to ``steps`` generated tokens, BOS not counted); it stops
    early if ``next`` is BOS; it prints ``decode(token, next)`` (leading space stripped after BOS, ``<0xNN>`` as
    the byte) through ``safe_printf`` (a single non-printable, non-space byte is skipped).
    """
    out = bytearray()
    token = tok.bos_id
    for nxt in generated[:steps]:
        if nxt == tok.bos_id:
            break
        piece = tok.decode_piece(token, nxt)
        if not (len(piece) == 1 and not (0x20 <= piece[0] <= 0x7E or piece[0] in b" \t\n\v\f\r")):
            out += piece
        token = nxt
    return out.decode("utf-8")


# ---------------------------------------------------------------------------------------------- config
def test_config_roundtrip_and_validation(loaded):
    cfg, _ = loaded
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 172, 5)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 8, 512)
    assert cfg.max_position_embeddings == 512 and cfg.tie_word_embeddings
    assert cfg.family == "llama" and cfg.eos_token_ids == (2, 1) and cfg.bos_token_id == 1
    assert arch_from_hf(cfg.to_hf_dict()) == cfg
    assert ModelArch.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg  # what instances receive
    with pytest.raises(ModelFormatError, match="head_dim=7 must be even"):
        ModelArch("llama", 512, 56, 172, 5, 8, 4, 7, 512)
    with pytest.raises(ModelFormatError, match="num_hidden_layers=0"):
        ModelArch("llama", 512, 64, 172, 0, 8, 4, 8, 512)
    with pytest.raises(ModelFormatError, match="multiple of num_key_value_heads"):
        ModelArch("llama", 512, 64, 172, 5, 8, 3, 8, 512)


def test_hf_config_json_reads_in_transformers(stories260k_hf_dir: Path, loaded):
    cfg, _ = loaded
    raw = json.loads((stories260k_hf_dir / "config.json").read_text())
    for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype"):
        assert key in raw, key
    # the model ends stories with BOS and never emits EOS: both stop generation
    assert raw["bos_token_id"] == 1 and raw["eos_token_id"] == [2, 1] and raw["torch_dtype"] == "float32"
    gen = json.loads((stories260k_hf_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 1]
    assert (stories260k_hf_dir / "tokenizer.json").is_file() and (stories260k_hf_dir / "tokenizer_config.json").is_file()
    hc = transformers.LlamaConfig.from_pretrained(stories260k_hf_dir)
    assert hc.num_key_value_heads == 4 and hc.head_dim == 8 and hc.tie_word_embeddings
    theta = getattr(hc, "rope_theta", None) or hc.rope_parameters["rope_theta"]
    assert theta == 10000.0
    assert (stories260k_hf_dir / "LICENSE.llama2.c.MIT").is_file()
    assert (stories260k_hf_dir / "tok512.bin").read_bytes() == paths.data_file("stories260K/tok512.bin").read_bytes()


# ---------------------------------------------------------------------------------------------- loader
def test_state_dict_names_match_hf_and_our_model(loaded):
    cfg, sd = loaded
    assert set(sd) == set(cfg.expected_shapes())
    assert all(tuple(v.shape) == cfg.expected_shapes()[k] and v.dtype == torch.float32 for k, v in sd.items())
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    ours = LlamaModel(cfg)
    assert set(ours.state_dict()) == set(sd)
    ours.load_state_dict(sd, strict=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict()))
    assert set(hf.state_dict()) == set(sd)
    hf.load_state_dict(sd, strict=True)


def test_read_llama2c_matches_converted_dir(loaded):
    cfg, sd = loaded
    cfg2, sd2 = read_llama2c(paths.data_file("stories260K/stories260K.bin"))
    assert cfg2 == cfg
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_rope_row_permutation(loaded):
    """q/k rows: llama2.c row (h, i, parity) ↦ HF row (h, parity, i); v is untouched."""
    import numpy as np

    raw = paths.data_file("stories260K/stories260K.bin").read_bytes()
    D = 64
    f = np.frombuffer(raw, dtype="<f4", offset=28)
    wq0 = torch.from_numpy(f[512 * D + 5 * D: 512 * D + 5 * D + D * D].copy()).view(D, D)
    _, sd = loaded
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    hd = 8
    for h in range(8):
        for i in range(hd // 2):
            assert torch.equal(q[h * hd + i], wq0[h * hd + 2 * i])
            assert torch.equal(q[h * hd + hd // 2 + i], wq0[h * hd + 2 * i + 1])


def test_greedy_200_hf_from_pretrained_reproduces_llama2c(stories260k_hf_dir, tok, expected_text):
    hf = transformers.LlamaForCausalLM.from_pretrained(stories260k_hf_dir).eval()  # default (sdpa) attention
    with torch.no_grad():
        out = hf.generate(torch.tensor([[1]]), max_new_tokens=STEPS, do_sample=False,
                          attention_mask=torch.ones(1, 1, dtype=torch.long), pad_token_id=0)
    gen = out[0, 1:].tolist()
    assert len(gen) == STEPS and 1 not in gen and 2 not in gen
    assert runc_stdout(tok, gen) == expected_text
    assert tok.decode([1] + gen) == expected_text


def test_greedy_200_our_model_reproduces_llama2c(model, tok, expected_text):
    cache = model.new_cache(1)
    logits = model.prefill(cache, 0, [1])
    gen = []
    for _ in range(STEPS):
        gen.append(int(logits.argmax()))
        logits = model.decode(cache, torch.tensor([0]), torch.tensor([gen[-1]]))[0]
    assert runc_stdout(tok, gen) == expected_text
    assert tok.decode([1] + gen) == expected_text
    # the training path agrees: teacher-forced argmax reproduces every greedy token
    with torch.no_grad():
        full = model(torch.tensor([[1] + gen]))
    assert full[0, :-1].argmax(-1).tolist() == gen


# ---------------------------------------------------------------------------------------------- numerics vs HF
def test_forward_matches_transformers_with_padding(model, hf_eager, stories260k_hf_dir):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 33), generator=g)
    mask = torch.ones(4, 33, dtype=torch.bool)
    mask[0, :9] = False  # left padding
    mask[1, 20:] = False  # right padding
    mask[2, :3] = False
    mask[2, 30:] = False
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ours = model(ids, mask, pos)
        ref = hf_eager(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        ours_default_pos = model(ids, mask)
        plain = model(ids)
        ref_plain = hf_eager(input_ids=ids).logits
    assert ours.dtype == torch.float32 and ours.shape == (4, 33, 512)
    assert (ours - ref)[mask].abs().max().item() <= fp32_atol(ref)
    assert torch.equal(ours_default_pos, ours)
    assert torch.isfinite(ours).all()
    assert (plain - ref_plain).abs().max().item() <= fp32_atol(ref_plain)
    # transformers' default SDPA kernel differs from eager by fp32 rounding only (logits are O(10))
    sdpa = transformers.LlamaForCausalLM.from_pretrained(stories260k_hf_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref_sdpa = sdpa(input_ids=ids).logits
    assert (plain - ref_sdpa).abs().max().item() <= 1e-4


def test_forward_is_differentiable(model):
    m = LlamaModel(model.config)
    m.load_state_dict(model.state_dict())
    logits = m(torch.tensor([[1, 403, 407, 261]]))
    logits.log_softmax(-1)[0, -1, 5].backward()
    assert m.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert m.lm_head.weight is m.model.embed_tokens.weight


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_prefill_and_decode_match_transformers(model, hf_eager, threads):
    """Cached paths vs transformers' full forward: equal to fp32 rounding (:func:`_util.fp32_atol`), whatever the
    thread count.

    The absolute difference reaches ~1.5e-5 on logits of magnitude ~19 (a few ulps): transformers' own
    KV-cache decode differs from its own full forward by the same amount, since sequence length and the thread
    count change the matmul blocking (regression, issue 28: a fixed 1e-5 failed at random under load).
    """
    with torch_threads(threads):
        _prefill_and_decode_match_transformers(model, hf_eager)


def _prefill_and_decode_match_transformers(model, hf_eager) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 512, (n,), generator=g) for n in (40, 23, 31)]
    with torch.no_grad():
        refs = [hf_eager(input_ids=s[None]).logits[0] for s in seqs]
    cache = model.new_cache(6, max_len=64)
    slots = [5, 1, 3]  # non-contiguous slots of different lengths
    starts = [10, 4, 25]
    for s, seq, st, ref in zip(slots, seqs, starts, refs):
        last = model.prefill(cache, s, seq[:st])
        assert last.shape == (512,) and last.dtype == torch.float32
        torch.testing.assert_close(last, ref[st - 1], rtol=0, atol=fp32_atol(ref))
        assert cache.length(s) == st
    pos = list(starts)
    while True:
        active = [i for i in range(3) if pos[i] < len(seqs[i])]
        if not active:
            break
        sl = torch.tensor([slots[i] for i in active])
        ids = torch.stack([seqs[i][pos[i]] for i in active])
        out = model.decode(cache, sl, ids)
        assert out.shape == (len(active), 512)
        for row, i in enumerate(active):
            torch.testing.assert_close(out[row], refs[i][pos[i]], rtol=0, atol=fp32_atol(refs[i]))
            pos[i] += 1
    assert [cache.length(s) for s in slots] == [len(s) for s in seqs]
    # contiguous-slot fast path gives the same numbers as the gather path
    c2 = model.new_cache(4, max_len=64)
    for s in range(3):
        model.prefill(c2, s, seqs[s][:20])
    a = model.decode(c2, torch.tensor([0, 1, 2]), torch.tensor([7, 8, 9]))
    c3 = model.new_cache(4, max_len=64)
    for s, slot in zip(range(3), (3, 0, 2)):
        model.prefill(c3, slot, seqs[s][:20])
    b = model.decode(c3, torch.tensor([3, 0, 2]), torch.tensor([7, 8, 9]))
    assert (a - b).abs().max().item() <= 1e-6


def test_cache_errors(model):
    cache = model.new_cache(2, max_len=4)
    with pytest.raises(IndexError):
        model.prefill(cache, 2, [1])
    with pytest.raises(ValueError):
        model.prefill(cache, 0, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        model.prefill(cache, 0, [])
    model.prefill(cache, 0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="full"):
        model.decode(cache, torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match="duplicate"):
        model.decode(cache, torch.tensor([1, 1]), torch.tensor([5, 6]))


# ---------------------------------------------------------------------------------------------- tokenizer
SENTENCES = [
    "Once upon a time, there was a little",
    "One day, a boy named Tom went to the park.",
    "Lily and her mom went to the store.\nThey bought apples!",
    'She said, "I want to play with your ball, but I can\'t find it."',
    "Numbers 1234 and symbols #$%&*@ [] {} ~",
    "café naïve 你好 🙂",
    "a",
]


def test_tokenizer_matches_sentencepiece(tok):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(paths.data_file("stories260K/tok512.reconstructed.model")))
    assert tok.vocab_size == sp.get_piece_size() == 512
    for s in SENTENCES:
        ids = tok.encode(s, bos=True)
        assert ids == [1] + sp.encode(s), s
        assert tok.decode(ids) == s == sp.decode(ids[1:])
        assert tok.encode(s, bos=False, eos=True) == sp.encode(s) + [2]


def test_tokenizer_roundtrip_and_rules(tok):
    for s in SENTENCES + ["double  spaces  too", "tab\there", "x" * 300]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("") == [1] and tok.encode("", bos=False) == []
    assert tok.bos_id == 1 and tok.eos_id == 2
    # byte fallback: "\n" has no piece, so it is <0x0A> = 10 + 3
    assert 13 in tok.encode("a\nb") and tok.pieces[13] == b"<0x0A>"
    assert tok.decode([13]) == "\n"
    # llama2.c: the leading space of a piece is stripped only right after BOS
    once = tok.encode("Once", bos=False)
    assert tok.pieces[once[0]].startswith(b" ")
    assert tok.decode([1] + once) == "Once" and tok.decode(once) == " Once"
    assert tok.decode([1, 2] + once) == " Once"  # EOS skipped but still the previous token
    with pytest.raises(ValueError):
        tok.decode([512])


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        Llama2cTokenizer.from_file(tmp_path / "nope.bin")
    raw = paths.data_file("stories260K/tok512.bin").read_bytes()
    bad = tmp_path / "tok.bin"
    bad.write_bytes(raw[:1000])
    with pytest.raises(ModelFormatError, match="tok.bin"):
        Llama2cTokenizer.from_file(bad)
    bad.write_bytes(raw[:4] + struct.pack("<fi", 0.0, 10**6))
    with pytest.raises(ModelFormatError, match="claims"):
        Llama2cTokenizer.from_file(bad)


# ---------------------------------------------------------------------------------------------- bad files
def _bin() -> bytes:
    return paths.data_file("stories260K/stories260K.bin").read_bytes()


def test_missing_and_truncated_bin(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        read_llama2c(tmp_path / "missing.bin")
    p = tmp_path / "trunc.bin"
    raw = _bin()
    p.write_bytes(raw[:-1000])
    with pytest.raises(ModelFormatError, match=f"truncated.*implies {len(raw)} bytes, got {len(raw) - 1000}"):
        read_llama2c(p)
    p.write_bytes(raw[:10])
    with pytest.raises(ModelFormatError, match="expected at least 28 bytes, got 10"):
        read_llama2c(p)
    p.write_bytes(raw + b"\0" * 8)
    with pytest.raises(ModelFormatError, match="trailing bytes"):
        read_llama2c(p)


@pytest.mark.parametrize(
    "header, match",
    [
        ((64, 172, 5, 8, 4, 512, 0), "max_position_embeddings=0"),
        ((-64, 172, 5, 8, 4, 512, 512), "hidden_size=-64"),
        ((63, 172, 5, 8, 4, 512, 512), "not divisible"),
        ((64, 172, 5, 8, 3, 512, 512), "multiple of num_key_value_heads"),
        ((0x41414141,) * 7, "nonsense|truncated"),
    ],
)
def test_garbage_header(tmp_path, header, match):
    p = tmp_path / "bad.bin"
    p.write_bytes(struct.pack("<7i", *header) + _bin()[28:])
    with pytest.raises(ModelFormatError, match=match):
        read_llama2c(p)


def test_hf_dir_errors(tmp_path, stories260k_hf_dir):
    d = tmp_path / "hf"
    shutil.copytree(stories260k_hf_dir, d)
    cfg_json = json.loads((d / "config.json").read_text())
    # config.json of another architecture (transformers fills defaults for missing keys: the weights then disagree)
    broken = dict(cfg_json, architectures=["MistralForCausalLM"], model_type="mistral")
    (d / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ModelFormatError, match="unsupported architecture.*supported: LlamaForCausalLM, "
                                               "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_hf_dir(d)
    broken = {k: v for k, v in cfg_json.items() if k != "num_key_value_heads"}
    (d / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ModelFormatError, match=r"k_proj.weight has shape \[32, 64\], expected \[64, 64\]"):
        load_hf_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps(cfg_json))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    # missing + unexpected tensor names
    sd2 = dict(sd)
    del sd2["model.layers.3.mlp.up_proj.weight"]
    sd2["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(sd2, str(d / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"missing tensor\(s\) \['model.layers.3.mlp.up_proj.weight'\]"
                                               r".*unexpected tensor\(s\) \['model.layers.9.mlp.up_proj.weight'\]"):
        load_hf_dir(d)
    # wrong shape
    sd3 = dict(sd)
    sd3["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(sd3, str(d / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"k_proj.weight has shape \[64, 64\], expected \[32, 64\]"):
        load_hf_dir(d)
    # tied head omitted (as save_pretrained writes it): accepted and filled in
    sd4 = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    save_file(sd4, str(d / "model.safetensors"))
    _, got = load_hf_dir(d)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelFormatError, match="safetensors"):
        load_hf_dir(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no weights"):
        load_hf_dir(d)
    (d / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="config.json not found"):
        load_hf_dir(d)


def test_validate_state_dict_dtype(loaded):
    cfg, sd = loaded
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    with pytest.raises(ModelFormatError, match="model.norm.weight has dtype"):
        validate_state_dict(cfg, bad)


def test_ensure_converted_idempotent_and_missing_data(tmp_path, monkeypatch, stories260k_hf_dir):
    d1 = ensure_converted(tmp_path)
    stamp = (d1 / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(tmp_path) == d1
    assert (d1 / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    assert (d1 / "model.safetensors").read_bytes() == (stories260k_hf_dir / "model.safetensors").read_bytes()
    monkeypatch.setenv("RLBOOST_DATA", str(tmp_path / "empty"))
    # issue 48: without the data directory the package's own copy of stories260K is converted (the same bytes)
    d2 = ensure_converted(tmp_path / "other")
    assert (d2 / "model.safetensors").read_bytes() == (stories260k_hf_dir / "model.safetensors").read_bytes()
    assert paths.data_file("stories260K/stories260K.bin").is_relative_to(paths.PACKAGED_DATA)
    monkeypatch.setattr(paths, "PACKAGED_DATA", tmp_path / "no-package-data")
    with pytest.raises(paths.DataFileMissing, match="stories260K.bin"):
        ensure_converted(tmp_path / "third")
    assert not (tmp_path / "third" / STORIES260K_DIRNAME).exists()


def test_convert_rejects_missing_tokenizer(tmp_path):
    with pytest.raises(ModelFormatError, match="tokenizer file not found"):
        convert_llama2c(paths.data_file("stories260K/stories260K.bin"), tmp_path / "nope.bin", tmp_path / "o")


def test_untied_checkpoint_layout(tmp_path, loaded):
    """A negative vocab_size means an untied classifier follows the RoPE tables."""
    cfg, sd = loaded
    raw = bytearray(_bin())
    struct.pack_into("<i", raw, 20, -512)
    head = torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64) / 1000
    p = tmp_path / "untied.bin"
    p.write_bytes(bytes(raw) + head.numpy().astype("<f4").tobytes())
    cfg2, sd2 = read_llama2c(p)
    assert not cfg2.tie_word_embeddings
    assert torch.equal(sd2["lm_head.weight"], head)
    assert torch.equal(sd2["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    m = LlamaModel.from_state_dict(cfg2, sd2)
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    convert_llama2c(p, paths.data_file("stories260K/tok512.bin"), tmp_path / "hf")
    cfg3, sd3 = load_hf_dir(tmp_path / "hf")
    assert cfg3 == cfg2 and torch.equal(sd3["lm_head.weight"], head)


def test_the_torch_backend_gives_the_policys_logits_as_the_interface_says(stories260k_hf_dir):
    """``TrainerBackend.logits`` (both backends): the policy's fp32 logits on the CPU, equal to the model's forward."""
    from rlboost_hpc.models.llama import LlamaModel
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

    from _util import load_hf_dir

    cfg, sd = load_hf_dir(stories260k_hf_dir)
    be = TorchBackend(cfg, sd, lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    got = be.logits(ids)
    with torch.no_grad():
        want = LlamaModel.from_state_dict(cfg, dict(sd)).eval()(ids)
    assert got.shape == (2, 9, cfg.vocab_size) and got.dtype == torch.float32 and got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
