#!/usr/bin/env bash
# The vLLM engine-shaped sweep (issue 17) in one device call: `python -m benchmarks.vllm.sweep`,
# whole offload requests of 1 to 4096 blocks through vLLM's stock handler and kvcore's, over
# per-layer (32 layers MHA, 61 layers MLA) and cross-layer layouts, 0/50/100% host
# fragmentation, one job or four in flight, stores and loads; every request byte-checked.
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried; .whl/ too when carried.
# Usage (on the GPU machine, from the repo root): scripts/vllm_sweep.sh [budget seconds]
#   budget: the sweep skips the cells left after it (counted in the report; default 270),
#   so that the whole call, set-up included, stays near 6 minutes; `timeout 500` is the
#   hard stop.
# Writes to $OUT (default out/vllm_sweep): env.txt, vllm_sweep.json, vllm_sweep.png,
# vllm_sweep.log.
set -uo pipefail
OUT=${OUT:-out/vllm_sweep}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/vllm_device_env.sh || exit 1

timeout 500 python3 -m benchmarks.vllm.sweep --device cuda --budget-s "${1:-270}" \
    --json "$OUT/vllm_sweep.json" --plot "$OUT/vllm_sweep.png" 2>&1 | tee "$OUT/vllm_sweep.log"
rc=${PIPESTATUS[0]}
echo "vllm_sweep rc=$rc"
exit "$rc"
