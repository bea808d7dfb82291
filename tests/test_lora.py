"""LoRA (issue 49), fast parts: the adapter's math in the trainer (PEFT) and the torch engine (unmerged slots), the
exports PEFT and transformers load, the base's identity and the node cache, the instance's base sources, the torch
backend's adapter training and checkpoints, and the bad inputs (exit 2 naming the key or file)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _util import fp32_atol
from rlboost_hpc.models.arch import ModelFormatError
from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.models.lora import (adapter_shapes, canonical_base, init_adapter, merge, read_peft_dir,
                                     write_peft_dir)
from rlboost_hpc.protocol.adapter import AdapterSpec, adapter_version_checksum
from rlboost_hpc.weights.lora_base import BaseMismatch, fetch_base
from rlboost_hpc.rollout.engines.base import EngineError, GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.trainer.lora import LoraSettings, PeftAdapter
from rlboost_hpc.weights.lora_base import NodeBaseCache, base_identity

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, stop_token_ids=())


@pytest.fixture(scope="module")
def policy(stories260k_hf_dir):
    return load_model_dir(stories260k_hf_dir)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from _models import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("lora-qwen3") / "qwen3", "qwen3", tied=False, seed=4)


def trained_adapter(arch, targets=ALL, rank=4, seed=0, scale=0.3) -> dict[str, torch.Tensor]:
    """An adapter as after training: PEFT's A, a random (nonzero) B."""
    ad = init_adapter(arch, targets, rank, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return {k: (torch.randn(v.shape, generator=g) * scale if "lora_B" in k else v) for k, v in ad.items()}


def spec_for(arch, *, rank=4, alpha=8.0, targets=ALL, n=1, dtype="float32", **kw) -> AdapterSpec:
    return AdapterSpec(rank=rank, alpha=alpha, targets=list(targets), base_checksum=kw.pop("base_checksum", 0),
                       base_bytes=0, base_dtype=dtype, max_adapters=n, **kw)


# ------------------------------------------------------------------------------------------ the adapter's math
def test_peft_in_the_trainer_and_the_engines_unmerged_slots_give_the_same_logits(policy):
    """One adapter, two implementations: PEFT's LoRA layers in the trainer's model and the engine's slots (also in a
    decode batch mixing two versions); the adapter moves the logits, a zero B gives the base's."""
    arch = policy.arch
    ad = trained_adapter(arch)
    m = LlamaModel.from_state_dict(arch, dict(policy.state_dict))
    peft_ad = PeftAdapter(m, arch, rank=4, alpha=8.0, dropout=0.0, targets=ALL, init=ad, wire_dtype=torch.float32)
    ids = torch.tensor([[1, 403, 407, 261, 378, 300, 290]])
    with torch.no_grad():
        lt = m(ids)
        with peft_ad.disabled():
            lb = m(ids)
    assert (lt - lb).abs().max().item() > 0.05  # the adapter matters
    eng = TorchEngine(arch, policy.state_dict, max_batch=4, max_len=64, adapter=spec_for(arch, n=2))
    eng.load_adapter(peft_ad.flat, 7)
    eng.load_adapter({k: torch.zeros_like(v) for k, v in ad.items()}, 8)
    c = eng.model.new_cache(1, 64)
    with torch.no_grad():
        l7 = eng.model.prefill(c, 0, ids[0].tolist(), adapter=eng._slot_of[7])
        l8 = eng.model.prefill(c, 0, ids[0].tolist(), adapter=eng._slot_of[8])
    assert (l7 - lt[0, -1]).abs().max().item() <= fp32_atol(lt)
    assert (l8 - lb[0, -1]).abs().max().item() <= fp32_atol(lb)
    # a batch mixing both versions decodes each row with its own adapter: equal to each version alone
    reqs = [GenRequest(rid=f"r{i}", prompt_ids=ids[0].tolist(), max_new_tokens=6, sampling=GREEDY,
                       adapter_version=v) for i, v in enumerate((7, 8, 7, 8))]
    mixed = generate_all(eng, reqs)
    alone = {v: generate_all(eng, [GenRequest(rid="x", prompt_ids=ids[0].tolist(), max_new_tokens=6,
                                              sampling=GREEDY, adapter_version=v)])["x"] for v in (7, 8)}
    for i, v in enumerate((7, 8, 7, 8)):
        assert mixed[f"r{i}"][0] == alone[v][0]
        assert max(abs(a - b) for a, b in zip(mixed[f"r{i}"][1], alone[v][1])) < 1e-5
    assert alone[7][0] != alone[8][0]


def test_adapter_slots_load_while_requests_run_and_unload_only_what_no_request_names(policy):
    """An adapter load never waits for running requests (a free slot, the adapter's bytes only); unloading a version a
    request names is refused; slots are bounded."""
    arch = policy.arch
    eng = TorchEngine(arch, policy.state_dict, max_batch=4, max_len=64, adapter=spec_for(arch, n=2))
    with pytest.raises(EngineError, match="not loaded"):
        eng.add(GenRequest(rid="early", prompt_ids=[1, 2], max_new_tokens=3))
    n = eng.load_adapter(trained_adapter(arch, seed=1), 1)
    assert n == eng.model.adapters.nbytes == sum(v.numel() for v in trained_adapter(arch).values()) * 4
    assert eng.last_load_bytes == n < sum(t.numel() * 4 for t in policy.state_dict.values()) / 5
    eng.add(GenRequest(rid="a", prompt_ids=[1, 403, 407], max_new_tokens=20, sampling=GREEDY))
    eng.step()
    eng.load_adapter(trained_adapter(arch, seed=2), 2)  # while "a" runs: no wait, "a" keeps version 1
    assert eng.version == 2 and eng.adapter_versions() == [1, 2]
    with pytest.raises(EngineError, match="all 2 adapter slots"):
        eng.load_adapter(trained_adapter(arch, seed=3), 3)
    with pytest.raises(EngineError, match="in flight"):
        eng.unload_adapter(1)
    assert eng.adapter_in_use(1) and not eng.adapter_in_use(2)
    eng.unload_adapter(2)
    eng.load_adapter(trained_adapter(arch, seed=3), 3)
    while eng.num_active:
        eng.step()
    eng.unload_adapter(1)
    assert eng.adapter_versions() == [3]
    with pytest.raises(EngineError, match="do not match"):
        eng.load_adapter({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, 4)


# ------------------------------------------------------------------------------------------ exports
def test_the_exported_adapter_loads_with_peft_and_the_merged_model_with_transformers(qwen3, tmp_path):
    """PEFT's directory format (what RUN_DIR/adapter holds) on the HF model gives the trainer's logits, and so does
    the merged model loaded by transformers."""
    import peft
    import transformers

    from _models import hf_model
    from rlboost_hpc.models.hf_dir import save_model_dir

    pol = load_model_dir(qwen3)
    arch = pol.arch
    ad = trained_adapter(arch, targets=("q_proj", "v_proj", "down_proj"), rank=8)
    m = LlamaModel.from_state_dict(arch, dict(pol.state_dict))
    PeftAdapter(m, arch, rank=8, alpha=16.0, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"), init=ad)
    ids = torch.randint(0, arch.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(ids)
    d = write_peft_dir(tmp_path / "adapter", ad, rank=8, alpha=16.0, dropout=0.0,
                       targets=("q_proj", "v_proj", "down_proj"), base_model=str(qwen3), base_checksum=5)
    assert {p.name for p in d.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    pm = peft.PeftModel.from_pretrained(hf_model(qwen3), d).eval()
    with torch.no_grad():
        assert (pm(input_ids=ids).logits - ref).abs().max().item() <= fp32_atol(ref)
    merged = save_model_dir(tmp_path / "merged", pol, merge(canonical_base(pol.state_dict, arch), ad, 2.0))
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    assert (got - ref).abs().max().item() <= 10 * fp32_atol(ref)  # merged: one more rounding per weight


def test_an_adapter_directory_of_another_rank_model_or_base_is_refused_naming_the_file(policy, qwen3, tmp_path):
    arch = policy.arch
    ad = trained_adapter(arch)
    d = write_peft_dir(tmp_path / "a", ad, rank=4, alpha=8.0, dropout=0.0, targets=ALL, base_model="x",
                       base_checksum=42)
    assert set(read_peft_dir(d, arch, rank=4, alpha=8.0, targets=ALL, base_checksum=42)) == set(ad)
    with pytest.raises(ModelFormatError, match="another base"):
        read_peft_dir(d, arch, rank=4, alpha=8.0, targets=ALL, base_checksum=43)
    with pytest.raises(ModelFormatError, match="trainer.lora.rank = 8"):
        read_peft_dir(d, arch, rank=8, alpha=8.0, targets=ALL)
    q = load_model_dir(qwen3).arch  # same rank and targets, another architecture: other shapes
    with pytest.raises(ModelFormatError, match="adapter_model.safetensors: an adapter of another model"):
        read_peft_dir(d, q, rank=4, alpha=8.0, targets=ALL)
    with pytest.raises(ModelFormatError, match="adapter_config.json: missing"):
        read_peft_dir(tmp_path / "nothing", arch, rank=4, alpha=8.0, targets=ALL)


# ------------------------------------------------------------------------------------------ the base
def test_the_base_identity_is_the_base_servers_checksum_and_the_node_cache_verifies_it(policy, tmp_path):
    from rlboost_hpc.weights.server import WeightServer

    base = canonical_base(policy.state_dict, policy.arch)
    chk, nbytes = base_identity(base, torch.bfloat16, 4096)
    with WeightServer(chunk_bytes=4096, keep_versions=1, delta=False).start() as srv:
        man = srv.publish(0, base, dtype=torch.bfloat16)
    assert (man.checksum, man.total_bytes) == (chk, nbytes)
    assert base_identity(base, torch.float32, 4096)[0] != chk  # another dtype: another base
    cache = NodeBaseCache(tmp_path / "cache", keep=1)
    from rlboost_hpc.models import layout

    buf = layout.host_buffer(man.total_bytes)
    layout.flatten_into(buf, base, man.tensors)
    cache.store(man, buf)
    m2, b2 = cache.load(chk)
    assert m2.checksum == chk and torch.equal(b2, buf)
    data = next((tmp_path / "cache").glob("base-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    assert cache.load(chk) is None and not data.exists()  # a spoilt file is never used, and removed
    cache.store(man, buf)
    other = man.__class__(**{**{f: getattr(man, f) for f in man.__struct_fields__}, "checksum": 7})
    cache.store(other, buf)  # keep = 1: the older base goes
    assert len(list((tmp_path / "cache").glob("base-*.manifest"))) == 1


def test_an_instance_loads_the_base_from_model_path_else_pulls_it_once_and_keeps_it_on_the_node(policy, tmp_path):
    """model.path visible → no bytes moved; not visible → one pull from the base server, then the node's cache (a
    later instance pulls nothing); a model directory with other bytes → refused, naming it and both checksums."""
    from rlboost_hpc.models.hf_dir import save_model_dir
    from rlboost_hpc.weights.server import WeightServer

    arch = policy.arch
    base = canonical_base(policy.state_dict, arch)
    with WeightServer(chunk_bytes=8192, keep_versions=1, delta=False).start() as srv:
        man = srv.publish(0, base, dtype=torch.bfloat16)
        spec = AdapterSpec(rank=4, alpha=8, targets=list(ALL), base_checksum=man.checksum, base_bytes=man.total_bytes,
                           base_chunk_bytes=8192, base_path=str(policy.path), base_endpoint=srv.endpoint)
        cache = NodeBaseCache(tmp_path / "node", keep=2)
        kw = dict(keys=None, cache=cache, streams=2, window=2, timeout_s=10.0)
        got = fetch_base(spec, arch, **kw)
        assert got.source == "path" and got.wire_bytes == 0 and got.checksum == man.checksum
        unseen = AdapterSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__},
                                "base_path": str(tmp_path / "not-on-this-node")})
        pulled = fetch_base(unseen, arch, **kw)
        assert pulled.source == "pull" and pulled.wire_bytes >= man.total_bytes
        again = fetch_base(unseen, arch, **kw)
        assert again.source == "cache" and again.wire_bytes == 0
        assert all(torch.equal(again.state_dict[k].float(), pulled.state_dict[k].float()) for k in base)
        other = {k: (v + 0.5 if k == "model.norm.weight" else v) for k, v in policy.state_dict.items()}
        moved = save_model_dir(tmp_path / "other-model", policy, other)
        wrong = AdapterSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "base_path": str(moved)})
        with pytest.raises(BaseMismatch, match=f"{moved}.*has checksum .*; the run's base is {man.checksum:016x}"):
            fetch_base(wrong, arch, **kw)


def test_an_adapter_versions_identity_covers_its_base():
    s = AdapterSpec(rank=4, alpha=8, targets=["q_proj"], base_checksum=9, base_bytes=1)
    assert s.version_checksum(1) == adapter_version_checksum(1, 9) and s.scaling == 2.0
    assert len({adapter_version_checksum(1, 2), adapter_version_checksum(1, 3), adapter_version_checksum(4, 3)}) == 3


# ------------------------------------------------------------------------------------------ the torch backend
def _sample(prompt, resp, adv):
    from rlboost_hpc.trainer.backends.base import Sample

    return Sample(prompt_ids=prompt, response_ids=resp, behaviour_logprobs=[-1.0] * len(resp), advantage=adv)


def test_the_torch_backend_trains_the_adapter_only_its_reference_is_the_base_and_checkpoints_hold_the_adapter(
        policy, tmp_path):
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend
    from rlboost_hpc.trainer.checkpoint import CheckpointError

    arch = policy.arch
    init = init_adapter(arch, ALL, 4, 0)
    lo = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=ALL, init=init)
    b = TorchBackend(arch, policy.state_dict, lr=1e-2, lora=lo, wire_dtype=torch.bfloat16)
    assert set(b.export_weights()) == set(adapter_shapes(arch, ALL, 4)) and b.ref is None
    base_before = {k: v.clone() for k, v in b.model.state_dict().items() if "lora_" not in k}
    batch = [_sample([1, 403, 407], [261, 378, 300], 1.0), _sample([1, 403, 407], [290, 291, 292], -1.0)]
    ref0 = b.token_logprobs(batch, reference=True)
    pol0 = b.token_logprobs(batch)
    assert all(torch.allclose(a, r) for a, r in zip(ref0, pol0))  # B = 0: the adapter starts as the identity
    b.accumulate(batch, 2)
    b.optimizer_step()
    after = b.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # the base never moves
    assert any(b.export_weights()[k].abs().sum() > 0 for k in b.export_weights() if "lora_B" in k)
    ref1 = b.token_logprobs(batch, reference=True)
    assert all(torch.equal(a, r) for a, r in zip(ref0, ref1))  # the reference is the base, adapter off
    assert not all(torch.allclose(a, r) for a, r in zip(ref1, b.token_logprobs(batch)))
    b.save_checkpoint(tmp_path / "ck")
    st = torch.load(tmp_path / "ck" / "torch_backend.pt", weights_only=True)
    assert "model" not in st and set(st["adapter"]) == set(init)  # the adapter (and its moments) only
    b2 = TorchBackend(arch, policy.state_dict, lr=1e-2, lora=lo)
    b2.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(b2.export_weights()[k], b.export_weights()[k]) for k in init)
    full = TorchBackend(arch, policy.state_dict, lr=1e-2)
    with pytest.raises(CheckpointError, match="torch_backend.pt: a checkpoint of a run that trained a LoRA adapter"):
        full.load_checkpoint(tmp_path / "ck")


