#!/usr/bin/env bash
# Issue 44's SGLang benchmark on the GPU machine in one device call (carry .whl-sglang, built as
# scripts/sglang_ab.sh says): reloads through SGLang's L2TransferEngine alone, beside another
# batch's forward and feeding the hit's own forward, stock against kvcore
# (`kvcore bench --engine sglang --sweep --beside-compute`).
#
#   OUT=<dir> bash scripts/beside_compute_gpu.sh [bench args...]   e.g. --sizes 8192 --pages 64
#
# Writes $OUT/env.txt, $OUT/beside.json and $OUT/beside.log. BESIDE_SECONDS bounds the run (540).
set -uo pipefail
OUT=${OUT:-out/beside}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
timeout "${BESIDE_SECONDS:-540}" python3 -m kvcore bench --engine sglang --sweep --beside-compute \
    --json "$OUT/beside.json" "$@" 2>&1 | grep -v '^INFO' | tee "$OUT/beside.log"
