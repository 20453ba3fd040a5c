#!/usr/bin/env bash
# Build the vLLM CPU lane: a venv with torch 2.13.0 (CPU), kvcore editable, and vLLM
# (0.34.0 unless VLLM_VERSION says otherwise) installed without its dependency tree, plus
# the modules its offloading code imports. Import only: no transfers. 0.25.1 pins torch
# 2.11 but its offloading modules import against the CPU 2.13 all the same.
#
#   ci/install_vllm.sh [VENV]      VENV defaults to .venv-vllm in the repo
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
source "$repo/ci/engine_venv.sh"

# vLLM's run-time imports on the offloading path (REFERENCE.md §4), under the constraints.
deps=(
    numpy msgspec packaging psutil pyzmq urllib3 regex requests transformers cbor2
    aiohttp oss-harmony openai pillow pybase64 cachetools cloudpickle uvloop
    py-cpuinfo prometheus_client xgrammar fastapi partial-json-parser llguidance
    einops pytest
)

build_engine_venv "${1:-$repo/.venv-vllm}" "$repo/ci/constraints-vllm-cpu.txt" \
    "vllm==${VLLM_VERSION:-0.34.0}" vllm.v1.kv_offload.cpu.manager "${deps[@]}"
