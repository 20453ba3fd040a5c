#!/usr/bin/env bash
# Where a served SGLang reload's first call spends its host time (issue 17's first-call goal),
# in one device call (carry .whl-sglang, built as scripts/sglang_ab.sh says): host_cost's
# --phases breakdown of each step of kvcore's calls on CUDA, beside the same Python on this
# machine's CPU with copy-free kernels (what is left over on CUDA is CUDA's), then the GPU
# tests with the rest of the call.
#
#   OUT=<dir> bash scripts/first_call_gpu.sh
#
# Settings: CASES (host_cost cases, mla/layer_first/kernel/p1), TOKENS (the CUDA rows' sizes,
# 8192,131072; the phases are taken at the first), CPU_PHASES (0 skips the CPU run),
# GPU_TESTS (the test paths, in order: tests/gpu), GPU_TESTS_S (their limit, 400; 0 skips
# them), HOST_COST_ARGS (more host_cost options for both runs, such as --rule: the rule on,
# as deployed). Writes under $OUT: env.txt, host_cost.log, phases_cpu.txt, phases_cuda.txt,
# host_cost_cpu.json, host_cost_cuda.json, pytest-gpu.log.
set -uo pipefail
OUT=${OUT:-out/first-call}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
started=$(date +%s)
rc=0
read -r -a cases <<<"${CASES:-mla/layer_first/kernel/p1}"
tokens=${TOKENS:-8192,131072}
common=(--cases "${cases[@]}" --layers 61 --host-frag 0%,100% --requests 20)
common+=(--profile-cases "${cases[@]}" --profile-tokens "${tokens%%,*}")
read -r -a extra <<<"${HOST_COST_ARGS:-}"
common+=("${extra[@]}")
: >"$OUT/host_cost.log"
if [ "${CPU_PHASES:-1}" != 0 ]; then
    timeout 120 python3 -m benchmarks.sglang.host_cost --device cpu --no-copy "${common[@]}" \
        --tokens "${tokens%%,*}" --phases "$OUT/phases_cpu.txt" \
        --json "$OUT/host_cost_cpu.json" 2>&1 | grep -v '^INFO' >>"$OUT/host_cost.log" || rc=1
fi
timeout 200 python3 -m benchmarks.sglang.host_cost --device cuda "${common[@]}" \
    --tokens "$tokens" --phases "$OUT/phases_cuda.txt" --json "$OUT/host_cost_cuda.json" \
    2>&1 | grep -v '^INFO' >>"$OUT/host_cost.log" || rc=1
grep -E ' (stock|kvcore) ' "$OUT/host_cost.log"
if [ "${GPU_TESTS_S:-400}" != 0 ]; then
    read -r -a test_paths <<<"${GPU_TESTS:-tests/gpu}"
    timeout "${GPU_TESTS_S:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu \
        "${test_paths[@]}" >"$OUT/pytest-gpu.log" 2>&1 || rc=1
    tail -n 5 "$OUT/pytest-gpu.log"
fi
echo "first_call_gpu: rc=$rc after $(($(date +%s) - started)) s"
exit "$rc"
