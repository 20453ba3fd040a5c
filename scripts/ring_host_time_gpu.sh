#!/usr/bin/env bash
# The layer ring's host time and what it does to the hit's own forward (issue 44), in one
# device call (carry .whl-sglang, built as scripts/sglang_ab.sh says): the ring's GPU tests,
# host_cost's per-call host time of SGLang's reload through the ring against stock's, then
# the beside-compute sweep with the serve-or-pass rule off (kvcore's ring in every cell it
# can serve) and on (as deployed).
#
#   OUT=<dir> bash scripts/ring_host_time_gpu.sh
#
# Settings: CASES (host_cost cases, "mha/layer_first/kernel/p64 mla/layer_first/kernel/p1"),
# SIZES (the sweep's tokens, 8192,32768), PAGES (64), ROWS (mha,mla), RULES ("0 1": the rule
# off, then on; a sweep each), BESIDE_SECONDS (each sweep's limit, 200).
# Writes under $OUT: env.txt, pytest-ring.log, host_cost.log, host_cost.json,
# beside-rule<R>/beside.json and .log.
set -uo pipefail
OUT=${OUT:-out/ring-host-time}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
rc=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_prepared_layers_gpu.py \
    >"$OUT/pytest-ring.log" 2>&1 || rc=1
tail -n 3 "$OUT/pytest-ring.log"
read -r -a cases <<<"${CASES:-mha/layer_first/kernel/p64 mla/layer_first/kernel/p1}"
timeout 150 python3 -m benchmarks.sglang.host_cost --device cuda --cases "${cases[@]}" \
    --tokens 8192,32768 --host-frag 0% --requests 12 --json "$OUT/host_cost.json" 2>&1 \
    | grep -v '^INFO' | tee "$OUT/host_cost.log" | grep -E ' (stock|kvcore) ' || rc=1
for rule in ${RULES:-0 1}; do
    KVCORE_SERVE_RULE=$rule OUT=$OUT/beside-rule$rule BESIDE_SECONDS=${BESIDE_SECONDS:-200} \
        bash scripts/beside_compute_gpu.sh --rows "${ROWS:-mha,mla}" \
        --sizes "${SIZES:-8192,32768}" --pages "${PAGES:-64}" --compute prefill-4096 \
        --repeats 4 | tail -n 30 || rc=1
done
echo "ring_host_time_gpu: rc=$rc"
exit "$rc"
