#!/usr/bin/env bash
# Builds .vllm-tree/ (git-ignored): the part of vLLM 0.33.0 that benchmarks.vllm.ab.ab and the
# kvcore handler import, for the GPU machine, where vLLM cannot be installed whole (its
# compiled extensions are 500+ MB, built for torch 2.14; the device has torch 2.11).
#
# Contents:
#   vllm/...                   the pure-Python modules of vLLM that the import of
#                              benchmarks.vllm.ab / .sweep and kvcore_vllm.transfers /
#                              .page_rows loads, traced in .venv-vllm with vLLM's CUDA
#                              platform selected (what the device resolves), so
#                              vllm/platforms/cuda.py and its imports are in.
#   vllm/_C_stable_libtorch.py stub: vllm/platforms/cuda.py imports the compiled ops at module
#                              level with no guard (interface.py guards vllm._C and
#                              CudaPlatform.import_kernels guards the rest). The stub registers
#                              nothing, so torch.ops._C_cache_ops stays absent and the bench
#                              skips the stock_handler path (it times the Python-level paths).
#   vllm-0.33.0.dist-info/     METADATA only: vLLM's platform detection reads
#                              importlib.metadata.version("vllm") and raises without it.
#   wheels/                    cp312 wheels of the C-extension deps those modules import
#                              (msgspec, pyzmq) and of psutil and regex, which the device image
#                              has; scripts/vllm_ab.sh installs only the ones it lacks.
#
# Usage: scripts/vllm_device_tree.sh [--offline]   (from anywhere; writes <repo>/.vllm-tree)
#   VENV_PY=<python of a vLLM 0.33.0 venv> when .venv-vllm holds another release (0.34):
#   VLLM_VERSION=0.33.0 bash ci/install_vllm.sh /tmp/venv-vllm033, then VENV_PY=/tmp/venv-vllm033/bin/python.
# --offline skips the wheel download (keeps the wheels already in .vllm-tree/wheels).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
TREE="$REPO/.vllm-tree"
VENV_PY=${VENV_PY:-$REPO/.venv-vllm/bin/python}  # a venv of vLLM $VLLM_VERSION (ci/install_vllm.sh)
VLLM_VERSION=0.33.0
WHEELS=(msgspec==0.22.0 pyzmq==27.3.0 psutil==7.2.2 regex==2026.11.19 cbor2==6.3.0)
# What importing vLLM 0.33's shared region and CPU worker reaches beyond the image's packages
# (found by blocking every distribution scripts/device_image_packages.txt does not list).
WHEELS+=(oss-harmony==0.0.11 openai==3.63.0 sniffio==1.3.1 pybase64==1.5.1 cachetools==8.0.2)
WHEELS+=(xgrammar==0.2.8 llguidance==1.7.6 apache-tvm-ffi==0.1.15.post2 fastapi==0.136.3)
WHEELS+=(starlette==1.10.0 partial-json-parser==0.2.1.1.post7 pydantic==2.14.4)
WHEELS+=(pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0)
WHEELS+=(httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5)

site=$("$VENV_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
have=$("$VENV_PY" -c "import importlib.metadata as m; print(m.version('vllm'))")
[ "$have" = "$VLLM_VERSION" ] || { echo "need vLLM $VLLM_VERSION in .venv-vllm, found $have"; exit 1; }

# The module files the import loads, relative to site-packages. The compiled ops are
# stubbed in sys.modules here too, so the trace matches what the device will load.
modules=$(
    cd /tmp && PYTHONPATH="$REPO:$REPO/integrations" "$VENV_PY" - "$site" <<'EOF'
import os
import sys
import types

sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
import vllm.platforms

vllm.platforms.builtin_platform_plugins["cuda"] = lambda: "vllm.platforms.cuda.CudaPlatform"
import benchmarks.vllm.ab  # noqa: F401
import benchmarks.vllm.sweep  # noqa: F401
import kvcore_vllm.page_rows  # noqa: F401
import kvcore_vllm.manager  # noqa: F401
import kvcore_vllm.region_faulting  # noqa: F401
import kvcore_vllm.transfers  # noqa: F401
import vllm.v1.kv_offload.cpu.shared_offload_region  # noqa: F401  (kvcore bench --host-pool)
import vllm.v1.kv_offload.cpu.spec  # noqa: F401  (where 0.33 keeps the region's segment count)
import vllm.v1.kv_offload.cpu.policies.arc  # noqa: F401  (the managers' policies, which
import vllm.v1.kv_offload.cpu.policies.lru  # noqa: F401  vLLM's factory imports by name)

assert type(vllm.platforms.current_platform).__module__ == "vllm.platforms.cuda"
site = sys.argv[1]
for name, module in sorted(sys.modules.items()):
    path = getattr(module, "__file__", None) or ""
    if name.startswith("vllm") and path.endswith(".py"):
        print(os.path.relpath(path, site))
EOF
)

old_wheels=$(mktemp -d)
[ -d "$TREE/wheels" ] && cp -a "$TREE/wheels/." "$old_wheels/"
rm -rf "$TREE"
mkdir -p "$TREE/wheels"
cp -a "$old_wheels/." "$TREE/wheels/"
rm -rf "$old_wheels"
for rel in $modules; do
    install -D -m 644 "$site/$rel" "$TREE/$rel"
done

cat >"$TREE/vllm/_C_stable_libtorch.py" <<'EOF'
"""Stand-in for vLLM's compiled ops, which are not carried to the GPU machine.

Registers no operator: torch.ops._C_cache_ops stays absent, so the A/B bench skips the
stock_handler path. Generated by scripts/vllm_device_tree.sh.
"""
EOF

mkdir -p "$TREE/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_VERSION" \
    >"$TREE/vllm-$VLLM_VERSION.dist-info/METADATA"

if [ "${1:-}" != "--offline" ]; then
    rm -f "$TREE"/wheels/*.whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$TREE/wheels" "${WHEELS[@]}"
fi

exclude="$REPO/.git/info/exclude"
grep -qx '/.vllm-tree/' "$exclude" || echo '/.vllm-tree/' >>"$exclude"

echo "$(echo "$modules" | wc -l) vLLM modules; wheels: $(ls "$TREE/wheels" | tr '\n' ' ')"
du -sh "$TREE"
