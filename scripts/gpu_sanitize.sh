#!/usr/bin/env bash
# A slice of the GPU suite under compute-sanitizer (memcheck, then racecheck): the Triton
# gather in both directions, the mover's paths on one row size, and the layered gather
# (every layer in one launch) on vLLM's shared host region. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
slice=(tests/gpu/test_kernels_gpu.py -k "gather_scattered_rows and 1152"
       tests/gpu/test_core_gpu.py -k "mla-1152B and (scattered or one-run)"
       tests/gpu/test_layers_gpu.py -k "1152 and shared_host and gather and uint8")
rc=0
for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider "${slice[@]:0:3}" 2>&1 | tee "$OUT/sanitize-$tool-kernels.log"
    rc=$((rc | PIPESTATUS[0]))
done
compute-sanitizer --tool memcheck --target-processes all --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider "${slice[@]:3:3}" 2>&1 | tee "$OUT/sanitize-memcheck-core.log"
rc=$((rc | PIPESTATUS[0]))
for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider "${slice[@]:6:3}" 2>&1 | tee "$OUT/sanitize-$tool-layers.log"
    rc=$((rc | PIPESTATUS[0]))
done
echo "sanitizer rc=$rc"
exit $rc
