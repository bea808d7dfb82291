"""Bring your own model: Hugging Face model directories (Llama, Qwen2, Qwen3) with their tokenizers.

The tiny Qwen3 / Qwen2 / Llama checkpoints are made here (random init via ``transformers``, saved sharded, a BPE
tokenizer trained on GSM8K text with a chat template); stories260K is the converted real model.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _models import hf_model, make_model_dir
from _util import fp32_atol, load_hf_dir, torch_threads

from rlboost_hpc import paths
from rlboost_hpc.models.arch import ModelFormatError, UnsupportedModel, arch_from_hf
from rlboost_hpc.models.hf_dir import PolicyTokenizer, load_model_dir
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.models.tokenizer import Llama2cTokenizer
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.tasks.base import get_task

from _util import SCENARIOS  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """``qwen3`` (untied, head_dim 32 × 4 heads ≠ hidden 64), ``qwen2`` (tied, q/k/v biases), ``llama3`` (Llama
    with RoPE scaling of type llama3)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "qwen3": make_model_dir(root / "qwen3", "qwen3", tied=False, seed=1),
        "qwen2": make_model_dir(root / "qwen2", "qwen2", tied=True, seed=2),
        "llama3": make_model_dir(root / "llama3", "llama", tied=False, seed=3, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
    }


# ------------------------------------------------------------------------------------------ stories260K as HF
def test_stories260k_hf_tokenizer_encodes_every_demo_prompt_as_tok512(stories260k_hf_dir):
    """The converted tokenizer.json (loaded by AutoTokenizer) reproduces llama2.c's encoder: every demo prompt,
    the reference text, GSM8K questions and awkward spacing (SentencePiece would collapse repeated spaces)."""
    ref = Llama2cTokenizer.from_file(paths.data_file("stories260K/tok512.bin"))
    m = load_model_dir(stories260k_hf_dir)
    task = get_task("stories")
    assert not m.tokenizer.use_chat and m.tokenizer.stop_ids == (2, 1)
    texts = [task.format_prompt(p) for p in task.train_prompts() + task.heldout_prompts()]
    texts += [paths.data_file("stories260K/expected_greedy_200.txt").read_text(), "a  b   c", "  lead", "x\t\ny"]
    texts += [json.loads(line)["question"] for line in paths.data_file("gsm8k/test.jsonl").read_text().splitlines()[:50]]
    for t in texts:
        assert m.tokenizer.encode_text(t) == ref.encode(t, bos=True), t
    for p in task.heldout_prompts():
        assert task.prompt_ids(p, m.tokenizer) == ref.encode(task.format_prompt(p), bos=True)


def test_stories260k_greedy_200_through_the_model_directory(stories260k_hf_dir):
    m = load_model_dir(stories260k_hf_dir)
    eng = TorchEngine(m.arch, m.state_dict, max_batch=1)
    req = GenRequest(rid="g", prompt_ids=[1], max_new_tokens=200,
                     sampling=SamplingParams(temperature=0.0, stop_token_ids=m.tokenizer.stop_ids))
    ids, _, _ = generate_all(eng, [req])["g"]
    expected = paths.data_file("stories260K/expected_greedy_200.txt").read_text()
    assert len(ids) == 200 and not set(ids) & {1, 2}
    assert m.tokenizer.decode(ids) == " " + expected  # a continuation keeps its leading space (llama2.c strips it
    #                                                   only when printing right after BOS)


# ------------------------------------------------------------------------------------------ tiny Qwen / Llama
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama3"])
def test_our_model_and_engine_logits_equal_transformers(tiny_dirs, family, threads):
    """fp32 logits of our model (forward, prefill and decode) equal transformers' to fp32 rounding
    (:func:`_util.fp32_atol`) at any thread count: Qwen3's q/k norm and explicit head_dim, Qwen2's biases and tied
    head, Llama-3 RoPE scaling at positions past the original context (32) — and the weights come from sharded
    safetensors."""
    with torch_threads(threads):
        _logits_equal_transformers(tiny_dirs, family)


