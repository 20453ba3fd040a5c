#!/usr/bin/env bash
# Builds .whl-sglang/ (git-ignored, carried to the GPU machine, installed there by
# scripts/sglang_device_env.sh): SGLang 0.5.23 without its dependency tree, plus the few
# modules its pool and transfer code imports that the GPU image lacks, as cp312 wheels for
# manylinux x86_64. sgl-kernel is not among them (373 MB); the benches stand in for it.
# About 47 MB, under one call's 64 MiB carry.
#
#   scripts/sglang_device_wheels.sh          (from anywhere; needs the package index)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST="$REPO/.whl-sglang"
PACKAGES=(
    sglang==0.5.23 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 pyzmq ipython traitlets
    pygments msgspec orjson dill gguf pybase64 starlette loguru sortedcontainers
    # The image of 2026-11-30 had no pydantic.
    pydantic pydantic-core annotated-types typing-inspection anyio sniffio typing-extensions
)
PLATFORMS=()
for platform in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$platform")
done
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${PACKAGES[@]}"
du -sh "$DEST"
