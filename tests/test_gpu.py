"""CUDA checks (``@pytest.mark.gpu``; the only tests that may skip: they need a CUDA device).

The engine on CUDA in bf16 agrees with the fp32 CPU engine within bf16 tolerance, and one GRPO step of the torch
backend on CUDA (bf16 autocast, fp32 master weights) matches the CPU step's loss and moves the same weights.
"""
from __future__ import annotations

import pytest
import torch
from _models import make_model_dir
from _util import load_hf_dir

from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.trainer.backends.base import Sample
from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["stories", "qwen3"])
def model(request, stories260k_hf_dir, tmp_path_factory):
    if request.param == "stories":
        return load_hf_dir(stories260k_hf_dir)
    return load_hf_dir(make_model_dir(tmp_path_factory.mktemp("q3"), "qwen3", tied=False))


def test_engine_logits_on_cuda_bf16_match_cpu_fp32(model):
    arch, sd = model
    cpu = LlamaModel.from_state_dict(arch, sd).eval()
    gpu = LlamaModel.from_state_dict(arch, sd, device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, arch.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = cpu(ids)
        got = gpu(ids.cuda()).cpu()
        cache = gpu.new_cache(2, max_len=80)
        last = gpu.prefill(cache, 0, ids[0, :48].cuda()).cpu()
        step = gpu.decode(cache, [0], ids[0, 48:49].cuda())[0].cpu()
    scale = ref.abs().max().item()
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() <= 0.05 * scale
    assert (last - ref[0, 47]).abs().max().item() <= 0.05 * scale
    assert (step - ref[0, 48]).abs().max().item() <= 0.05 * scale
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_one_backend_step_on_cuda_matches_the_cpu_step(model):
    arch, sd = model
    g = torch.Generator().manual_seed(1)
    batch = [Sample(prompt_ids=torch.randint(0, arch.vocab_size, (12,), generator=g).tolist(),
                    response_ids=torch.randint(0, arch.vocab_size, (20,), generator=g).tolist(),
                    behaviour_logprobs=[-5.0] * 20, advantage=a) for a in (1.0, -1.0, 0.5, -0.5)]
    out = {}
    for dev, dt in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        b = TorchBackend(arch, sd, lr=1e-3, device=dev, dtype=dt, keep_reference=False)
        m = b.accumulate(batch, len(batch))
        b.optimizer_step()
        out[dev] = (m["loss"], {k: v.detach().float().cpu() for k, v in b.export_weights().items()})
    assert abs(out["cuda"][0] - out["cpu"][0]) <= 0.05 * max(1.0, abs(out["cpu"][0]))
    w0 = sd["model.norm.weight"].float()
    moved_cpu = out["cpu"][1]["model.norm.weight"] - w0
    moved_gpu = out["cuda"][1]["model.norm.weight"] - w0
    assert moved_gpu.abs().sum() > 0 and torch.nn.functional.cosine_similarity(moved_cpu, moved_gpu, dim=0) > 0.9