def _logits_equal_transformers(tiny_dirs, family: str) -> None:
    d = tiny_dirs[family]
    assert len(list(d.glob("model-*.safetensors"))) >= 2 and (d / "model.safetensors.index.json").is_file()
    arch, sd = load_hf_dir(d)
    assert arch.family == ("llama" if family == "llama3" else family)
    if family == "qwen3":
        assert arch.qk_norm and arch.head_dim * arch.num_attention_heads != arch.hidden_size
    if family == "qwen2":
        assert arch.qkv_bias and arch.tie_word_embeddings
    if family == "llama3":
        assert arch.rope_scaling is not None and arch.rope_scaling.original_max_position_embeddings == 32
    hf = hf_model(d)
    ours = LlamaModel.from_state_dict(arch, sd).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 120), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    tol = fp32_atol(ref)
    assert (got - ref).abs().max().item() <= tol
    eng = TorchEngine(arch, sd, max_batch=2)
    cache_logits = eng.model.prefill(eng.cache, 0, ids[0, :100])
    assert (cache_logits - ref[0, 99]).abs().max().item() <= tol
    for t in range(100, 120):
        step = eng.model.decode(eng.cache, [0], ids[0, t:t + 1])[0]
        assert (step - ref[0, t]).abs().max().item() <= tol, t


def test_generation_stops_at_either_stop_id_of_the_model_directory(tiny_dirs, tmp_path):
    """Stop ids come from generation_config.json (a list) + the tokenizer's EOS: make the 2nd and then the 3rd
    greedy token of a prompt a stop id of the model directory and generation ends exactly there."""
    d = tmp_path / "q3"
    shutil.copytree(tiny_dirs["qwen3"], d)
    m = load_model_dir(d)
    prompt = m.tokenizer.encode_chat("Tom has 3 apples and buys 4 more. How many apples does he have?")

    def greedy(stop_ids, n=8):
        eng = TorchEngine(m.arch, m.state_dict, max_batch=1)
        req = GenRequest(rid="r", prompt_ids=prompt, max_new_tokens=n,
                         sampling=SamplingParams(temperature=0.0, stop_token_ids=stop_ids))
        return generate_all(eng, [req])["r"]

    free, _, fin = greedy(())
    assert fin == "length" and len(free) == 8
    unused = next(t for t in range(m.arch.vocab_size) if t not in free)
    # the 2nd greedy token as the second stop id, then the 3rd as the first one
    for k, eos in ((1, [unused, free[1]]), (2, [free[2], unused])):
        assert free[k] not in free[:k], "pick another prompt: the stop token appears earlier"
        gen = json.loads((d / "generation_config.json").read_text())
        (d / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[int(e) for e in eos])))
        tok = PolicyTokenizer.from_dir(d, m.arch)
        assert tok.stop_ids[:2] == tuple(eos)
        ids, _, fin = greedy(tok.stop_ids)
        assert fin == "stop" and ids == free[:k + 1]


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_prompt_ids_are_the_chat_template_with_no_doubled_bos(tiny_dirs, family):
    """The trainer's prompt ids (GSM8K through Task.prompt_ids) equal ``apply_chat_template(..., add_generation_
    prompt=True)``; the qwen2 tokenizer adds a BOS to plain text *and* its template writes one: exactly one."""
    m = load_model_dir(tiny_dirs[family])
    task = get_task("gsm8k", n_train=4, n_heldout=4)
    assert m.tokenizer.use_chat
    for p in task.heldout_prompts():
        ids = task.prompt_ids(p, m.tokenizer)
        ref = m.tokenizer.hf.apply_chat_template([{"role": "user", "content": task.chat_content(p)}],
                                                 add_generation_prompt=True)
        assert ids == list(ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref)
        assert "Please reason step by step" in m.tokenizer.decode(ids)
        bos = m.tokenizer.hf.bos_token_id
        assert bos is None or ids.count(bos) == 1
    off = load_model_dir(tiny_dirs[family], chat="off")
    p = task.heldout_prompts()[0]
    assert task.prompt_ids(p, off.tokenizer) == off.tokenizer.hf(task.format_prompt(p))["input_ids"]


def test_a_real_qwen_tokenizer_renders_gsm8k_and_reads_its_stop_ids(tmp_path):
    """Qwen2's real vocabulary and chat template (shipped in llama-cpp-python's source package; fetched by
    scripts/fetch-test-tokenizers.sh): the GSM8K prompt as an instruct model sees it, and the stop ids a Qwen2.5
    instruct checkpoint's generation_config.json gives (<|im_end|>, <|endoftext|>)."""
    from rlboost_hpc.models.arch import ModelArch

    src = Path.home() / ".cache/rlboost-hpc/test-assets/qwen2-tokenizer"
    assert (src / "tokenizer.json").is_file(), f"{src} missing: run scripts/fetch-test-tokenizers.sh"
    d = tmp_path / "qwen"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    arch = ModelArch("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 32768, qkv_bias=True, tie_word_embeddings=True,
                     eos_token_ids=(151645,))
    tok = PolicyTokenizer.from_dir(d, arch)
    assert tok.stop_ids == (151645, 151643) and tok.use_chat
    task = get_task("gsm8k", n_train=2, n_heldout=2)
    p = task.heldout_prompts()[0]
    ids = task.prompt_ids(p, tok)
    text = tok.hf.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert p.text.strip() in text and ids.count(151644) == 3  # <|im_start|> × (system, user, assistant)
    assert tok.decode(ids[-3:]) == "assistant\n"


