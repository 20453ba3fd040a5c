#!/usr/bin/env bash
# Issue 44's copy-engine-only trial in one device call: paged rows copied by DMA straight into
# their pages (one cudaMemcpyBatchAsync descriptor a page, no kernel) wherever a page is at least
# DMA_RUN_BYTES, beside the model's compute, against stock and kvcore's other paths.
# Carry .whl-sglang for the SGLang part, .vllm-tree for the vLLM parts (47 and 24 MB: one
# call carries 64 MiB, so run them in separate calls; see beside_compute_gpu.sh and
# beside_compute_vllm_gpu.sh).
#
#   OUT=<dir> [PARTS="sglang vllm vllm-staged"] bash scripts/dma_in_place_gpu.sh
#
# PARTS picks what runs (default: sglang):
#   sglang       SGLang's kernel backend under KVCORE_SGLANG_DMA_IN_PLACE=1: kvcore reads the
#                device indices back at their move and copies whole pages by DMA where they
#                hold 128 KiB and the request is under 32k tokens; its "own" side (rule off)
#                does so at every such size, its rule-on side where the rule serves; cells
#                from SGLANG_CELLS (default: MHA page 64, 4k-32k tokens) -> $OUT/sglang-dma/
#   vllm         vLLM's handler with blocks by DMA into place -> $OUT/vllm-dma/
#   vllm-staged  vLLM's handler with DMA into device staging, then a scatter -> $OUT/vllm-staged/
# Each writes the bench's JSON and log.
set -uo pipefail
OUT=${OUT:-out/dma-in-place}
DMA_RUN_BYTES=${DMA_RUN_BYTES:-32KiB}
PARTS=${PARTS:-sglang}
mkdir -p "$OUT"
for part in $PARTS; do
    case $part in
        sglang)
            PYTHONPATH=$PWD:$PWD/integrations python3 -m pytest -q -p no:cacheprovider \
                tests/gpu/test_device_reads_gpu.py \
                2>&1 | tail -3 | tee "$OUT/device-reads-tests.log"
            # The setting's own thresholds (SGLang's pages from 128 KiB, requests under
            # 32k tokens); SGLANG_CELLS picks the cells.
            # shellcheck disable=SC2086
            (export KVCORE_SGLANG_DMA_IN_PLACE=1
             OUT=$OUT/sglang-dma BESIDE_SECONDS=${BESIDE_SECONDS:-300} \
                bash scripts/beside_compute_gpu.sh ${SGLANG_CELLS:---rows mha --sizes 4096,8192,16384,32768 --pages 64} \
                --compute prefill-4096,decode-64 --repeats 4) ;;
        vllm)
            (export KVCORE_LONG_RUN_BYTES=$DMA_RUN_BYTES KVCORE_MAX_BATCHED_RUNS=4096
             OUT=$OUT/vllm-dma BESIDE_SECONDS=120 \
                bash scripts/beside_compute_vllm_gpu.sh --sizes 8192,32768) ;;
        vllm-staged)
            (KVCORE_STAGING_BYTES=2GiB OUT=$OUT/vllm-staged BESIDE_SECONDS=120 \
                bash scripts/beside_compute_vllm_gpu.sh --sizes 8192) ;;
        *) echo "dma_in_place_gpu.sh: unknown part '$part' (sglang, vllm, vllm-staged)" >&2; exit 2 ;;
    esac
done
