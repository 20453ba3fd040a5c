#!/usr/bin/env bash
# SGLang 0.5.23 HiCache A/B on the GPU machine in one device call (issue 4 item 8): the stock
# transfer methods against kvcore's hooks on the same pools and indices.
#
#   scripts/sglang_ab.sh [kvcore bench args...]      e.g. --quick, --tokens 65536
#
# Needs .whl-sglang/ (git-ignored, carried): SGLang without its dependency tree and the few
# modules its pool code imports that the GPU image lacks. sgl-kernel is not among them (its
# wheel is 373 MB); the bench stands in for it and reports the stock paths that need it as
# not runnable. SGLang's JIT HiCache kernels are built here by nvcc through apache-tvm-ffi.
# Build it with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_34_x86_64 (and _2_28, _2_17, 2014) -d .whl-sglang`
# of: sglang==0.5.23 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 pyzmq ipython traitlets
# pygments msgspec orjson dill gguf pybase64 starlette loguru sortedcontainers, and (the image
# of 2026-11-30 had no pydantic) pydantic pydantic-core annotated-types typing-inspection
# anyio sniffio typing-extensions. About 47 MB.
# Writes $OUT/sglang_ab.json, $OUT/sglang_ab.log and $OUT/env.txt (OUT defaults to out/sglang_ab).
set -uo pipefail
OUT=${OUT:-out/sglang_ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! ls .whl-sglang/*.whl >/dev/null 2>&1; then
    echo "sglang_ab: no wheels in .whl-sglang/ (carry it)" | tee "$OUT/sglang_ab.log"
    exit 2
fi
site=/tmp/sglang-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl-sglang/*.whl || exit 1
export PYTHONPATH="$PWD:$PWD/integrations:$site${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
# SGLang's JIT links -L$CUDA_HOME/lib64 -lcudart, CUDA_HOME defaulting to nvcc's grandparent:
# wrong when nvcc is a link from /usr/local/bin or /usr/bin.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    export CUDA_HOME
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvcc --version | tail -2
    echo "CUDA_HOME=${CUDA_HOME:-unset}"; ls "${CUDA_HOME:-/nonexistent}"/lib64/libcudart.so* 2>&1 | head -2
    python3 - <<'PY'
import importlib.metadata as md

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda)
print("dlpack exchange api:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
for name in ("sglang", "apache-tvm-ffi", "triton", "transformers", "torchvision", "pydantic"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
PY
} 2>&1 | tee "$OUT/env.txt"
started=$(date +%s)
timeout 540 python3 -m kvcore bench --engine sglang --json "$OUT/sglang_ab.json" "$@" 2>&1 \
    | tee "$OUT/sglang_ab.log"
rc=${PIPESTATUS[0]}
echo "sglang_ab: rc=$rc after $(($(date +%s) - started)) s" | tee -a "$OUT/sglang_ab.log"
exit "$rc"
