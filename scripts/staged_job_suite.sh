#!/usr/bin/env bash
# A vLLM-shaped staged load job on the GPU machine in one device call (no engine wheels):
# the GPU tests of the staged paths, then scripts/staged_job_cost.py over 32 KiB rows (a
# block's K) and 64 KiB rows (its K and V), with each way's timeline (lead to the first
# DMA, DMA busy time and gaps, tail) from torch's profiler.
#
#   OUT=<dir> bash scripts/staged_job_suite.sh
#
# Writes under $OUT: gpu-tests.log, staged-32.json, staged-64.json, staged.log.
# Settings: TOKENS (1024,2048,4096,8192), JOBS (10), TIMELINES (3).
set -uo pipefail
OUT=${OUT:-out/staged-job}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_prepared_layers_gpu.py \
    tests/gpu/test_layers_gpu.py -k "staged or STAGED" > "$OUT/gpu-tests.log" 2>&1 || rc=1
tail -n 3 "$OUT/gpu-tests.log"
for kib in 32 64; do
    timeout 150 python3 scripts/staged_job_cost.py --tokens "${TOKENS:-1024,2048,4096,8192}" \
        --jobs "${JOBS:-10}" --timelines "${TIMELINES:-3}" --row-kib "$kib" \
        --json "$OUT/staged-$kib.json" >> "$OUT/staged.log" 2>&1 || rc=1
done
python3 - "$OUT" << 'PY'
import json, sys
for kib in (32, 64):
    try:
        rows = json.load(open(f"{sys.argv[1]}/staged-{kib}.json"))["rows"]
    except OSError:
        continue
    for row in rows:
        ways = [k[: -len("_x_link")] for k in row if k.endswith("_x_link")]
        cells = " ".join(f"{w}={row[w + '_x_link']}" for w in ways)
        print(f"{kib} KiB {row['tokens']:>5}: {cells}")
PY
exit "$rc"
