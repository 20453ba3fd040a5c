#!/usr/bin/env bash
# A live vLLM 0.25.1 engine on the lent GPU machine (REFERENCE.md §6, docs/operations.md):
# vLLM 0.25.1 pins the image's torch 2.11 and links its CUDA 13 runtime, so only vLLM and a
# few light wheels are carried. The machine reaches no registry, and a call carries at most
# 64 MiB, so the wheels travel as one tar cut into parts, one part per call.
#
# Here (local half):
#   scripts/vllm_live_setup.sh local        download, then pack
#   scripts/vllm_live_setup.sh download     wheels into .whl/vllm-live/ (git-ignored)
#   scripts/vllm_live_setup.sh pack [DIR]   DIR's wheels (.whl/vllm-live/ by default) as one
#                                           tar, cut into .whl-vllm-part-N/ (git-ignored),
#                                           each with SHA256SUMS (every part and the tar)
# There (device half), one call per part, back to back, each carrying its own folder:
#   run(command="bash scripts/vllm_live_setup.sh device N", carry=[".whl-vllm-part-N"])
# copies part N to $STAGE after checking it; the call that completes the set joins the
# parts, checks the tar and installs its wheels with
# `pip install --no-index --no-deps --target $VSITE`, then kvcore into $KSITE.
# Then: PYTHONPATH=$VSITE:$KSITE VLLM_USE_FLASHINFER_SAMPLER=0, a model directory from
# scripts/llama_config.py, and LLM(..., load_format="dummy", skip_tokenizer_init=True).
#
# Settings: PART_SIZE (split's -b, default 44m: a call carries 64 MiB with the working tree,
# about 11 MB), PARTS_ROOT (where the part folders go,
# default the repo), STAGE (/tmp/stage), VSITE (/tmp/vsite), KSITE (/tmp/ksite; empty:
# kvcore is not installed), PYTHON (python3).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION=0.25.1
wheel_dir="$repo/.whl/vllm-live"
parts_root="${PARTS_ROOT:-$repo}"
part_size="${PART_SIZE:-44m}"
stage="${STAGE:-/tmp/stage}"
vsite="${VSITE:-/tmp/vsite}"
ksite="${KSITE-/tmp/ksite}"
python="${PYTHON:-python3}"
bundle=vllm-live.tar
work=""

# The device's interpreter and the newest glibc tag a carried wheel may need (llguidance
# ships manylinux_2_31); pip also accepts the older manylinux tags and pure wheels.
target=(--only-binary=:all: --python-version 3.12 --implementation cp
    --abi cp312 --abi abi3 --abi none
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64)
# Carried with what they depend on.
resolved=(
    cachetools blake3 "fastapi[standard]>=0.133,<0.137" starlette openai pydantic
    prometheus-fastapi-instrumentator diskcache lark partial-json-parser jsonschema pyzmq
    msgspec watchfiles python-json-logger pybase64 cbor2 ijson setproctitle openai-harmony
)
# Carried alone: their own requirements pull CUDA packages or pins the image satisfies.
alone=(
    compressed-tensors==0.17.0 depyf==0.20.0 lm-format-enforcer==0.11.3 astor dill
    "llguidance>=1.7,<1.8" xgrammar==0.2.8 outlines_core==0.2.14 apache-tvm-ffi==0.1.11
    # The OpenAI server's SageMaker routes import it (the offline LLM class does not).
    model-hosting-container-standards==0.1.16 jmespath supervisor opentelemetry-api
)

usage() {
    sed -n '2,25p' "$0" >&2
    exit 2
}

download() {
    mkdir -p "$wheel_dir"
    local pip=("$python" -m pip download --disable-pip-version-check -q -d "$wheel_dir")
    "${pip[@]}" "${target[@]}" --no-deps "vllm==$VLLM_VERSION" "${alone[@]}"
    "${pip[@]}" "${target[@]}" "${resolved[@]}"
    # What the image already holds (KINDS.md's list) stays out of the carry.
    local wheel name
    for wheel in "$wheel_dir"/*.whl; do
        name="$(basename "$wheel")"
        name="${name%%-*}"
        name="${name//_/-}"
        if grep -qixF -- "$name" "$repo/scripts/device_image_packages.txt"; then
            rm -f -- "$wheel"
        fi
    done
    du -sh "$wheel_dir"
}

pack() {
    local from="${1:-$wheel_dir}"
    compgen -G "$from/*.whl" > /dev/null || { echo "no wheels in $from" >&2; exit 1; }
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    tar -cf "$work/$bundle" -C "$from" .
    split -b "$part_size" -d -a 2 "$work/$bundle" "$work/$bundle.part-"
    (cd "$work" && sha256sum "$bundle" "$bundle".part-* > SHA256SUMS)
    rm -rf "$parts_root"/.whl-vllm-part-*
    local part n=0
    for part in "$work/$bundle".part-*; do
        n=$((n + 1))
        mkdir -p "$parts_root/.whl-vllm-part-$n"
        mv "$part" "$parts_root/.whl-vllm-part-$n/"
        cp "$work/SHA256SUMS" "$parts_root/.whl-vllm-part-$n/"
    done
    echo "$n parts of at most $part_size under $parts_root; on the GPU machine, one call each:"
    for ((part = 1; part <= n; part++)); do
        echo "  bash scripts/vllm_live_setup.sh device $part   (carry .whl-vllm-part-$part)"
    done
}

device() {
    local n="$1" from="$parts_root/.whl-vllm-part-$1"
    [[ -f "$from/SHA256SUMS" ]] || { echo "no part $n at $from" >&2; exit 1; }
    # A part that fails its check is never staged, so a later call cannot join it.
    (cd "$from" && grep -F " $(basename "$from"/"$bundle".part-*)" SHA256SUMS | sha256sum -c --quiet -)
    mkdir -p "$stage"
    cp -- "$from"/* "$stage/"
    local expected staged
    expected="$(grep -c "$bundle\.part-" "$stage/SHA256SUMS")"
    staged="$(compgen -G "$stage/$bundle.part-*" | wc -l)"
    echo "part $n staged ($staged of $expected)"
    [[ "$staged" -eq "$expected" ]] || return 0
    cat "$stage/$bundle".part-* > "$stage/$bundle"
    (cd "$stage" && grep -E " $bundle\$" SHA256SUMS | sha256sum -c --quiet -)
    rm -f "$stage/$bundle".part-*
    rm -rf "$stage/wheels"
    mkdir -p "$stage/wheels"
    tar -xf "$stage/$bundle" -C "$stage/wheels"
    "$python" -m pip install --disable-pip-version-check -q --no-index --no-deps \
        --target "$vsite" "$stage"/wheels/*.whl
    if [[ -n "$ksite" ]]; then
        "$python" -m pip install --disable-pip-version-check -q --no-deps \
            --no-build-isolation --target "$ksite" "$repo"
    fi
    echo "installed into $vsite; run with PYTHONPATH=$vsite${ksite:+:$ksite}" \
        "VLLM_USE_FLASHINFER_SAMPLER=0"
}

case "${1:-}" in
    local)
        download
        pack
        ;;
    download) download ;;
    pack) pack "${2:-}" ;;
    device) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || usage; device "$2" ;;
    *) usage ;;
esac
