# Sourced by the vLLM device scripts (vllm_ab.sh; by hand before vllm_host_profile.py):
# puts the carried vLLM tree and the wheels the image lacks on PYTHONPATH, on a GPU machine
# without internet. Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried; .whl/ too
# when carried. Without .vllm-tree/, the vLLM that scripts/vllm_live_setup.sh installed on
# this warm machine (VSITE, /tmp/vsite: vLLM 0.25.1) is used instead, so a bench can run
# between the live runs without carrying a tree. Writes what it used to $OUT/env.txt;
# returns non-zero on failure.
mkdir -p "$OUT"
vsite=${VSITE:-/tmp/vsite}
tree=""
if [ -d .vllm-tree/vllm ]; then
    # The image's psutil/regex win; a tree wheel goes in only where the image lacks the module.
    wheels=()
    [ -d .whl ] && wheels+=(.whl/*.whl)
    for wheel in .vllm-tree/wheels/*.whl; do
        module=$(basename "$wheel" | cut -d- -f1)
        case $module in
            pyzmq) module=zmq ;;
            oss_harmony) module=openai_harmony ;;
            apache_tvm_ffi) module=tvm_ffi ;;
        esac
        python3 -c "import $module" 2>/dev/null || wheels+=("$wheel")
    done
    if [ ${#wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "${wheels[@]}" || return 1
    fi
    tree=$PWD/.vllm-tree
    export PYTHONPATH="$tree:$PWD:$PWD/integrations:/tmp/site"
    used="installed into /tmp/site: ${wheels[*]:-none}"
elif [ -d "$vsite/vllm" ]; then
    export PYTHONPATH="$vsite:$PWD:$PWD/integrations"
    # flashinfer is not carried; vLLM's sampler would import it.
    export VLLM_USE_FLASHINFER_SAMPLER=0
    used="vLLM from $vsite (scripts/vllm_live_setup.sh), no .vllm-tree"
else
    echo "no .vllm-tree: run scripts/vllm_device_tree.sh and carry it (or install vLLM with" \
        "scripts/vllm_live_setup.sh device N first)"
    return 1
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
echo "$used" | tee -a "$OUT/env.txt"

if ! python3 -c "import benchmarks.vllm.ab" >"$OUT/preflight.log" 2>&1; then
    [ -n "$tree" ] || {
        cat "$OUT/preflight.log"
        return 1
    }
    # vllm/env_override.py patches torch.compile internals by torch version (vLLM 0.33 wants
    # torch 2.14); the device scripts compile nothing, so if the import fails, use a copy of
    # the tree without it.
    tree=/tmp/vllm-tree
    rm -rf "$tree" && cp -r .vllm-tree "$tree"
    echo '"""Emptied by scripts/vllm_device_env.sh: the real one failed to import here."""' \
        >"$tree/vllm/env_override.py"
    export PYTHONPATH="$tree:$PWD:$PWD/integrations:/tmp/site"
    echo "import failed; retrying with vllm/env_override.py emptied" | tee -a "$OUT/env.txt"
    python3 -c "import benchmarks.vllm.ab" >>"$OUT/preflight.log" 2>&1 || {
        cat "$OUT/preflight.log"
        return 1
    }
fi
