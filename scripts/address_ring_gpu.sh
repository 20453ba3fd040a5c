#!/usr/bin/env bash
# Region staging's ring issued by address (KVCORE_ADDRESS_RING=1) against torch's ring (0)
# on the GPU machine in one device call: the GPU tests of region staging and of vLLM's
# handler (both rings), scripts/region_tail_probe.py --events with each (the host's time in
# the ring's calls, the DMAs' busy time), then `kvcore bench --engine vllm --sweep
# --beside-compute` with each, alternated ROUNDS times. Needs .vllm-tree/
# (scripts/vllm_device_tree.sh) carried.
#
#   OUT=<dir> [SIZES=8192] [ROUNDS=2] [TESTS=1] bash scripts/address_ring_gpu.sh
#
# Writes $OUT/{address,torch}-<round>.json, $OUT/tail-{address,torch}.json and the logs,
# packed by scripts/pack_out.sh (a call brings back at most 8 files).
set -uo pipefail
OUT=${OUT:-out/address-ring}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/vllm_device_env.sh
source scripts/vllm_device_env.sh || exit 1
[ "${TESTS:-1}" = 1 ] && OUT="$OUT" bash scripts/region_gpu_tests.sh
for ring in address torch; do
    value=$([ "$ring" = address ] && echo 1 || echo 0)
    KVCORE_ADDRESS_RING=$value timeout 120 python3 scripts/region_tail_probe.py --rows mla \
        --sizes "${SIZES:-8192}" --compute none,prefill-4096 --events \
        --json "$OUT/tail-$ring.json" > "$OUT/tail-$ring.log" 2>&1
    echo "tail $ring rc=$? at ${SECONDS}s"
    grep "identical=" "$OUT/tail-$ring.log" | cut -c1-700
done
for round in $(seq "${ROUNDS:-2}"); do
    for ring in address torch; do
        value=$([ "$ring" = address ] && echo 1 || echo 0)
        KVCORE_ADDRESS_RING=$value python3 -m kvcore bench --engine vllm --sweep \
            --beside-compute --rows mla --sizes "${SIZES:-8192}" \
            --json "$OUT/$ring-$round.json" > "$OUT/$ring-$round.log" 2>&1
        echo "$ring $round rc=$? at ${SECONDS}s"
        grep "identical=" "$OUT/$ring-$round.log" | cut -c1-420
    done
done
OUT="$OUT" bash scripts/pack_out.sh
