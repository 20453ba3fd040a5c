#!/usr/bin/env bash
# Build the SGLang CPU lane: a venv with torch 2.13.0 (CPU), kvcore editable, and
# SGLang 0.5.23 installed without its dependency tree (which pins a CUDA torch and
# sglang-kernel), plus the modules it imports at run time. Import only: no transfers.
#
#   ci/install_sglang.sh [VENV]      VENV defaults to .venv-sglang in the repo
#
# Safe to run again: an existing venv is reused and pip skips what is installed.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-sglang}"
constraints="$repo/ci/constraints-cpu.txt"
sglang_version="${SGLANG_VERSION:-0.5.23}"

# SGLang's run-time imports, at the versions REFERENCE.md §3 lists for 0.5.23.
deps=(
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
    pydantic pyzmq tqdm ipython aiohttp dill gguf
    "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
)

if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

"${pip[@]}" -c "$constraints" torch==2.13.0
"${pip[@]}" -c "$constraints" -e "$repo[dev]"
# pip then lists SGLang's own pins it leaves unmet (CUDA torch, sglang-kernel, ...):
# expected, since only the modules kvcore's tests import are installed.
"${pip[@]}" --no-deps "sglang==$sglang_version"
"${pip[@]}" -c "$constraints" "${deps[@]}"

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import torch

assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
print(f"sglang {md.version('sglang')}, torch {torch.__version__}")
PY
