#!/usr/bin/env bash
# vLLM served on the GPU machine with its CPU offloading tier, one trace a mode
# (scripts/live_trace.py), after scripts/vllm_live_setup.sh installed vLLM and kvcore:
#   stock             python -m vllm.entrypoints.cli.main serve ...
#   kvcore            kvcore launch vllm --kvcore-transfers 0 -- serve ...   (manager, spec)
#   kvcore-transfers  kvcore launch vllm --kvcore-transfers 1 -- serve ...   (and the copies)
#   kvcore-background the same with --kvcore-background-issue 1 (each job's copies issued
#                     from the handler's own thread)
#   kvcore-stage-all  kvcore-transfers with --kvcore-stage-regions all (MHA's loads too
#                     staged by region: a few large DMAs and scatters, not a DMA a page)
#   kvcore-ab         the same with --kvcore-stock-share AB_SHARE (0.5): that share of the
#                     loads kvcore would copy get vLLM's copy instead, each logged, so the
#                     summary compares the two copies' hits inside one process
#                     (`in_process_ab`), free of the drift between processes
# Each server is started, its trace sent, its /metrics and log kept, and stopped before the
# next starts; each report records how long its server took to answer /health (`startup_s`,
# with `cpu_tier_gib`: issue 46's start-up cost of the CPU tier, stock's against kvcore's).
# Writes under $OUT: live-MODE.json, doctor.txt, the summary h200-live-vllm.json
# (live_trace.py combine) and logs.tar.gz (each mode's server log, trace output, /metrics
# page and kvcore log lines).
#
#   bash scripts/vllm_live_run.sh [MODE...]     (default: stock kvcore kvcore-transfers)
# A mode may repeat: its later runs are labelled MODE-2, MODE-3, ... (live-MODE-2.json), and
# the summary pairs stock's runs with those of each other mode that ran twice or more, on
# the same machine only (`paired_processes`), e.g. `stock kvcore-transfers stock
# kvcore-transfers`.
# A server takes 75-130 s to come up, so more runs than fit one call go over several
# calls made back to back (the install stays on a warm machine), e.g. `stock
# kvcore-transfers stock`, then `kvcore-transfers stock kvcore-transfers`; combine their
# live-*.json here in the order they ran (`live_trace.py combine`; a label seen again
# becomes LABEL#2).
# Settings: VSITE, KSITE (as vllm_live_setup.sh), MODEL_DIR (/tmp/llama-8b), PORT (8000),
# CONVERSATIONS (28), TURNS (3), CONCURRENCY (8,32: comma-separated levels, one concurrent
# pass each, whose output tokens/s and TPOT the summary pairs across stock's and each
# mode's processes as `paired_concurrency`; 1: none), GPU_BLOCKS (2560: 40960 tokens of
# GPU KV cache, so conversations leave it between turns), CPU_GIB (48; at most half the
# host's memory), MAX_LEN (33792), FIRST_TURNS (comma-separated first-turn sizes the
# conversations cycle through; empty: live_trace.py's own, 512 to 32000),
# MAX_TOKENS (16: each answer's length), CONCURRENT_MAX_TOKENS (MAX_TOKENS: in the concurrent
# passes, e.g. 256 to keep requests decoding while hits load beside them),
# START_TIMEOUT_S (300), TRACE_TIMEOUT_S (300: a mode's trace is stopped after it, its
# server's log end shown and the next mode started), AB_SHARE (0.5), PYTHON (python3),
# BASELINE (stock: the mode the summary pairs the others with; kvcore-transfers to judge
# kvcore-background, e.g. `kvcore-transfers kvcore-background` then the reverse).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:?set OUT to the folder for the results}"
python="${PYTHON:-python3}"
model="${MODEL_DIR:-/tmp/llama-8b}"
port="${PORT:-8000}"
url="http://127.0.0.1:$port"
export PYTHONPATH="${VSITE:-/tmp/vsite}:${KSITE:-/tmp/ksite}"
# flashinfer is not carried; vLLM's sampler would import it.
export VLLM_USE_FLASHINFER_SAMPLER=0
modes=("$@")
[[ ${#modes[@]} -gt 0 ]] || modes=(stock kvcore kvcore-transfers)

serve_args=(
    serve "$model" --load-format dummy --skip-tokenizer-init --enforce-eager --seed 0
    --max-model-len "${MAX_LEN:-33792}" --num-gpu-blocks-override "${GPU_BLOCKS:-2560}"
    --kv-offloading-size "${CPU_GIB:-48}" --gpu-memory-utilization 0.85
    --host 127.0.0.1 --port "$port"
)

# vLLM pins the whole CPU tier at start-up; past about half the host's memory its engine
# core is killed while allocating the tier's tensors, with no reason in its log
# (docs/lab/benchmarks.md, session 23). Say so before starting anything.
mem_gib=$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo)
if ((${CPU_GIB:-48} * 2 > mem_gib)); then
    echo "CPU_GIB=${CPU_GIB:-48} is over half of this host's ${mem_gib} GiB: vLLM would" \
        "pin it all at start-up and its engine core be killed; use at most $((mem_gib / 2))" >&2
    exit 2
fi

if ! "$python" -c "import vllm" 2> /dev/null; then
    echo "vLLM does not import from PYTHONPATH=$PYTHONPATH: install it first with" \
        "scripts/vllm_live_setup.sh device N (a machine gone cold has lost it)" >&2
    exit 2
fi

mkdir -p "$out"
logs="$(mktemp -d)"
"$python" "$repo/scripts/llama_config.py" "$model" --max-positions 40960
KVCORE_ENABLE=vllm "$python" -m kvcore doctor --verbose > "$out/doctor.txt" 2>&1 || true

server_pid=""
stop_server() {
    [[ -n "$server_pid" ]] || return 0
    kill -INT "$server_pid" 2> /dev/null || true
    for _ in $(seq 60); do
        kill -0 "$server_pid" 2> /dev/null || break
        sleep 1
    done
    kill -KILL "$server_pid" 2> /dev/null || true
    wait "$server_pid" 2> /dev/null || true
    # An engine core left behind would hold the GPU memory the next server needs.
    pkill -KILL -f "EngineCore" 2> /dev/null || true
    sleep 2
    server_pid=""
}
trap stop_server EXIT

start_server() {
    local mode="$1" label="$2" log="$logs/server-$2.log"
    case "$mode" in
        stock)
            # The same metrics set-up kvcore launch makes, so the modes differ only in kvcore.
            PROMETHEUS_MULTIPROC_DIR="$(mktemp -d)" \
                "$python" -m vllm.entrypoints.cli.main "${serve_args[@]}" > "$log" 2>&1 &
            ;;
        kvcore | kvcore-transfers | kvcore-ab | kvcore-background | kvcore-stage-all)
            local transfers=1 share=0 background=0 staged=gather
            [[ "$mode" == kvcore ]] && transfers=0
            [[ "$mode" == kvcore-ab ]] && share="${AB_SHARE:-0.5}"
            [[ "$mode" == kvcore-background ]] && background=1
            [[ "$mode" == kvcore-stage-all ]] && staged=all
            "$python" -m kvcore launch vllm --kvcore-transfers "$transfers" \
                --kvcore-stock-share "$share" --kvcore-background-issue "$background" \
                --kvcore-stage-regions "$staged" -- "${serve_args[@]}" > "$log" 2>&1 &
            ;;
        *)
            echo "unknown mode $mode" >&2
            return 2
            ;;
    esac
    server_pid=$!
    local started=$SECONDS
    until "$python" -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" \
        2> /dev/null; do
        if ! kill -0 "$server_pid" 2> /dev/null; then
            echo "$label: the server exited while starting; its log's end:" >&2
            tail -40 "$log" >&2
            server_pid=""
            return 1
        fi
        if ((SECONDS - started > ${START_TIMEOUT_S:-300})); then
            echo "$label: not up after ${START_TIMEOUT_S:-300} s" >&2
            tail -40 "$log" >&2
            return 1
        fi
        sleep 2
    done
    up_after=$((SECONDS - started))
    echo "$label: up after $up_after s"
}

