#!/usr/bin/env bash
# The whole GPU suite in one device call: the gpu-marked tests, `kvcore bench`, then the host
# time of each submission step (scripts/submit_cost.py).
# Usage (on the GPU machine, from the repo root): scripts/gpu_suite.sh [bench args...]
# Logs, the bench JSON/plot and submit_cost.json go to $OUT (default: ./out/gpu).
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu -m gpu -x 2>&1 | tee "$OUT/pytest-gpu.log"
tests_rc=${PIPESTATUS[0]}
python3 -m kvcore bench --no-progress --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" \
    2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
python3 scripts/submit_cost.py --json "$OUT/submit_cost.json" 2>&1 | tee "$OUT/submit_cost.log"
cost_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc bench rc=$bench_rc submit_cost rc=$cost_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$cost_rc" = 0 ]
