#!/usr/bin/env bash
# Issue 21 item 6 on the GPU machine: vLLM's own GPU transfer tests
# (tests/v1/kv_offload/cpu/test_gpu_worker.py, from the sdist of the release) run three
# times: against vLLM's stock handler (the baseline), then against kvcore's handler under
# stock's names (ci/vllm_upstream/conftest.py's classes-gpu mode, KVCORE_TRANSFERS=1) with
# the serve rule on, then with KVCORE_SERVE_RULE=0, where kvcore copies every job it can.
#
# Here (local half), once per release:
#   scripts/vllm_upstream_gpu.sh stage       the sdist files the tests need into
#                                            .vllm-upstream-gpu/ (git-ignored, a few KiB)
# There (device half), one call of about 5 minutes at most, carrying that folder:
#   run(command="OUT=$OUT bash scripts/vllm_upstream_gpu.sh run", carry=[".vllm-upstream-gpu"])
# with vLLM installed under $VSITE first (scripts/vllm_live_setup.sh's device calls). Extra
# arguments after `run` go to every pytest call (e.g. -x, -k). The conftest, the lists of
# differences and kvcore's plugin entry point come from this checkout at run time, so
# editing them needs no new stage.
#
# Settings: VLLM_VERSION (stage: 0.25.1), UPSTREAM_TESTS_CACHE (stage: where
# ci/run_vllm_upstream.sh caches sdists, ~/.cache/kvcore-ci), STAGE_DIR (where stage writes
# and run reads: the carried .vllm-upstream-gpu by default), VSITE (run: /tmp/vsite),
# PASS_SECONDS (run: wall seconds a pass may take, 90), OUT (run: out/vllm-upstream-gpu).
# Writes under $OUT four files: upstream-gpu.log and junit-stock.xml, junit-kvcore-rule.xml,
# junit-kvcore-norule.xml. Exit status: 0 when all three passes pass, else 1 (the log's last
# lines give each pass's pytest status). Back here, `python -m ci.matrix gpu-record DIR`
# (DIR: the fetched $OUT) stores the run in ci/gpu_lanes/ and shows it in docs/compat.md.
set -uo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
staged="${STAGE_DIR:-$repo/.vllm-upstream-gpu}"
tests=tests/v1/kv_offload/cpu/test_gpu_worker.py

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit 2
}

stage() {
    set -e
    local version=${VLLM_VERSION:-0.25.1}
    local cache=${UPSTREAM_TESTS_CACHE:-$HOME/.cache/kvcore-ci}
    local sdist="$cache/sdists/vllm-$version/vllm-$version.tar.gz"
    if [[ ! -f "$sdist" ]]; then
        echo "no $sdist: ci/run_vllm_upstream.sh VENV stock (a vLLM $version lane venv) caches it" >&2
        exit 1
    fi
    local unpacked
    unpacked="$(mktemp -d "${TMPDIR:-/tmp}/kvcore-vllm-gpu.XXXXXX")"
    # shellcheck disable=SC2064 # the path is fixed now
    trap "rm -rf '$unpacked'" EXIT
    tar -xzf "$sdist" -C "$unpacked" "vllm-$version/tests"
    rm -rf "$staged"
    python3 "$repo/ci/vllm_upstream/stage.py" --sdist-only "$unpacked/vllm-$version" \
        "$staged/vllm-$version" "$tests"
    du -sh "$staged"
}

# one_pass NAME MODE [PYTEST_ARGS...]: pytest over the staged tests in MODE, its junit
# under $OUT; returns pytest's status (124 or 137: it ran past PASS_SECONDS).
one_pass() {
    local name=$1 mode=$2
    shift 2
    echo "=== $name: UPSTREAM_TESTS_MODE=$mode KVCORE_ENABLE=${KVCORE_ENABLE:-} " \
        "KVCORE_TRANSFERS=${KVCORE_TRANSFERS:-} KVCORE_SERVE_RULE=${KVCORE_SERVE_RULE:-}" \
        | tee -a "$log"
    (
        cd "$run_dir" || exit 1
        UPSTREAM_TESTS_MODE=$mode timeout --kill-after=10 "${PASS_SECONDS:-90}" \
            python3 -m pytest -p no:cacheprovider -q -rfEX -o junit_family=xunit2 \
            --junitxml="$OUT/junit-$name.xml" "$@" "$tests"
    ) 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

run() {
    local sdists=("$staged"/vllm-*)
    if [[ ! -d "${sdists[0]}" ]]; then
        echo "no $staged/vllm-*: run '$0 stage' here and carry .vllm-upstream-gpu" >&2
        exit 1
    fi
    local version=${sdists[0]##*/vllm-}
    local vsite=${VSITE:-/tmp/vsite}
    if [[ ! -d "$vsite/vllm" ]]; then
        echo "no vLLM under $vsite: run scripts/vllm_live_setup.sh's device calls first" >&2
        exit 1
    fi
    OUT=${OUT:-out/vllm-upstream-gpu}
    mkdir -p "$OUT"
    OUT="$(cd "$OUT" && pwd)"
    log="$OUT/upstream-gpu.log"
    : > "$log"
    local scratch
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/kvcore-vllm-gpu.XXXXXX")"
    # shellcheck disable=SC2064 # the path is fixed now
    trap "rm -rf '$scratch'" EXIT
    run_dir="$scratch/run"
    # kvcore runs from this checkout, not installed: its plugin's entry point is metadata
    # alone, in a folder of its own on PYTHONPATH, where vLLM's plugin loader finds it.
    python3 "$repo/ci/vllm_upstream/stage.py" --entry-points "$scratch/site" \
        "${sdists[0]}" "$run_dir" "$tests" 2>&1 | tee -a "$log"
    [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
    export PYTHONPATH="$vsite:$repo:$repo/integrations:$scratch/site"
    # flashinfer is not carried; nothing here samples, but vLLM's imports may ask.
    export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export HF_HOME="$run_dir/hf" HF_HUB_CACHE="$run_dir/hf/hub" PYTHONUNBUFFERED=1
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        python3 -c 'import importlib.metadata as m, torch
print("torch", torch.__version__, "vllm", m.version("vllm"), "cuda", torch.cuda.is_available())'
    } 2>&1 | tee -a "$log"
    local installed
    installed="$(python3 -c 'import importlib.metadata as m; print(m.version("vllm").split("+")[0])')"
    if [[ "$installed" != "$version" ]]; then
        echo "vLLM $installed under $vsite, but the staged tests are $version's" | tee -a "$log"
        exit 1
    fi

    local stock=0 rule=0 norule=0
    unset KVCORE_ENABLE KVCORE_TRANSFERS KVCORE_SERVE_RULE
    one_pass stock stock "$@" || stock=$?
    export KVCORE_ENABLE=vllm KVCORE_TRANSFERS=1 KVCORE_SERVE_RULE=1
    one_pass kvcore-rule classes-gpu "$@" || rule=$?
    export KVCORE_SERVE_RULE=0
    one_pass kvcore-norule classes-gpu "$@" || norule=$?
    echo "pytest status: stock $stock, kvcore (rule on) $rule, kvcore (rule off) $norule" \
        | tee -a "$log"
    [[ $stock == 0 && $rule == 0 && $norule == 0 ]]
}

case "${1:-}" in
    stage) stage ;;
    run)
        shift
        run "$@"
        ;;
    *) usage ;;
esac