reports=()
declare -A runs_of=()
for mode in "${modes[@]}"; do
    runs_of[$mode]=$((${runs_of[$mode]:-0} + 1))
    label="$mode"
    ((runs_of[$mode] == 1)) || label="$mode-${runs_of[$mode]}"
    if start_server "$mode" "$label"; then
        started=$SECONDS
        trace_args=()
        [[ "$mode" == kvcore-ab ]] && trace_args=(--ab-log "$logs/server-$label.log")
        [[ -n "${FIRST_TURNS:-}" ]] && trace_args+=(--first-turn-tokens "$FIRST_TURNS")
        trace_rc=0
        timeout "${TRACE_TIMEOUT_S:-300}" "$python" "$repo/scripts/live_trace.py" run \
            --url "$url" --model "$model" \
            --mode "$mode" --label "$label" --out "$out/live-$label.json" "${trace_args[@]}" \
            --conversations "${CONVERSATIONS:-28}" --turns "${TURNS:-3}" \
            --max-tokens "${MAX_TOKENS:-16}" \
            --concurrent-max-tokens "${CONCURRENT_MAX_TOKENS:-${MAX_TOKENS:-16}}" \
            --concurrency "${CONCURRENCY:-8,32}" --startup-s "$up_after" \
            --cpu-tier-gib "${CPU_GIB:-48}" > "$logs/trace-$label.txt" 2>&1 || trace_rc=$?
        if ((trace_rc == 0)); then
            reports+=("$out/live-$label.json")
        elif ((trace_rc == 124)); then
            echo "$label: the trace did not finish in ${TRACE_TIMEOUT_S:-300} s" \
                "(TRACE_TIMEOUT_S); the server log's end:" >&2
            tail -20 "$logs/server-$label.log" >&2
        else
            echo "$label: the trace failed:" >&2
            tail -20 "$logs/trace-$label.txt" >&2
        fi
        echo "$label: trace took $((SECONDS - started)) s"
        "$python" -c "import urllib.request as u; print(u.urlopen('$url/metrics').read().decode())" \
            > "$logs/metrics-$label.txt" 2>&1 || true
    fi
    stop_server
    grep -i "kvcore" "$logs/server-$label.log" | grep -v "kvcore A/B" | head -40 \
        > "$logs/kvcore-lines-$label.txt" || true
done

tar -czf "$out/logs.tar.gz" -C "$logs" .

if [[ ${#reports[@]} -gt 0 ]]; then
    device="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    version="$("$python" -c 'import vllm; print(vllm.__version__)' 2> /dev/null || echo unknown)"
    "$python" "$repo/scripts/live_trace.py" combine "${reports[@]}" \
        --out "$out/h200-live-vllm.json" --device "$device" --version "$version" \
        --baseline "${BASELINE:-stock}"
fi
