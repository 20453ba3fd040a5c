# Sourced on the GPU machine by the SGLang scripts (sglang_ab.sh, sglang_sweep.sh): installs the
# carried .whl-sglang/ wheels (see sglang_ab.sh for how to build it) under /tmp/sglang-site, puts
# them and the repo on PYTHONPATH, finds nvcc and CUDA_HOME for SGLang's JIT kernels, and writes
# the versions that matter to "$OUT/env.txt". Returns non-zero when the wheels are missing.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ! ls .whl-sglang/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl-sglang/ (carry it)" | tee "$OUT/env.txt"
    return 2
fi
sglang_site=/tmp/sglang-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$sglang_site" .whl-sglang/*.whl || return 1
export PYTHONPATH="$PWD:$PWD/integrations:$sglang_site${PYTHONPATH:+:$PYTHONPATH}"
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
    echo "CUDA_HOME=${CUDA_HOME:-unset}"
    python3 - <<'PY'
import importlib.metadata as md

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("sglang", "apache-tvm-ffi", "triton", "pydantic"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
PY
} 2>&1 | tee "$OUT/env.txt"
