#!/usr/bin/env bash
# Build the SGLang CPU lane: a venv with torch 2.13.0 (CPU), kvcore editable, and
# SGLang (0.5.23 unless SGLANG_VERSION says otherwise) installed without its dependency
# tree, plus the modules it imports at run time. Import only: no transfers.
#
#   ci/install_sglang.sh [VENV]      VENV defaults to .venv-sglang in the repo
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
source "$repo/ci/engine_venv.sh"

# SGLang's run-time imports, at the versions REFERENCE.md §3 lists for 0.5.23.
deps=(
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
    pydantic pyzmq tqdm ipython aiohttp dill gguf
    "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
)

build_engine_venv "${1:-$repo/.venv-sglang}" "$repo/ci/constraints-cpu.txt" \
    "sglang==${SGLANG_VERSION:-0.5.23}" sglang.srt.plugins.hook_registry "${deps[@]}"