# ------------------------------------------------------------------------------------------ bad input
def _cli(*sets: str, out: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def test_bad_lora_settings_exit_2_naming_the_key(tmp_path):
    """A negative rank through the CLI (exit 2, one line naming the key); the other refusals come from the same config
    reader."""
    from rlboost_hpc.config import ConfigError, load_config

    p = _cli("trainer.lora.rank=-1", out=tmp_path / "r")
    assert p.returncode == 2 and "trainer.lora.rank" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    for sets, key in ((["trainer.lora.rank=4", 'trainer.lora.target_modules=["q_proj","qkv_proj"]'],
                       "trainer.lora.target_modules"),
                      (["trainer.lora.rank=4", "trainer.lora.dropout=1.5"], "trainer.lora.dropout"),
                      (["trainer.lora.rank=4", "trainer.lora.alpha=0"], "trainer.lora.alpha"),
                      (["trainer.lora.rank=4", "trainer.lora.export_merged=true", "trainer.export_model=false"],
                       "trainer.lora.export_merged")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, sets)


def test_an_adapter_directory_for_another_base_exits_2_naming_the_file(policy, qwen3, tmp_path):
    ad = trained_adapter(load_model_dir(qwen3).arch)
    d = write_peft_dir(tmp_path / "qwen-adapter", ad, rank=4, alpha=8.0, dropout=0.0, targets=ALL,
                       base_model=str(qwen3), base_checksum=1)
    (d / "rlboost_base.json").unlink()  # as PEFT itself writes it: the shapes tell
    p = _cli("trainer.lora.rank=4", "trainer.lora.alpha=8", f"trainer.lora.adapter_path='{d}'", "trainer.steps=1",
             out=tmp_path / "r")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "adapter_model.safetensors" in p.stderr and "Traceback" not in p.stderr
    same_shapes = write_peft_dir(tmp_path / "same-shapes", trained_adapter(policy.arch), rank=4, alpha=8.0,
                                 dropout=0.0, targets=ALL, base_model="elsewhere", base_checksum=12345)
    p = _cli("trainer.lora.rank=4", "trainer.lora.alpha=8", f"trainer.lora.adapter_path='{same_shapes}'",
             "trainer.steps=1", out=tmp_path / "r2")
    assert p.returncode == 2 and "rlboost_base.json" in p.stderr and "another base" in p.stderr, p.stderr[-2000:]


def test_a_checkpoint_of_the_other_kind_or_another_adapter_is_refused_before_anything_starts(policy, tmp_path):
    """Bad input: resuming a full run's checkpoint with ``trainer.lora`` on, a LoRA run's with it off, or one of
    another rank or targets — each is refused naming the checkpoint's file, before any service starts."""
    from types import SimpleNamespace

    from rlboost_hpc.run_setup import RunSetup, check_same_model
    from rlboost_hpc.rundir import RunDir
    from rlboost_hpc.trainer.checkpoint import CheckpointError

    def ckpt(lora):
        d = tmp_path / f"step-{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "trainer.json").write_text(json.dumps({"run": {"model": {
            "path": str(policy.path), "arch": policy.arch.to_json(), "lora": lora}}}))
        return d

    rec = {"rank": 4, "alpha": 8.0, "targets": list(ALL)}
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=ALL, init={})
    full_setup = SimpleNamespace(policy=policy, lora_record=lambda: None)
    lora_setup = SimpleNamespace(policy=policy, lora_record=lambda: RunSetup.lora_record(SimpleNamespace(lora=lora)))
    rd = RunDir(tmp_path)
    check_same_model(ckpt(None), full_setup, rd)  # same kind: fine
    check_same_model(ckpt(rec), lora_setup, rd)
    with pytest.raises(CheckpointError, match="trainer.json: a checkpoint of a run that trained every weight; this "
                                              "config trains a LoRA adapter"):
        check_same_model(ckpt(None), lora_setup, rd)
    with pytest.raises(CheckpointError, match="trained a LoRA adapter .rank 4.*this config trains every weight"):
        check_same_model(ckpt(rec), full_setup, rd)
    with pytest.raises(CheckpointError, match="rank 8"):
        check_same_model(ckpt({**rec, "rank": 8}), lora_setup, rd)
