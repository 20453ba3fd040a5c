#!/usr/bin/env bash
# Run vLLM's own offload tests (from the PyPI sdist of the venv's vLLM) on CPU.
#
#   ci/run_vllm_upstream.sh VENV MODE [JUNIT_XML] [PYTEST_ARGS...]
#
# MODE is stock (kvcore off), plugin (KVCORE_ENABLE=vllm), patched (the venv's vLLM
# carries kvcore's patches; KVCORE_ENABLE unset) or classes (as plugin, with kvcore's
# manager under the name of vLLM's, so that vLLM's manager tests run against it). The
# staged conftest loads vLLM's general plugins and stops unless the spec vLLM builds is the
# one the mode implies.
# The sdist is cached under $UPSTREAM_TESTS_CACHE (default ~/.cache/kvcore-ci); its tests are
# staged into a fresh temporary directory, never into the repository. Tests listed in
# ci/vllm_upstream/deselect.txt (and deselect-VERSION.txt, for one release) are
# deselected; pytest is stopped after $UPSTREAM_TESTS_TIMEOUT seconds (default 1800).
# With $KVCORE_ADAPTER_COVERAGE set, pytest loads ci/matrix/adapter_coverage.py, which
# writes the adapters' line coverage to the file it names.
# Exit status is pytest's.
set -euo pipefail

if [[ $# -lt 2 || ! "$2" =~ ^(stock|plugin|patched|classes)$ ]]; then
    echo "usage: $0 VENV stock|plugin|patched|classes [JUNIT_XML] [PYTEST_ARGS...]" >&2
    exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$(cd "$1" && pwd)"
mode="$2"
shift 2
python="$venv/bin/python"
cache="${UPSTREAM_TESTS_CACHE:-$HOME/.cache/kvcore-ci}"
here="$repo/ci/vllm_upstream"

version="$("$python" -c 'import importlib.metadata as m; print(m.version("vllm").split("+")[0])')"
junit="${1:-$cache/results/vllm-$version-$mode.xml}"
[[ $# -gt 0 ]] && shift
mkdir -p "$(dirname "$junit")"
junit="$(cd "$(dirname "$junit")" && pwd)/$(basename "$junit")"

# pip prepares an sdist's metadata before it keeps the file, and vLLM's build
# requirements pull a CUDA torch: so metadata is built without isolation, in a small venv
# that borrows the lane venv's torch through a .pth file, for no device, with no local
# version label (pip compares the built version with the requested one).
sdist_dir="$cache/sdists/vllm-$version"
sdist="$sdist_dir/vllm-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    fetch_venv="$cache/sdist-fetch-venv"
    if [[ ! -x "$fetch_venv/bin/python" ]]; then
        python3 -m venv "$fetch_venv"
        "$fetch_venv/bin/python" -m pip install --disable-pip-version-check -q \
            "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" \
            wheel packaging jinja2
    fi
    lane_site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    fetch_site="$("$fetch_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$lane_site" > "$fetch_site/kvcore-ci-lane.pth"
    mkdir -p "$sdist_dir"
    fetch=("$fetch_venv/bin/python" -m pip download --disable-pip-version-check
        --no-deps --no-binary :all: --no-build-isolation -d "$sdist_dir")
    export VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1
    if ! fetched="$("${fetch[@]}" "vllm==$version" 2>&1)"; then
        # Releases before VLLM_SKIP_VERSION_SUFFIX (0.25) label the built version
        # (0.25.1+empty), which pip then finds inconsistent with the one requested and
        # discards, naming the sdist's address: fetched by that address, it is not compared.
        url="$(grep -oE "Discarding https://[^ ]+/vllm-$version\.tar\.gz" <<< "$fetched" \
            | head -n 1 | cut -d' ' -f2)"
        if [[ -z "$url" ]]; then
            echo "$fetched" >&2
            exit 1
        fi
        "${fetch[@]}" -q "$url"
    fi
    unset VLLM_TARGET_DEVICE VLLM_SKIP_VERSION_SUFFIX
fi

stage="$(mktemp -d "${TMPDIR:-/tmp}/kvcore-vllm-upstream.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
tar -xzf "$sdist" -C "$stage" "vllm-$version/tests"
"$python" "$here/stage.py" "$stage/vllm-$version" "$stage/run"

deselect=()
for list in "$here/deselect.txt" "$here/deselect-$version.txt"; do
    [[ -f "$list" ]] || continue
    while read -r test_id _; do
        [[ -z "$test_id" || "$test_id" == \#* ]] && continue
        deselect+=("--deselect" "$test_id")
    done < "$list"
done

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HOME="$stage/run/hf" HF_HUB_CACHE="$stage/run/hf/hub"
export UPSTREAM_TESTS_MODE="$mode"
if [[ "$mode" == plugin || "$mode" == classes ]]; then
    export KVCORE_ENABLE=vllm
else
    unset KVCORE_ENABLE
fi

plugins=()
if [[ -n "${KVCORE_ADAPTER_COVERAGE:-}" ]]; then
    # Only the collector goes on the path: the repository's own packages (its `tests`
    # above all) would shadow the staged ones.
    mkdir "$stage/plugins"
    cp "$repo/ci/matrix/adapter_coverage.py" "$stage/plugins/"
    export PYTHONPATH="$stage/plugins${PYTHONPATH:+:$PYTHONPATH}"
    plugins=(-p adapter_coverage)
fi

cd "$stage/run"
status=0
# A failed multiprocess test can leave its workers blocked and pytest joining them at exit.
timeout --kill-after=30 "${UPSTREAM_TESTS_TIMEOUT:-1800}" "$python" -m pytest -p no:cacheprovider "${plugins[@]}" -q -o junit_family=xunit2 \
    --junitxml="$junit" "${deselect[@]}" "$@" tests/v1/kv_offload tests/v1/kv_connector/unit/offloading_connector \
    || status=$?
echo "junit: $junit"
exit "$status"