# ------------------------------------------------------------------------------------------ bad directories
def _run(repo_root: Path, out: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(repo_root / "configs/local.toml"),
            "--out", str(out), "--no-progress", "--set", "cluster.max_workers=0", "--set", "trainer.steps=1"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=repo_root)


def test_bad_model_directories_are_refused_naming_the_file_or_key(tiny_dirs, tmp_path):
    """Missing shard, wrong shapes, unknown architecture, no tokenizer, another RoPE type, a missing directory:
    a ModelFormatError naming the file or key; through the CLI (one per kind of error) exit 2, no traceback."""
    base = tiny_dirs["qwen3"]
    cfg = json.loads((base / "config.json").read_text())

    def variant(name: str, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
        d = tmp_path / name
        shutil.copytree(base, d)
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        for f in drop:
            (d / f).unlink()
        return d

    cases = [
        (variant("missing-shard", drop=("model-00002-of-00005.safetensors",)), "model-00002-of-00005.safetensors"),
        (variant("wrong-shapes", dict(cfg, intermediate_size=128)), "has shape"),
        (variant("unknown-arch", dict(cfg, architectures=["GPT2LMHeadModel"], model_type="gpt2")),
         "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
        (variant("no-tokenizer", drop=("tokenizer.json", "tokenizer_config.json")), "no tokenizer"),
        # regression (issue 28): transformers' advice (install sentencepiece or tiktoken) was the message
        (variant("no-tokenizer-json", drop=("tokenizer.json",)), "tokenizer.json not found"),
        (variant("yarn", dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0})), "rope_type='yarn'"),
        (tmp_path / "absent", "model directory not found"),
    ]
    for d, needle in cases:
        with pytest.raises(ModelFormatError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            load_model_dir(d)
    with pytest.raises(ModelFormatError, match="task.chat_template = 'on' but the tokenizer has no chat template"):
        PolicyTokenizer(SimpleNamespace(chat_template=None), (), chat="on")
    for args, needle in [
        ((f"model.path='{cases[0][0]}'",), "model-00002-of-00005.safetensors"),
        ((f"model.path='{tmp_path / 'no-tokenizer-json'}'",), "tokenizer.json not found"),
        ((f"model.hf_dir='{base}'",), "model.hf_dir was renamed: use model.path"),
        (("task.chat_template=on",), "no chat template"),
        *([(("trainer.device=cuda",), "trainer.device = 'cuda'")] if not torch.cuda.is_available() else []),
    ]:
        p = _run(REPO, tmp_path / "out", *args)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-2000:])
        plain = [ln for ln in p.stderr.splitlines() if not ln.startswith("{")]  # (JSON log lines: --no-progress)
        assert "sentencepiece" not in p.stderr and len(plain) <= 2, p.stderr[-2000:]


