#!/usr/bin/env bash
# Why the beside-compute forward stretches by a copy's time, in one device call:
# scripts/forward_stretch_probe.py for MHA's decode-64 and prefill-4096 forwards, each with
# CUDA_DEVICE_MAX_CONNECTIONS unset, 8 and 32 (the driver reads it once, at context
# creation, so every setting is a process of its own). No vLLM needed.
#
#   OUT=<dir> bash scripts/forward_stretch_gpu.sh [probe args...]   e.g. --repeats 3
#
# Writes under $OUT (out/forward-stretch): env.txt, then for each run
# mha-<load>-conn-<setting>.json and .log. PROBE_SECONDS bounds each run (90: six runs
# fit one 600 s device call).
set -uo pipefail
OUT=${OUT:-out/forward-stretch}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "CUDA_DEVICE_MAX_CONNECTIONS (caller's)=${CUDA_DEVICE_MAX_CONNECTIONS-unset}"
} >"$OUT/env.txt" 2>&1
failed=()
for load in decode-64 prefill-4096; do
    for connections in unset 8 32; do
        name="mha-$load-conn-$connections"
        if [ "$connections" = unset ]; then
            setting=(env -u CUDA_DEVICE_MAX_CONNECTIONS)
        else
            setting=(env "CUDA_DEVICE_MAX_CONNECTIONS=$connections")
        fi
        "${setting[@]}" timeout "${PROBE_SECONDS:-90}" python3 scripts/forward_stretch_probe.py \
            --kind mha --load "$load" --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
        rc=${PIPESTATUS[0]}
        echo "$name rc=$rc"
        [ "$rc" = 0 ] || failed+=("$name")
    done
done
echo "failed runs: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
