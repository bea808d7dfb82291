"""LoRA through SGLang's adapter API (issue 49), against a real SGLang 0.5.23 server on CPU (tiny Qwen3).

SGLang's LoRA path runs on CPU with its ``torch_native`` LoRA kernels once pinned host memory is a no-op (the CPU
route's test stand-in, ``tests/sglang_cpu/stubs/sitecustomize.py``: SGLang 0.5.23 asks for pinned memory
unconditionally). stories260K is not used here: SGLang's CPU route pads its MLP width (172 → 192) and then refuses its
adapter's shapes.

One server (k = 1: two adapter versions servable) for every check: the served logprobs equal the torch engine's
with the same adapter (two versions in one batch); a load goes in while a request runs and is refused beyond two
versions; an unload of a version a request in flight names is refused at once (sglang#32238: it never waits); a churn
of versions keeps the server's own list of loaded adapters at ≤ 2 (AReaL#1385, trl#7017).
"""
from __future__ import annotations

import time

import pytest
import torch

from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.lora import init_adapter
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.rollout.engines.base import EngineError, GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from sglang_cpu import stub_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(600)]

torch.set_num_threads(1)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, stop_token_ids=())


def _adapter(arch, seed: int) -> dict[str, torch.Tensor]:
    a = init_adapter(arch, ALL, 4, seed)
    g = torch.Generator().manual_seed(seed + 100)
    return {k: (torch.randn(v.shape, generator=g) * 0.3 if "lora_B" in k else v) for k, v in a.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from _models import make_model_dir
    from rlboost_hpc.rollout.engines.factory import make_sglang_engine

    root = tmp_path_factory.mktemp("sglang-lora")
    m = load_model_dir(make_model_dir(root / "qwen3", "qwen3", tied=False, seed=2))
    spec = AdapterSpec(rank=4, alpha=8.0, targets=ALL, base_checksum=1, base_bytes=1, base_dtype="float32",
                       base_path=str(m.path), max_adapters=2)
    eng = make_sglang_engine(m.hf_config, m.state_dict, 4, work_dir=root / "engine", device="cpu", env=stub_env(),
                             log_path=root / "server.log", startup_timeout_s=300, adapter=spec)
    yield m, spec, eng
    eng.close()


def test_sglang_serves_each_adapter_version_as_the_torch_engine_does(served):
    m, spec, eng = served
    ref = TorchEngine(m.arch, m.state_dict, max_batch=4, max_len=256, adapter=spec)
    a1, a2 = _adapter(m.arch, 1), _adapter(m.arch, 2)
    for e in (eng, ref):
        for v in list(e.adapter_versions()):
            e.unload_adapter(v)
        e.load_adapter(a1, 1)
        e.load_adapter(a2, 2)
    prompt = m.tokenizer.encode_chat("What is 7 times 6?")
    reqs = [GenRequest(rid=f"r{i}", prompt_ids=prompt, max_new_tokens=8, sampling=GREEDY, adapter_version=v)
            for i, v in enumerate((1, 2, 1, 2))]
    got, want = generate_all(eng, reqs), generate_all(ref, reqs)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert max(abs(x - y) for x, y in zip(got[rid][1], want[rid][1])) < 1e-4, rid
    assert want["r0"][0] != want["r1"][0]  # two versions, two outputs, in one batch


def test_loads_never_wait_unloads_of_a_named_version_are_refused_and_the_server_holds_at_most_k_plus_1(served):
    m, spec, eng = served
    for v in list(eng.adapter_versions()):
        eng.unload_adapter(v)
    eng.load_adapter(_adapter(m.arch, 10), 10)
    prompt = m.tokenizer.encode_chat("Tom has 3 apples. How many now?")
    alone = generate_all(eng, [GenRequest(rid="alone", prompt_ids=prompt, max_new_tokens=48, sampling=GREEDY)])
    eng.add(GenRequest(rid="long", prompt_ids=prompt, max_new_tokens=48, sampling=GREEDY, adapter_version=10))
    ids = list(eng.step()[0].token_ids) if eng.num_active else []
    t0 = time.monotonic()
    eng.load_adapter(_adapter(m.arch, 11), 11)  # while "long" runs on version 10
    assert eng.adapter_versions() == [10, 11] and eng.version == 11
    with pytest.raises(EngineError, match="2 adapter versions"):
        eng.load_adapter(_adapter(m.arch, 12), 12)
    with pytest.raises(EngineError, match="in flight"):
        eng.unload_adapter(10)
    assert time.monotonic() - t0 < 30  # no call waited for "long" to finish
    while eng.num_active:
        for ev in eng.step():
            ids += ev.token_ids
    assert ids == alone["alone"][0]  # "long" finished on version 10, untouched by the load of 11
    loaded = []
    for v in range(20, 40):  # a churn of versions: unload the idle oldest before each load
        eng.unload_adapter(eng.adapter_versions()[0])
        eng.load_adapter(_adapter(m.arch, v % 3), v)
        reply = eng.control.call("GET", "/v1/models", None, what="models")
        loaded.append(sum(1 for x in reply.get("data", []) if str(x.get("id", "")).startswith("rlboost-v")))
    assert set(loaded) == {spec.max_adapters} and eng.adapter_versions() == [38, 39]