def test_unsupported_variants_are_named():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    for extra, needle in [({"hidden_act": "gelu"}, "hidden_act='gelu'"), ({"mlp_bias": True}, "mlp_bias"),
                          ({"attention_bias": True}, "attention_bias"),
                          ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'")]:
        with pytest.raises(UnsupportedModel, match=needle):
            arch_from_hf({**base, **extra})
    with pytest.raises(ModelFormatError, match="not found"):
        arch_from_hf("/nonexistent/dir")


# ------------------------------------------------------------------------------------------ the main job
@pytest.mark.integration
@pytest.mark.slow
def test_main_job_trains_a_qwen3_checkpoint_with_preemption_and_exports_it(tiny_dirs, tmp_path):
    """``rlboost-hpc run --set model.path=DIR --set task.name=gsm8k`` on the tiny Qwen3 (chat template, two stop
    ids) with local workers: a warned preemption held until the victim holds partial responses, nothing lost,
    duplicated or off-version; evaluation and KL come from the Qwen model; the trained policy, pulled back from
    the weight server into ``RUN/model``, loads in transformers with the trainer's logits."""
    from test_demo_run import diagnose, run_cli

    from _util import preempted_run

    d = tiny_dirs["qwen3"]
    out = tmp_path / "run"
    p = run_cli(REPO, out, *preempted_run(d, tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    why = diagnose(p, out)
    assert rep["model"]["architecture"] == "Qwen3ForCausalLM" and rep["model"]["chat_template"] is True, why
    assert rep["steps"] == 3 and rep["responses_trained"] == 3 * 8 * 8, why
    assert rep["preemptions_with_warning"] >= 1 and rep["responses_migrated"] >= 1, why
    assert rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, why
    assert rep["tokens_trained_off_version"] == 0 and rep["prompts_not_trained_exactly_once"] == 0, why
    assert 0 <= rep["kl_to_reference_nats_per_token"] < 1.0 and 0 <= rep["reward_heldout_after"] <= 1, why
    # the examples show the prompt as the model saw it: through the chat template (regression, issue 28)
    assert rep["examples_after"] and rep["examples_after"][0].startswith("<|im_start|>user\n"), rep["examples_after"]
    # round trip: weight server → puller → RUN/model → transformers, equal to the trainer's final model
    exported = Path(rep["model_out"])
    hf = hf_model(exported)
    ckpt = torch.load(out / "checkpoints/step-000003/backend/torch_backend.pt", map_location="cpu",
                      weights_only=False)["model"]
    arch = arch_from_hf(exported)
    trainer_model = LlamaModel.from_state_dict(arch, ckpt).eval()
    ids = torch.randint(0, arch.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert (ref - trainer_model(ids)).abs().max().item() <= fp32_atol(ref)
    assert not torch.equal(ckpt["model.embed_tokens.weight"],
                           load_model_dir(d).state_dict["model.embed_tokens.weight"])  # it did train


@pytest.mark.megatron
@pytest.mark.integration
@pytest.mark.slow
def test_the_tiny_qwen3_trains_with_the_megatron_backend_at_tp2(tiny_dirs, tmp_path):
    """The same model directory through ``trainer.backend = "megatron"`` at TP=2 (two gloo ranks on the CPU,
    rank 1 following rank 0's backend calls), with a local worker: the whole run takes the Qwen3."""
    from test_megatron_parallel import _launch

    out = tmp_path / "tp2"
    sets = [f"model.path='{tiny_dirs['qwen3']}'", "task.name=gsm8k", "trainer.steps=2", "task.train_prompts=16",
            "task.heldout_prompts=4", "trainer.eval_samples=1", "rollout.max_new_tokens=32"]
    p = _launch(REPO, ["--tp", "2"], [SCENARIOS, "demo", "--out", str(out),
                                      *[a for s in sets for a in ("--set", s)]], timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["model"]["architecture"] == "Qwen3ForCausalLM"
    assert rep["steps"] == 2 and rep["responses_trained"] == 2 * 64 and rep["responses_lost"] == 0
    assert rep["tokens_trained_off_version"] == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(m["logprob_diff"]) < 1e-3 for m in lines)  # Megatron's logprobs = the torch engine's


@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_serves_the_tiny_qwen3_with_transformers_logprobs(tiny_dirs, tmp_path):
    """SGLang's CPU route starts on the model's own config.json (Qwen3: q/k norm, head_dim 32) with our pulled
    weights; its greedy tokens' logprobs equal transformers' within 1e-4."""
    from sglang_cpu import stub_env

    from rlboost_hpc.rollout.engines.factory import make_sglang_engine

    m = load_model_dir(tiny_dirs["qwen3"])
    eng = make_sglang_engine(m.hf_config, m.state_dict, 4, work_dir=tmp_path / "model", device="cpu",
                             env=stub_env(), log_path=tmp_path / "server.log", startup_timeout_s=240)
    try:
        prompts = [m.tokenizer.encode_chat(q) for q in ("What is 7 times 6?", "Tom has 3 apples. How many now?")]
        reqs = [GenRequest(rid=f"q{i}", prompt_ids=p, max_new_tokens=12, sampling=SamplingParams(temperature=0.0))
                for i, p in enumerate(prompts)]
        out = generate_all(eng, reqs)
    finally:
        eng.close()
    hf = hf_model(tiny_dirs["qwen3"])
    for i, p in enumerate(prompts):
        ids, lps, _ = out[f"q{i}"]
        assert len(ids) == 12
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert ids == logits[len(p) - 1:-1].argmax(-1).tolist()
        assert (torch.tensor(lps) - ref).abs().max().item() <= 1e-4
