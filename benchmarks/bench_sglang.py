"""SGLangEngine overhead: streaming through the adapter vs SGLang's own non-streaming ``/generate``, and weight
loads (``/begin_weight_update`` → ``/update_weights_from_tensor`` → ``/end_weight_update`` → ``/flush_cache``)
time vs bytes.

Streaming: the same ``--prompts`` story prompts × ``--new`` greedy tokens each (no stop token, so every
request produces exactly ``--new`` tokens), (a) through :class:`SGLangEngine` (``generate_all``: one streaming
``/generate`` per request, ids + logprobs folded into TokenEvents) and (b) as ONE batched non-streaming
``/generate`` call with ``return_logprob`` (SGLang's own fastest path for the same work). Interleaved
``--repeat`` times on one server; the figure is generated tokens / wall time, median; ratio = a / b
(goal ≥ 0.95). Run for each ``--stream-intervals`` value (one server each).

Weights: random Llama models of growing size (plus stories260K); for each, the median of ``--repeat`` full
:meth:`SGLangEngine.load_weights` calls, split into the client-side shared-memory copy + pickling and the
server calls, and MB/s; side by side, the same version in bf16 tensor by tensor and as a pull delivers it (a bf16
``FlatState``: one shared-memory segment in SGLang's flattened-bucket format instead of one per tensor); and a
version in the server's dtype pulled into private memory (copied into a fresh segment per load) vs into the
worker's shared-memory base buffer (``shared_host_buffer``: SGLang maps the pulled bytes, no copy).

On a CPU-only machine the server needs the test stand-ins for torchvision/sgl_kernel (tests/sglang_cpu, a
test aid); they are used automatically when ``--device cpu``.

Streaming chunks are cumulative (every chunk the whole response so far: SGLang's default, as the run's servers
stream); ``--incremental`` adds the ablation with ``--incremental-streaming-output`` (each chunk its new tokens).

Usage: ``.venv/bin/python benchmarks/bench_sglang.py [--prompts 16] [--new 128] [--repeat 3]
[--stream-intervals 1 8 16] [--incremental] [--weight-hidden 256 512 1024] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from rlboost_hpc.models.arch import ModelArch  # noqa: E402
from rlboost_hpc.models.hf_dir import load_model_dir  # noqa: E402
from rlboost_hpc.models.llama2c import ensure_converted  # noqa: E402
from rlboost_hpc.models.layout import FlatState, state_view  # noqa: E402
from rlboost_hpc.models.tokenizer import Llama2cTokenizer  # noqa: E402
from rlboost_hpc.rollout.engines.factory import make_sglang_engine  # noqa: E402
from rlboost_hpc.rollout.engines.sglang_engine import SGLangEngine  # noqa: E402
from rlboost_hpc.rollout.engines.sglang_server import http_json  # noqa: E402
from rlboost_hpc.rollout.engines.sglang_weights import (  # noqa: E402
    as_shared, serialize_named_tensors, shared_host_buffer)
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams  # noqa: E402
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all  # noqa: E402

STORY_PROMPTS = [
    "Once upon a time, there was a little", "One day, a boy named", "Lily and her mom went to the",
    "Tom had a big red", "The sun was shining and", "Sam wanted to play with his", "A little bird sat on a",
    "Mia found a shiny",
]


def _env(device: str) -> dict[str, str]:
    if device != "cpu":
        return {}
    from sglang_cpu import stub_env  # TEST AID: import-time stand-ins, CPU only

    return stub_env()


def bench_streaming(model_dir: Path, model_config: dict, prompts: list[list[int]], new: int, repeat: int,
                    stream_interval: int, device: str, log_dir: Path, incremental: bool = False) -> dict:
    eng = SGLangEngine.launch(model_dir, max_batch=len(prompts), model_config=model_config, device=device,
                                 env=_env(device), stream_interval=stream_interval, incremental_streaming=incremental,
                                 log_path=log_dir / f"stream{stream_interval}-{incremental}.log", startup_timeout_s=300)
    sp = SamplingParams(temperature=0.0, stop_token_ids=())
    n = [0]

    def adapter() -> float:
        n[0] += 1
        reqs = [GenRequest(f"a{n[0]}-{i}", p, new, sp) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = generate_all(eng, reqs)
        dt = time.perf_counter() - t0
        assert all(len(v[0]) == new and len(v[1]) == new for v in out.values())
        return dt

    def native() -> float:
        body = {"input_ids": prompts, "return_logprob": True,
                "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
        t0 = time.perf_counter()
        status, out = http_json(eng.control.host, eng.control.port, "POST", "/generate", body, timeout=600)
        dt = time.perf_counter() - t0
        assert status == 200 and len(out) == len(prompts), (status, str(out)[:300])
        assert all(len(o["output_ids"]) == new for o in out)
        return dt

    try:
        adapter(), native()  # warm-up (first-call allocations, radix cache)
        ta, tn = [], []
        for _ in range(repeat):
            ta.append(adapter())
            tn.append(native())
    finally:
        eng.close()
    toks = len(prompts) * new
    a, b = toks / statistics.median(ta), toks / statistics.median(tn)
    pairs = sorted(x / y for x, y in zip(tn, ta))  # per interleaved pair: native time / adapter time
    return {"stream_interval": stream_interval, "incremental": incremental, "requests": len(prompts), "new_tokens": new,
            "adapter_tok_s": round(a, 1), "native_nonstream_tok_s": round(b, 1), "ratio": round(a / b, 3),
            "ratio_best_of": round(min(tn) / min(ta), 3), "ratio_median_pair": round(statistics.median(pairs), 3),
            "adapter_runs_s": [round(x, 3) for x in ta], "native_runs_s": [round(x, 3) for x in tn]}


def random_llama(hidden: int, layers: int, vocab: int = 512, seed: int = 0) -> tuple[ModelArch, dict]:
    heads = max(1, hidden // 64)
    cfg = ModelArch(family="llama", vocab_size=vocab, hidden_size=hidden,
                    intermediate_size=int(hidden * 8 / 3) // 16 * 16, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_ids=(2,))
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(s, generator=g) * 0.02 if len(s) == 2 else torch.ones(s))
          for k, s in cfg.expected_shapes().items()}
    return cfg, sd


def bench_weights(cfg: ModelArch, sd: dict, name: str, repeat: int, device: str, log_dir: Path) -> dict:
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    eng = make_sglang_engine(cfg.to_hf_dict(), sd, 4, work_dir=log_dir / f"model-{name}", device=device,
                                env=_env(device), log_path=log_dir / f"weights-{name}.log", startup_timeout_s=300)
    try:
        total, prep, flat_total, bf16_total, copy_total, shm_total = [], [], [], [], [], []
        sdt = eng.server_dtype or torch.bfloat16
        shm = None
        for v in range(1, repeat + 1):
            new = {k: t * (1 + 0.01 * v) for k, t in sd.items()}
            t0 = time.perf_counter()
            payload = serialize_named_tensors([(k, as_shared(t, eng.server_dtype)) for k, t in new.items()])
            prep.append(time.perf_counter() - t0)
            del payload
            t0 = time.perf_counter()
            eng.load_weights(new, 5 * v - 4)
            total.append(time.perf_counter() - t0)
            bf16 = {k: t.to(torch.bfloat16) for k, t in new.items()}
            t0 = time.perf_counter()
            eng.load_weights(bf16, 5 * v - 3)  # bf16 tensor by tensor (a version with several dtypes)
            bf16_total.append(time.perf_counter() - t0)
            pulled = FlatState.pack(bf16)  # as a pull delivers a bf16 version
            t0 = time.perf_counter()
            eng.load_weights(pulled, 5 * v - 2)  # one shared-memory segment (flattened bucket)
            flat_total.append(time.perf_counter() - t0)
            # a version in the server's dtype: pulled into private memory (copied into a fresh shared-memory
            # segment per load) vs pulled into the worker's shared-memory base buffer (no copy)
            packed = FlatState.pack(new, sdt)
            if shm is None:
                shm = shared_host_buffer(packed.nbytes)
            shm.view(sdt).copy_(packed.flat)  # what the pull writes into the base buffer
            in_shm = state_view(shm, packed.table)
            t0 = time.perf_counter()
            eng.load_weights(packed, 5 * v - 1)
            copy_total.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.load_weights(in_shm, 5 * v)
            shm_total.append(time.perf_counter() - t0)
        probe = generate_all(eng, [GenRequest("p", [1, 5, 9], 4, SamplingParams(temperature=0.0, stop_token_ids=()))])
        assert len(probe["p"][0]) == 4
    finally:
        eng.close()
    t_torch = []
    te = TorchEngine(cfg, sd, max_batch=1)
    for v in range(repeat):
        t0 = time.perf_counter()
        te.load_weights(sd, v + 1)
        t_torch.append(time.perf_counter() - t0)
    med = statistics.median(total)
    return {"model": name, "params_M": round(sum(v.numel() for v in sd.values()) / 1e6, 2),
            "bytes_MB": round(nbytes / 1e6, 1), "load_s": round(med, 3), "tensors": len(sd),
            "load_bf16_s": round(statistics.median(bf16_total), 3),
            "load_flat_bf16_s": round(statistics.median(flat_total), 3),
            "server_dtype": str(sdt).replace("torch.", ""),
            "load_flat_private_s": round(statistics.median(copy_total), 3),
            "load_flat_shared_s": round(statistics.median(shm_total), 3),
            "client_shm_pickle_s": round(statistics.median(prep), 3), "MB_per_s": round(nbytes / 1e6 / med, 1),
            "torch_engine_load_s": round(statistics.median(t_torch), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stream-intervals", type=int, nargs="*", default=[1, 8, 16])
    ap.add_argument("--weight-hidden", type=int, nargs="*", default=[256, 512, 1024],
                    help="hidden sizes of the random 8-layer Llamas for the weight-load curve (none: skip)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--incremental", action="store_true",
                    help="ablation: also stream each interval as incremental chunks (--incremental-streaming-output)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    model_dir = ensure_converted(log_dir / "models")
    policy = load_model_dir(model_dir)
    cfg, sd = policy.arch, policy.state_dict
    tok = Llama2cTokenizer.from_file(model_dir / "tok512.bin")
    prompts = [tok.encode(STORY_PROMPTS[i % len(STORY_PROMPTS)]) + [i % 7 + 3] for i in range(args.prompts)]
    results: dict = {"streaming": [], "weights": [], "logs": str(log_dir)}
    for si, incremental in [(si, inc) for si in args.stream_intervals for inc in (False, True)
                            if not inc or args.incremental]:
        r = bench_streaming(model_dir, cfg.to_hf_dict(), prompts, args.new, args.repeat, si, args.device, log_dir,
                            incremental)
        results["streaming"].append(r)
        print(f"streaming  interval={si:<3} {'incremental' if incremental else 'cumulative ':<11} "
              f"{r['requests']} req x {r['new_tokens']} tok: adapter "
              f"{r['adapter_tok_s']:8.1f} tok/s   native non-streaming {r['native_nonstream_tok_s']:8.1f} tok/s   "
              f"ratio {r['ratio']:.3f} (best-of {r['ratio_best_of']:.3f}, median pair {r['ratio_median_pair']:.3f})",
              flush=True)
    models = [("stories260K", cfg, sd)] + [(f"rand-h{h}-L8", *random_llama(h, 8)) for h in args.weight_hidden]
    for name, c, s in models:
        r = bench_weights(c, s, name, args.repeat, args.device, log_dir)
        results["weights"].append(r)
        print(f"weights    {name:<14} {r['bytes_MB']:8.1f} MB {r['tensors']:4d} tensors  load {r['load_s']:7.3f} s "
              f"(client shm+pickle {r['client_shm_pickle_s']:.3f} s)  {r['MB_per_s']:8.1f} MB/s   "
              f"bf16 per tensor {r['load_bf16_s']:.3f} s / as one FlatState segment {r['load_flat_bf16_s']:.3f} s   "
              f"torch engine {r['torch_engine_load_s']:.3f} s", flush=True)
        print(f"           {'':<14} in the server's dtype ({r['server_dtype']}): pulled into private memory "
              f"{r['load_flat_private_s']:.3f} s / into shared memory {r['load_flat_shared_s']:.3f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
