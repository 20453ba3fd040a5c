#!/usr/bin/env bash
# Issue 17's per-layer hot path on the GPU machine in one device call (carry .whl-sglang, built
# as scripts/sglang_ab.sh says): the GPU tests of the prepared gather and the layered kernels,
# then the host time of each call of an SGLang reload, stock against kvcore
# (python -m benchmarks.sglang.host_cost), then the engine-shaped sweep of SGLang's default
# layout and backend (kernel loads and backups) with the rule's and kvcore's own figures.
#
#   OUT=<dir> bash scripts/hot_path_gpu.sh [sweep args...]
#
# The host-cost run covers scattered host slots (the gather) and, for the two MHA
# page-64 cases, host slots in one run (the staged path); then scripts/sglang_pass_cost.py
# times passing MLA token reloads the way SGLang calls them.
#
# Writes under $OUT: env.txt, gpu-tests.log, host_cost.json, host_cost_staged.json,
# host_cost.log, host_cost_profile.txt (the kernel and direct MHA page-64 cases' calls at
# PROFILE_TOKENS tokens, 32768 by default: microseconds per request by function), sweep.json, sweep.log (eight
# files: the most the run tool brings back). Settings: SWEEP_SECONDS (the sweep's limit,
# 240), SWEEP_SIZES (512,2048,8192,32768), PROFILE_TOKENS.
set -uo pipefail
OUT=${OUT:-out/hot-path}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
started=$(date +%s)
rc=0
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_prepared_layers_gpu.py \
    tests/gpu/test_layers_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_core_gpu.py \
    > "$OUT/gpu-tests.log" 2>&1 || rc=1
tail -n 3 "$OUT/gpu-tests.log"
timeout 200 python3 -m benchmarks.sglang.host_cost --json "$OUT/host_cost.json" \
    --profile "$OUT/host_cost_profile.txt" --profile-tokens "${PROFILE_TOKENS:-32768}" \
    --profile-cases mha/layer_first/kernel/p64 mha/layer_first/direct/p64 2>&1 \
    | grep -v '^INFO' > "$OUT/host_cost.log" || rc=1
timeout 100 python3 -m benchmarks.sglang.host_cost --host-frag 0% \
    --cases mha/layer_first/kernel/p64 mha/layer_first/direct/p64 \
    --json "$OUT/host_cost_staged.json" 2>&1 | grep -v '^INFO' >> "$OUT/host_cost.log" || rc=1
# Passes as SGLang 0.5.23 calls them (its rows, one JSON line a size, go to host_cost.log).
timeout 120 python3 scripts/sglang_pass_cost.py --device cuda --tokens 512,2048 \
    --requests 40 --rounds 5 2>&1 | grep '^{' | tee -a "$OUT/host_cost.log" || rc=1
grep -E ' (stock|kvcore) ' "$OUT/host_cost.log"
timeout "${SWEEP_SECONDS:-240}" python3 -m kvcore bench --engine sglang --sweep \
    --layouts layer_first/kernel --sizes "${SWEEP_SIZES:-512,2048,8192,32768}" \
    --json "$OUT/sweep.json" "$@" > "$OUT/sweep.log" 2>&1 || rc=1
grep -v '^INFO' "$OUT/sweep.log" | tail -n 60
echo "hot_path_gpu: rc=$rc after $(($(date +%s) - started)) s"
exit "$rc"
