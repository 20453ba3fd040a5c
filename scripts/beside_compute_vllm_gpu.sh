#!/usr/bin/env bash
# Issue 44's vLLM benchmark on the GPU machine in one device call: CPU-tier loads through
# vLLM's stock offload handler and kvcore's, alone and with another batch's forward queued
# right after their submission (`kvcore bench --engine vllm --sweep --beside-compute`).
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried, as scripts/vllm_sweep.sh does.
#
#   OUT=<dir> bash scripts/beside_compute_vllm_gpu.sh [bench args...]   e.g. --sizes 8192
#
# Writes $OUT/env.txt, $OUT/beside-vllm.json and $OUT/beside-vllm.log. BESIDE_SECONDS bounds
# the run (540).
set -uo pipefail
OUT=${OUT:-out/beside-vllm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/vllm_device_env.sh
source scripts/vllm_device_env.sh || exit 1
timeout "${BESIDE_SECONDS:-540}" python3 -m kvcore bench --engine vllm --sweep --beside-compute \
    --json "$OUT/beside-vllm.json" "$@" 2>&1 | tee "$OUT/beside-vllm.log"
rc=${PIPESTATUS[0]}
echo "beside-vllm rc=$rc"
exit "$rc"
