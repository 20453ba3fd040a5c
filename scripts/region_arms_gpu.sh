#!/usr/bin/env bash
# Region staging's ring under several settings at once, on the GPU machine in one device
# call: `kvcore bench --engine vllm --sweep --beside-compute --rows $ROWS` (mla unless named)
# through scripts/ring_pieces.py (so PIECE_CAP_MIB and RING_SLOTS count too), one run an arm, the
# arms alternated ROUNDS times on one machine. ARMS is a list of name:VAR=value,VAR=value
# (a name alone runs the defaults). TESTS=1 runs the region staging GPU tests first. PACK=0
# leaves $OUT unpacked, for a call that runs more and packs once. BENCH_ARGS (words) go to
# the bench too, e.g. BENCH_ARGS="--engine-steps --compute decode-64,prefill-4096".
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried, as scripts/vllm_sweep.sh does, or
# vLLM installed on the warm machine by scripts/vllm_live_setup.sh (scripts/vllm_device_env.sh).
#
#   ARMS="default cap16:PIECE_CAP_MIB=16 ctas32:KVCORE_RING_SCATTER_CTAS=32" OUT=<dir> \
#       [SIZES=8192,32768] [ROUNDS=2] [TESTS=0] [ROWS=mla] [PACK=1] bash scripts/region_arms_gpu.sh
#
# Writes $OUT/<arm>-<round>.json and the logs, packed by scripts/pack_out.sh (a call brings
# back at most 8 files). Each run's summary lines are printed too.
set -uo pipefail
ARMS=${ARMS:?name the arms, e.g. ARMS="default cap16:PIECE_CAP_MIB=16"}
OUT=${OUT:-out/region-arms}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/vllm_device_env.sh
source scripts/vllm_device_env.sh || exit 1
if [ "${TESTS:-0}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_region_staging_gpu.py \
        tests/integration/vllm/test_vllm_transfers_gpu.py > "$OUT/tests.log" 2>&1
    echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
fi
read -r -a arms <<< "$ARMS"
read -r -a bench_args <<< "${BENCH_ARGS:-}"
for round in $(seq "${ROUNDS:-2}"); do
    for arm in "${arms[@]}"; do
        name=${arm%%:*}
        settings=()
        if [ "$name" != "$arm" ]; then
            IFS=, read -r -a settings <<< "${arm#*:}"
        fi
        env "${settings[@]}" python3 scripts/ring_pieces.py bench --engine vllm --sweep \
            --beside-compute --rows "${ROWS:-mla}" --sizes "${SIZES:-8192,32768}" \
            "${bench_args[@]}" --json "$OUT/$name-$round.json" > "$OUT/$name-$round.log" 2>&1
        echo "$name $round rc=$? at ${SECONDS}s"
        grep "identical=" "$OUT/$name-$round.log" | cut -c1-330
    done
done
if [ "${PACK:-1}" = 1 ]; then
    OUT="$OUT" bash scripts/pack_out.sh
fi
