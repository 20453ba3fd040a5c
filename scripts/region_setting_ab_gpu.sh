#!/usr/bin/env bash
# A setting of region staging, on against off, on the GPU machine in one device call: the GPU
# tests of region staging and of vLLM's handler (both rings, begun loads or not), then
# scripts/region_tail_probe.py --events with the setting on and off (the first DMA, the
# host's time in the ring's calls, the DMAs' busy time, the submission's return), then
# `kvcore bench --engine vllm --sweep --beside-compute --rows mla` on and off, alternated
# ROUNDS times on one machine (scripts/region_arms_gpu.sh, arms `on` and `off`). SETTING is a boolean KVCORE_ variable:
# KVCORE_ADDRESS_RING (the ring by address), KVCORE_BEGIN_REGION_LOADS (begun loads),
# KVCORE_HIGH_PRIORITY_LOADS (the load handler's streams at the top CUDA priority).
# BASE_ENV (VAR=value words) holds for both sides. PROBES=0 skips the probes; PACK=0 leaves
# $OUT unpacked, for a call that runs this twice and packs once.
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried, as scripts/vllm_sweep.sh does.
#
#   SETTING=<KVCORE_...> OUT=<dir> [SIZES=8192,32768] [ROUNDS=2] [TESTS=1] [PROBES=1] \
#       [PACK=1] [BASE_ENV="KVCORE_ADDRESS_RING=1"] bash scripts/region_setting_ab_gpu.sh
#
# Writes $OUT/on-<round>.json, $OUT/off-<round>.json, $OUT/probe-on.json, $OUT/probe-off.json
# and the logs (tests.log, one per run), packed by scripts/pack_out.sh: a call brings back
# at most 8 files. Each run's summary lines are printed too.
set -uo pipefail
SETTING=${SETTING:?name the KVCORE_ setting to compare, e.g. SETTING=KVCORE_ADDRESS_RING}
OUT=${OUT:-out/${SETTING,,}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
read -r -a base_env <<< "${BASE_ENV:-}"
# shellcheck source=scripts/vllm_device_env.sh
source scripts/vllm_device_env.sh || exit 1
if [ "${TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_region_staging_gpu.py \
        tests/integration/vllm/test_vllm_transfers_gpu.py > "$OUT/tests.log" 2>&1
    echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
fi
for setting in on off; do
    [ "${PROBES:-1}" = 1 ] || break
    value=$([ "$setting" = on ] && echo 1 || echo 0)
    env "${base_env[@]}" "$SETTING=$value" timeout 120 python3 scripts/region_tail_probe.py --rows mla \
        --sizes "${SIZES:-8192,32768}" --compute none,prefill-4096 --events \
        --json "$OUT/probe-$setting.json" > "$OUT/probe-$setting.log" 2>&1
    echo "probe $setting rc=$? at ${SECONDS}s"
    grep "identical=" "$OUT/probe-$setting.log" | cut -c1-700
done
base=$(IFS=,; echo "${base_env[*]}")
ARMS="on:$SETTING=1${base:+,$base} off:$SETTING=0${base:+,$base}" OUT="$OUT" TESTS=0 \
    bash scripts/region_arms_gpu.sh
