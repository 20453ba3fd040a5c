#!/usr/bin/env bash
# Build the vLLM CPU lane: a venv with torch 2.13.0 (CPU), kvcore editable, and vLLM
# 0.33.0 installed without its dependency tree (which pins a CUDA torch and GPU kernel
# packages), plus the modules its offloading code imports. Import only: no transfers.
#
#   ci/install_vllm.sh [VENV]      VENV defaults to .venv-vllm in the repo
#
# Safe to run again: an existing venv is reused and pip skips what is installed.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
constraints="$repo/ci/constraints-vllm-cpu.txt"
vllm_version="${VLLM_VERSION:-0.33.0}"

# vLLM's run-time imports on the offloading path (REFERENCE.md §4), under the constraints.
deps=(
    numpy msgspec packaging psutil pyzmq urllib3 regex requests transformers cbor2
    aiohttp oss-harmony openai pillow pybase64 cachetools cloudpickle uvloop
    py-cpuinfo prometheus_client xgrammar fastapi partial-json-parser llguidance
    einops pytest
)

if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

"${pip[@]}" -c "$constraints" torch==2.13.0
"${pip[@]}" -c "$constraints" -e "$repo[dev]"
"${pip[@]}" --no-deps "vllm==$vllm_version"
"${pip[@]}" -c "$constraints" "${deps[@]}"

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import torch

assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: F401

print(f"vllm {md.version('vllm')}, torch {torch.__version__}")
PY
