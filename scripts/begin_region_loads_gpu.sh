#!/usr/bin/env bash
# KVCORE_BEGIN_REGION_LOADS on the GPU machine in one device call: the GPU tests of region
# staging and of vLLM's handler, then `kvcore bench --engine vllm --sweep --beside-compute`
# with the setting on and off, alternated ROUNDS times on one machine, then the first DMA's
# time with each (scripts/region_tail_probe.py --events).
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried, as scripts/vllm_sweep.sh does.
#
#   OUT=<dir> [SIZES=8192,32768] [ROUNDS=2] [TESTS=0] bash scripts/begin_region_loads_gpu.sh
#
# Writes $OUT/on-<round>.json, $OUT/off-<round>.json, $OUT/probe-on.json, $OUT/probe-off.json
# and the logs (env.txt, tests.log, one per run), packed by scripts/pack_out.sh: a call brings
# back at most 8 files.
set -uo pipefail
OUT=${OUT:-out/begin-region-loads}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/vllm_device_env.sh
source scripts/vllm_device_env.sh || exit 1
[ "${TESTS:-1}" = 1 ] && OUT="$OUT" bash scripts/region_gpu_tests.sh
for round in $(seq "${ROUNDS:-2}"); do
    for setting in on off; do
        value=$([ "$setting" = on ] && echo 1 || echo 0)
        KVCORE_BEGIN_REGION_LOADS=$value python3 -m kvcore bench --engine vllm --sweep \
            --beside-compute --rows mla --sizes "${SIZES:-8192,32768}" \
            --json "$OUT/$setting-$round.json" > "$OUT/$setting-$round.log" 2>&1
        echo "$setting $round rc=$? at ${SECONDS}s"
        grep "identical=" "$OUT/$setting-$round.log" | cut -c1-150
    done
done
for setting in on off; do
    value=$([ "$setting" = on ] && echo 1 || echo 0)
    KVCORE_BEGIN_REGION_LOADS=$value timeout 90 python3 scripts/region_tail_probe.py \
        --rows mla --sizes 8192 --compute none,prefill-4096 --events \
        --json "$OUT/probe-$setting.json" > "$OUT/probe-$setting.log" 2>&1
    echo "probe $setting rc=$? at ${SECONDS}s"
done
OUT="$OUT" bash scripts/pack_out.sh
