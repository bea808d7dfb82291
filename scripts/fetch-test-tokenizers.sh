#!/usr/bin/env bash
# Fetch the real tokenizers the tests use (tests only; nothing here is needed to run the project).
#
# No PyPI wheel ships Qwen's tokenizer, but llama-cpp-python's *source* package vendors llama.cpp's vocabulary
# files: ggml-vocab-qwen2.gguf holds Qwen2's real vocabulary, merges and chat template. This script downloads that
# source package from the package index pip is configured with, extracts the GGUF file and converts it once with
# transformers (AutoTokenizer(gguf_file=...)) into a Hugging Face tokenizer directory:
#   ~/.cache/rlboost-hpc/test-assets/qwen2-tokenizer/{tokenizer.json,tokenizer_config.json,chat_template.jinja}
# (override the root with RLBOOST_TEST_ASSETS). Idempotent: exits at once when the directory is complete.
# Usage: scripts/fetch-test-tokenizers.sh   (after the README's install step; VENV=/path/to/venv to choose one)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
DEST=${RLBOOST_TEST_ASSETS:-$HOME/.cache/rlboost-hpc/test-assets}
OUT="$DEST/qwen2-tokenizer"
LLAMA_CPP_PYTHON=0.3.36
if [[ -f $OUT/tokenizer.json && -f $OUT/tokenizer_config.json ]]; then
  exit 0
fi
if [[ ! -x $VENV/bin/python ]]; then
  echo "fetch-test-tokenizers: no venv at $VENV (run the README's install step first)" >&2
  exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: --dest "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON"
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf'
gguf_dir=$(dirname "$(find "$tmp" -name ggml-vocab-qwen2.gguf | head -n 1)")
mkdir -p "$DEST"
"$VENV/bin/python" - "$gguf_dir" "$OUT.tmp" <<'PY'
import sys
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file="ggml-vocab-qwen2.gguf")
assert tok.chat_template, "ggml-vocab-qwen2.gguf carries no chat template"
tok.save_pretrained(sys.argv[2])
PY
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "fetch-test-tokenizers: Qwen2 tokenizer in $OUT"
