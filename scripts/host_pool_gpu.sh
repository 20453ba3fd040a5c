#!/usr/bin/env bash
# Issue 46's figures in one device call: the GPU tests of kvcore's exact host mapping and of
# a pool pinned in steps, then
# `kvcore bench --host-pool` (vLLM 0.25.1's CPU tier built stock's way and kvcore's, no vLLM
# needed; SGLang's pool buffer through SGLang's own allocation with and without kvcore's
# hook, where .whl-sglang/ is carried: see sglang_ab.sh; its rows say "skipped" otherwise),
# then how fast this host faults in and pins each kind of mapping, and what registering in the
# background would cost (scripts/registration_probe.py).
#
#   OUT=<dir> bash scripts/host_pool_gpu.sh   (carry .whl-sglang for SGLang's rows or
#                                              .vllm-tree for vllm-shared-region's: 47 and
#                                              24 MB, not both in one call's 64 MiB)
#
# Settings: HOST_ENGINES (a comma list for --host-engines; default every engine), POOL_GIB
# (the tier sizes, 16,32,48,64: on a 128 GiB host stock's rounding makes
# 96 GiB take 128; vLLM's region must also fit /dev/shm's free space, and three engines at
# four sizes may need more than a 600 s call: four engines at 16,64 took 590 s on an H100
# before the last row; the JSON keeps each row as it lands), FAULT_GIB
# (host_fault_rates' size, 8). Writes under $OUT: env.txt (env-vllm.txt),
# pytest-gpu.log, host-pool.json, host-pool.log, fault-rates.json, fault-rates.log,
# registration-probe.json, registration-probe.log.
set -uo pipefail
OUT=${OUT:-out/host-pool}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's env first: it sets PYTHONPATH afresh, SGLang's adds to it. Each writes env.txt.
if [ -d .vllm-tree/vllm ]; then
    # The vllm-shared-region rows: vLLM 0.33's region class and registration.
    # shellcheck source=scripts/vllm_device_env.sh
    source scripts/vllm_device_env.sh || echo "the vLLM tree did not load: its rows skip"
    mv "$OUT/env.txt" "$OUT/env-vllm.txt"
fi
if ls .whl-sglang/*.whl >/dev/null 2>&1; then
    # shellcheck source=scripts/sglang_device_env.sh
    source scripts/sglang_device_env.sh || echo "SGLang's wheels did not install: its rows skip"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    nproc
    python3 -c "import torch; print('torch', torch.__version__)"
} >>"$OUT/env.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_host_region_gpu.py \
    tests/gpu/test_stepwise_pinning_gpu.py \
    2>&1 | tee "$OUT/pytest-gpu.log"
tests_rc=${PIPESTATUS[0]}
python3 -m kvcore bench --host-pool --pool-gib "${POOL_GIB:-16,32,48,64}" \
    ${HOST_ENGINES:+--host-engines "$HOST_ENGINES"} \
    --json "$OUT/host-pool.json" 2>&1 | tee "$OUT/host-pool.log"
bench_rc=${PIPESTATUS[0]}
python3 scripts/host_fault_rates.py --gib "${FAULT_GIB:-8}" --threads 1,4,16 \
    --json "$OUT/fault-rates.json" 2>&1 | tee "$OUT/fault-rates.log"
rates_rc=${PIPESTATUS[0]}
python3 scripts/registration_probe.py --gib "${FAULT_GIB:-8}" \
    --json "$OUT/registration-probe.json" 2>&1 | tee "$OUT/registration-probe.log"
probe_rc=${PIPESTATUS[0]}
echo "gpu test rc=$tests_rc host-pool rc=$bench_rc fault rates rc=$rates_rc probe rc=$probe_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$rates_rc" = 0 ] && [ "$probe_rc" = 0 ]
