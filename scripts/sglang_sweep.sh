#!/usr/bin/env bash
# The engine-shaped SGLang sweep on the GPU machine in one device call: whole requests (every
# layer's load, the all-layer backup), stock SGLang 0.5.23 against kvcore's hooks.
#
#   scripts/sglang_sweep.sh [kvcore bench args...]   e.g. --rows mha, --no-rule, --tokens 65536
#
# Needs .whl-sglang/ carried (built as scripts/sglang_ab.sh says). Writes $OUT/sglang_sweep.json,
# .png, .log and env.txt (OUT defaults to out/sglang_sweep).
set -uo pipefail
OUT=${OUT:-out/sglang_sweep}
# shellcheck source=scripts/sglang_device_env.sh
source scripts/sglang_device_env.sh || exit $?
started=$(date +%s)
timeout "${SWEEP_TIMEOUT:-560}" python3 -m kvcore bench --engine sglang --sweep \
    --json "$OUT/sglang_sweep.json" --plot "$OUT/sglang_sweep.png" "$@" 2>&1 \
    | tee "$OUT/sglang_sweep.log"
rc=${PIPESTATUS[0]}
echo "sglang_sweep: rc=$rc after $(($(date +%s) - started)) s" | tee -a "$OUT/sglang_sweep.log"
exit "$rc"
