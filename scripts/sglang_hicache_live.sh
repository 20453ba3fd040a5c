#!/usr/bin/env bash
# SGLang 0.5.23's own HiCache machinery (UnifiedRadixCache, its cache controller and L2
# transfer engine) driven on the GPU by a multi-turn trace, stock and with kvcore's hooks,
# every load-back checked byte for byte (python -m benchmarks.sglang.hicache_live).
#
#   OUT=... bash scripts/sglang_hicache_live.sh [hicache_live args...]   e.g. --layout page_first
#
# Needs .whl-sglang/ carried (built as scripts/sglang_ab.sh says). The modes run as separate
# processes, same seed, same trace, in the order MODES gives (default "stock kvcore"; modes:
# stock, kvcore, kvcore-allocator, kvcore-no-warm-up, kvcore-ab: the two copies drawn per
# load-back inside one process, compared in its summary's in_process_ab); a mode given
# again runs again as <mode>-2, -3..., so "stock kvcore stock kvcore" tells a mode's
# difference from the machine's drift between runs (the summary's paired_processes pairs
# the n-th stock run with the n-th kvcore one).
# Then one summary. Writes under $OUT (default out/sglang_hicache_live): env.txt,
# hicache_live.log, h200-live-sglang.json and live-runs.tar.gz holding live-<run>.json for
# each run (one file, so that any number of runs comes back from the GPU machine).
set -uo pipefail
OUT=${OUT:-out/sglang_hicache_live}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
# SGLang's radix tree is its Python TreeCore unless --tree-core rust is passed (the bench's
# LiveOptions.tree_core says why).
log="$OUT/hicache_live.log"
started=$(date +%s)
rc=0
reports=()
declare -A seen=()
for mode in ${MODES:-stock kvcore}; do
    seen[$mode]=$((${seen[$mode]:-0} + 1))
    label=$mode
    [ "${seen[$mode]}" -eq 1 ] || label="$mode-${seen[$mode]}"
    reports+=("$OUT/live-$label.json")
    timeout "${MODE_TIMEOUT:-200}" python3 -m benchmarks.sglang.hicache_live --mode "$mode" \
        --label "$label" --json "$OUT/live-$label.json" "$@" 2>&1 | tee -a "$log"
    mode_rc=${PIPESTATUS[0]}
    echo "hicache_live $label: rc=$mode_rc after $(($(date +%s) - started)) s" | tee -a "$log"
    [ "$mode_rc" -eq 0 ] || rc=$mode_rc
done
python3 -m benchmarks.sglang.hicache_live_combine "${reports[@]}" \
    --out "$OUT/h200-live-sglang.json" 2>&1 | tee -a "$log"
combine_rc=${PIPESTATUS[0]}
present=()
for report in "${reports[@]}"; do [ -f "$report" ] && present+=("$(basename "$report")"); done
if [ "${#present[@]}" -gt 0 ]; then
    tar -czf "$OUT/live-runs.tar.gz" -C "$OUT" "${present[@]}" && (cd "$OUT" && rm -f "${present[@]}")
fi
[ "$combine_rc" -eq 0 ] || [ "$rc" -ne 0 ] || rc=$combine_rc
echo "sglang_hicache_live: rc=$rc after $(($(date +%s) - started)) s" | tee -a "$log"
exit "$rc"
