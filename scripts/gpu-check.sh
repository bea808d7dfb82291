#!/usr/bin/env bash
# The GPU check of "bring your own model" (run on a lent GPU machine through the device tool, ≤ 10 minutes):
#   1. the gpu-marked tests (engine logits CUDA bf16 vs CPU fp32, one torch-backend step on CUDA, pinned pool);
#   2. a Qwen3-0.6B-shaped random checkpoint with the real Qwen2 tokenizer, 10 steps of the main job with the
#      Megatron backend on CUDA, the reserved engine and 4 torch workers on CUDA (tokens/s, logprob gap);
#   3. the Megatron step's MFU (benchmarks/bench_megatron.py) and TorchEngine vs transformers.generate at batch
#      1/32/128 for stories260K and the Qwen3-0.6B shape (bf16);
#   4. weight transfer: export pinned vs pageable, plain vs encrypted pulls on 16 cores, the pull (+ H2D) vs a
#      torch.distributed broadcast (gloo; NCCL needs two devices).
# Prepare on the CPU machine first (see ../shared/notes/gpu-device.md): wheels in .whl/ for what the GPU machine
# lacks (the note's list plus cryptography>=47 — an abi3 wheel — and cffi), `bash scripts/fetch-test-tokenizers.sh`,
# then copy the tokenizer and stories260K into the tree:
#   mkdir -p .gpu && cp -r ~/.cache/rlboost-hpc/test-assets/qwen2-tokenizer .gpu/ && cp -r ../shared/data .gpu/data
# and run it with carry [".whl", ".gpu"]. Results go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
  export PYTHONPATH=$PWD/.site:$PWD
else
  export PYTHONPATH=$PWD
fi
export RLBOOST_DATA=${RLBOOST_DATA:-$PWD/.gpu/data}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
{
  echo "== gpu tests"; timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_weight_layout.py -p no:cacheprovider 2>&1 | tail -5
  echo "== checkpoint"; python3 benchmarks/make_random_checkpoint.py .gpu/qwen3-0.6b --tokenizer .gpu/qwen2-tokenizer
  echo "== engine vs HF generate: stories260K fp32"
  timeout 120 python3 benchmarks/bench_engine.py --device cuda --batches 1 32 128 --new 128 --repeat 3
  echo "== engine vs HF generate: Qwen3-0.6B shape bf16"
  timeout 180 python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 --model .gpu/qwen3-0.6b \
      --batches 1 32 128 --new 128 --repeat 3
  echo "== Megatron step MFU"; timeout 120 python3 benchmarks/bench_megatron.py --no-torch
  echo "== export: device-to-host publish vs a pinned non_blocking copy (issue 14 item 4)"
  timeout 120 python3 benchmarks/bench_export.py --device cuda --sizes-mib 256 1024 --reps 5
  echo "== weight pull on 16 cores: plain vs CURVE vs sealed chunks by I/O threads (issue 14 item 7)"
  timeout 150 python3 benchmarks/bench_curve.py --skip-ingest --sizes-mib 256 --streams 4 --io-threads 1 4 --reps 3
  echo "== delta versions on 16 cores: encoding rate, overlapped with the publish vs after it (issue 14 item 1)"
  timeout 150 python3 benchmarks/bench_delta.py --skip-demo --size-mib 1024 --reps 3 --lrs 1e-6 3e-5
  echo "== weight pull (+ H2D) vs a torch.distributed broadcast: gloo; NCCL with >= 2 GPUs (issue 14 item 3)"
  timeout 120 python3 benchmarks/bench_nccl.py --device cuda --sizes-mib 256 1024 --reps 3
  echo "== main job: Qwen3-0.6B shape, Megatron on CUDA, reserved engine + 4 torch workers on CUDA"
  timeout 300 python3 -m rlboost_hpc.cli run --config configs/gsm8k-qwen3.toml --out "$OUT/run" --no-progress \
      --set model.path="'$PWD/.gpu/qwen3-0.6b'" --set trainer.backend=megatron --set trainer.bf16=true \
      --set trainer.steps=10 --set cluster.max_workers=4 --set rollout.max_new_tokens=256 \
      --set rollout.prompts_per_step=16 --set task.heldout_prompts=16 --set policy.t_seed_initial_s=5 \
      --set cluster.min_changes=0 --set cluster.min_removals=0 --set cluster.min_starts=0 \
      --set trainer.export_model=false
  python3 - "$OUT/run" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
rep = json.loads((d / "report.json").read_text())
m = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
print({k: rep.get(k) for k in ("steps", "throughput_tokens_per_s", "responses_lost", "responses_duplicated",
                                "tokens_trained_off_version", "preemptions", "model")})
print("logprob |trainer - engine| mean per step:", [round(x.get("logprob_diff", 0), 4) for x in m])
PY
} 2>&1 | tee "$OUT/gpu-check.log"
