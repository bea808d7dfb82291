#!/usr/bin/env bash
# Install SGLang 0.5.23 into the project venv the CPU way (tests and CI only; GPU machines use
# `pip install -e '.[sglang]'`, which pulls the normal CUDA build).
#
# Why not `pip install sglang`: it resolves to ~200 packages / ~4.6 GB of CUDA wheels (flashinfer, deep-ep,
# cutlass, torch 2.14.1 CUDA …) that are useless on a CPU box and replace our CPU torch. Instead:
#   1. keep the venv's CPU torch (a constraints file forbids pip from touching it),
#   2. `pip install --no-deps sglang==0.5.23`,
#   3. install the plain (pure-Python / CPU) dependencies it needs at import and serve time, by hand.
# Two modules SGLang imports are NOT installed here: `torchvision` (PyPI's wheel is a CUDA build that fails
# next to CPU torch) and `sgl_kernel` (its CPU build is not on PyPI). Import-time stand-ins for both live in
# tests/sglang_cpu/stubs/ and are put on the server's PYTHONPATH by the test tooling only (see
# docs/sglang.md); they are never installed into the venv.
#
# Idempotent: exits early when the venv already has exactly these versions. Usage:
#   scripts/install-sglang-cpu.sh            # project venv at ./.venv (created by the README's install step)
#   VENV=/path/to/venv scripts/install-sglang-cpu.sh
#   FORCE=1 scripts/install-sglang-cpu.sh    # reinstall even if the check passes
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
PIP=("$PY" -m pip)
SGLANG_VERSION=0.5.23
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x $PY ]]; then
  echo "install-sglang-cpu: no venv at $VENV (run the README's install step first: python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]')" >&2
  exit 2
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) || {
  echo "install-sglang-cpu: torch is not importable in $VENV; install torch==2.13.0 (the CPU wheel) first" >&2
  exit 2
}

# Pinned where SGLang 0.5.23 pins them (its METADATA), unpinned where it does not.
DEPS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "openai==2.8.0" "openai-harmony==0.0.4"
  "sentencepiece==0.2.1" "compressed-tensors==0.18.0" "soundfile==0.13.1" "triton==3.8.0"
  fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" orjson pydantic msgspec setproctitle pybase64 partial_json_parser
  interegular psutil requests aiohttp "prometheus-client>=0.20.0" python-multipart einops tiktoken tqdm pillow
  scipy packaging xxhash zstandard watchfiles distro easydict regex IPython dill gguf jsonschema
  "python-dateutil<3" numpy
)

check() {
  # Succeeds when sglang==$SGLANG_VERSION and every pinned dependency are present and sglang's server
  # modules import with the test stand-ins on the path.
  "$PY" - "$SGLANG_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
want = sys.argv[1]
assert version("sglang") == want, version("sglang")
for spec in ("transformers==5.19.0", "tokenizers==0.23.2", "xgrammar==0.2.7", "openai==2.8.0"):
    n, v = spec.split("==")
    assert version(n) == v, (n, version(n))
PY
  [[ $? -eq 0 ]] || return 1
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$ROOT/tests/sglang_cpu/stubs${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -c 'import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler' >/dev/null 2>&1
}

if [[ -z ${FORCE:-} ]] && check; then
  echo "install-sglang-cpu: sglang $SGLANG_VERSION already installed in $VENV (CPU route); nothing to do"
  exit 0
fi

t0=$(date +%s)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"   # never let a dependency swap our CPU torch for a CUDA build

echo "install-sglang-cpu: installing sglang $SGLANG_VERSION (no deps) + CPU dependencies into $VENV (torch $TORCH_VERSION kept)"
# (--no-warn-conflicts: pip would otherwise list every CUDA package sglang's metadata asks for and we skip on purpose)
"${PIP[@]}" install -q --no-warn-conflicts --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" install -q --no-warn-conflicts -c "$CONSTRAINTS" "${DEPS[@]}"
# A CUDA torchvision would shadow the stand-in and fail at import; remove it if something pulled it in.
if "$PY" -c 'import importlib.metadata as m; m.version("torchvision")' >/dev/null 2>&1; then
  "${PIP[@]}" uninstall -q -y torchvision
fi

if ! check; then
  echo "install-sglang-cpu: installed, but the import check failed; details:" >&2
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$ROOT/tests/sglang_cpu/stubs" \
    "$PY" -c 'import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler' >&2 || true
  exit 1
fi
echo "install-sglang-cpu: done in $(( $(date +%s) - t0 ))s"
