#!/usr/bin/env bash
# Issue 21 item 7 on the GPU machine: minutes of engine-shaped traffic through both adapters'
# hooks (python -m benchmarks.soak: every reload checked byte for byte, then host slots,
# pinned bytes, staging leases, events and index caches compared with a baseline), and a
# short slice of each under compute-sanitizer memcheck and racecheck. One device call per
# PART, each within the 10-minute limit:
#
#   OUT=out/soak-sglang bash scripts/soak.sh sglang       carry .whl-sglang (scripts/sglang_ab.sh)
#   OUT=out/soak-vllm bash scripts/soak.sh vllm           vLLM 0.25.1 in $VSITE (vllm_live_setup.sh
#                                                         device calls first), or .vllm-tree carried
#   OUT=out/soak-sanitize bash scripts/soak.sh sanitize   both of the above; sanitize-sglang or
#                                                         sanitize-vllm runs one engine's slice
#   bash scripts/soak.sh combine SUMMARY.json PART.json...  (here) one summary of the parts
#
# Settings: SOAK_SECONDS (traffic seconds per engine, 300), SOAK_SEED (0), SANITIZE_SECONDS
# (traffic seconds per engine and tool, 20), SANITIZE_SGLANG_POOLS (the SGLang pools of the
# slice: MHA and MLA, both layouts, both page sizes), SANITIZE_KERNELS (a compute-sanitizer
# --kernel-name filter, e.g. kns=_gather: check only kernels whose names hold that; all by
# default), SANITIZE_TOOLS (the tools of the slices, "memcheck racecheck"), PART_BUDGET
# (wall seconds a part may take, 570: the soak cuts its phases short to write its report in
# time), VSITE (/tmp/vsite), SOAK_DEVICE (cuda; cpu for a dry run of this script where there
# is no GPU).
# Writes under $OUT (default out/soak) at most six files: env.txt, soak.log,
# soak-sglang.json / soak-vllm.json / soak-sanitize.json (every slice's document with its
# sanitizer's verdict), soak-summary.json, and preflight.log where vllm_device_env.sh ran.
set -uo pipefail
part=${1:-}
repo=$PWD
started=$(date +%s)
budget=${PART_BUDGET:-570}
seconds=${SOAK_SECONDS:-300}
seed=${SOAK_SEED:-0}
sanitize_seconds=${SANITIZE_SECONDS:-20}
sglang_pools=${SANITIZE_SGLANG_POOLS:-mha/layer_first/p64,mla/page_first/p1}
device=${SOAK_DEVICE:-cuda}

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit 2
}

if [ "$part" = combine ]; then
    [ $# -ge 3 ] || usage
    summary=$2
    shift 2
    exec python3 -m benchmarks.soak --combine "$@" --json "$summary"
fi
case "$part" in
    sglang | vllm | sanitize | sanitize-sglang | sanitize-vllm) ;;
    *) usage ;;
esac

OUT=${OUT:-out/soak}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/soak.log"

left() { echo $((budget - ($(date +%s) - started))); }

sglang_env() {
    # shellcheck source=scripts/sglang_device_env.sh
    source scripts/sglang_device_env.sh
}

vllm_env() {
    local vsite=${VSITE:-/tmp/vsite}
    if [ -d "$vsite/vllm" ]; then
        export PYTHONPATH="$vsite:$repo:$repo/integrations"
        # flashinfer is not carried; nothing here samples, but vLLM's imports may ask.
        export VLLM_USE_FLASHINFER_SAMPLER=0
        {
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
            python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
        } 2>&1 | tee -a "$OUT/env.txt"
    elif [ -d .vllm-tree/vllm ]; then
        # shellcheck source=scripts/vllm_device_env.sh
        source scripts/vllm_device_env.sh
    else
        echo "no vLLM: run scripts/vllm_live_setup.sh's device calls (VSITE) or carry .vllm-tree" \
            | tee -a "$log"
        return 1
    fi
}

# soak ENGINE JSON [ARGS...]: one soak within what is left of the part's budget.
soak() {
    local engine=$1 json=$2
    shift 2
    local limit=$(($(left) - 10))
    timeout "$limit" python3 -m benchmarks.soak --engine "$engine" --device "$device" \
        --seed "$seed" --budget $((limit - 25)) --json "$json" "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

summarise() {
    python3 -m benchmarks.soak --combine "$@" --json "$OUT/soak-summary.json" >> "$log" 2>&1
    python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); print("soak summary: ok =",
        s["ok"], "seconds =", s["seconds"], "mismatches =", s["mismatches"], "leaks =", s["leaks"])' \
        "$OUT/soak-summary.json" | tee -a "$log"
}

find_sanitizer() {
    local found
    found=$(command -v compute-sanitizer || true)
    for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
        [ -n "$found" ] && break
        [ -x "$candidate" ] && found=$candidate
    done
    echo "$found"
}

