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
# Build it with scripts/sglang_device_wheels.sh (about 47 MB).
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
