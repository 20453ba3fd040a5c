#!/usr/bin/env bash
# The GPU tests of region staging and of vLLM's handler, for the device scripts that measure
# region staging (scripts/address_ring_gpu.sh, scripts/begin_region_loads_gpu.sh): their log
# to $OUT/tests.log, one summary line printed. Run after scripts/vllm_device_env.sh.
#
#   OUT=<dir> bash scripts/region_gpu_tests.sh
set -uo pipefail
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_region_staging_gpu.py \
    tests/integration/vllm/test_vllm_transfers_gpu.py > "${OUT:?}/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
