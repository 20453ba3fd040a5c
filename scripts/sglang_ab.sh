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
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
started=$(date +%s)
timeout 540 python3 -m kvcore bench --engine sglang --json "$OUT/sglang_ab.json" "$@" 2>&1 \
    | tee "$OUT/sglang_ab.log"
rc=${PIPESTATUS[0]}
echo "sglang_ab: rc=$rc after $(($(date +%s) - started)) s" | tee -a "$OUT/sglang_ab.log"
exit "$rc"