# slice ENGINE TOOL SANITIZER RUNS_LEFT: one short soak under the sanitizer; its document
# (or a stand-in saying why there is none) gets the sanitizer's verdict.
slice() {
    local engine=$1 tool=$2 sanitizer=$3 runs_left=$4
    local json="$work/$engine-$tool.json" text="$work/$engine-$tool.txt"
    local limit=$(($(left) / runs_left - 5))
    local pools=()
    [ "$engine" = sglang ] && pools=(--pools "$sglang_pools")
    # memcheck sees an access past a tensor inside one of torch's cached blocks only when
    # each tensor is its own allocation (torch then counts no allocated bytes: the memory
    # item of that slice compares 0 with 0; the full soaks check it).
    local run=(timeout "$limit")
    [ "$tool" = memcheck ] && run=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${run[@]}")
    echo "-- $engine under compute-sanitizer --tool $tool (limit ${limit}s)" | tee -a "$log"
    local only=()
    [ -n "${SANITIZE_KERNELS:-}" ] && only=(--kernel-name "$SANITIZE_KERNELS")
    "${run[@]}" "$sanitizer" --tool "$tool" --target-processes all --print-limit 20 "${only[@]}" \
        python3 -m benchmarks.soak --engine "$engine" --device "$device" --profile sanitize \
        --seconds "$sanitize_seconds" --seed "$seed" --budget $((limit - 40)) \
        --sanitizer "$tool" --json "$json" "${pools[@]}" > "$text" 2>&1
    local rc=$?
    grep -v '^INFO' "$text" | tail -n 60 >> "$log"
    python3 - "$json" "$engine" "$tool" "$rc" "$text" <<'PY' | tee -a "$log"
import json
import re
import sys

path, engine, tool, rc, text = sys.argv[1:]
try:
    with open(path) as fh:
        doc = json.load(fh)
except (OSError, ValueError):
    doc = {"engine": engine, "errors": [f"no report: the run ended with status {rc}"], "ok": False}
with open(text, errors="replace") as fh:
    report = fh.read()
# memcheck ends with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: N hazards
# displayed (E errors, W warnings)".
found = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", report)]
found += [int(n) for n in re.findall(r"hazards? displayed \((\d+) error", report)]
doc["sanitizer"] = tool
doc["sanitizer_errors"] = sum(found) if found else None
doc["exit_status"] = int(rc)
doc["ok"] = bool(doc.get("ok")) and doc["sanitizer_errors"] == 0 and rc == "0"
with open(path, "w") as fh:
    json.dump(doc, fh, indent=2)
print(f"{engine} {tool}: sanitizer errors {doc['sanitizer_errors']}, exit {rc}, ok {doc['ok']}")
PY
}

rc=0
case "$part" in
    sglang)
        sglang_env || exit $?
        soak sglang "$OUT/soak-sglang.json" --seconds "$seconds" || rc=$?
        summarise "$OUT/soak-sglang.json"
        ;;
    vllm)
        vllm_env || exit $?
        soak vllm "$OUT/soak-vllm.json" --seconds "$seconds" || rc=$?
        summarise "$OUT/soak-vllm.json"
        ;;
    sanitize*)
        sanitizer=$(find_sanitizer)
        if [ -z "$sanitizer" ]; then
            echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)" | tee -a "$log"
            exit 3
        fi
        "$sanitizer" --version 2>&1 | tail -1 | tee -a "$log"
        engines=(sglang vllm)
        [ "$part" = sanitize-sglang ] && engines=(sglang)
        [ "$part" = sanitize-vllm ] && engines=(vllm)
        work=$(mktemp -d)
        read -r -a tools <<< "${SANITIZE_TOOLS:-memcheck racecheck}"
        runs_left=$((${#tools[@]} * ${#engines[@]}))
        for engine in "${engines[@]}"; do
            # Each engine's environment in a subshell of its own (their PYTHONPATHs differ).
            (
                "${engine}_env" || exit $?
                for tool in "${tools[@]}"; do
                    slice "$engine" "$tool" "$sanitizer" "$runs_left"
                    runs_left=$((runs_left - 1))
                done
            ) || echo "$engine: no environment, no slice" | tee -a "$log"
            runs_left=$((runs_left - ${#tools[@]}))
        done
        python3 - "$OUT/soak-sanitize.json" "$work" <<'PY'
import glob
import json
import sys

out, work = sys.argv[1:]
runs = []
for path in sorted(glob.glob(f"{work}/*.json")):
    with open(path) as fh:
        runs.append(json.load(fh))
with open(out, "w") as fh:
    json.dump({"runs": runs}, fh, indent=2)
PY
        summarise "$OUT/soak-sanitize.json"
        python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' \
            "$OUT/soak-summary.json" || rc=1
        rm -rf "$work"
        ;;
esac
echo "soak.sh $part: rc=$rc after $(($(date +%s) - started)) s" | tee -a "$log"
exit "$rc"
