#!/usr/bin/env bash
# Issue 44's copy-engine-only trial in one device call: both beside-compute benches with paged
# rows copied by DMA straight into their pages (one cudaMemcpyBatchAsync descriptor a page,
# no kernel) wherever a page is at least DMA_RUN_BYTES, against the default policy's paths.
# Carry .whl-sglang and .vllm-tree (see beside_compute_gpu.sh and beside_compute_vllm_gpu.sh).
#
#   OUT=<dir> bash scripts/dma_in_place_gpu.sh
#
# Writes $OUT/sglang-dma/, $OUT/vllm-dma/ and $OUT/vllm-staged/ (each the bench's JSON and log).
set -uo pipefail
OUT=${OUT:-out/dma-in-place}
DMA_RUN_BYTES=${DMA_RUN_BYTES:-32KiB}
export KVCORE_LONG_RUN_BYTES=$DMA_RUN_BYTES KVCORE_MAX_BATCHED_RUNS=4096
(OUT=$OUT/sglang-dma BESIDE_SECONDS=240 bash scripts/beside_compute_gpu.sh --rows mha,mla \
    --sizes 8192,32768 --pages 64,16 --compute prefill-4096,decode-64 --repeats 4)
(OUT=$OUT/vllm-dma BESIDE_SECONDS=120 bash scripts/beside_compute_vllm_gpu.sh --sizes 8192,32768)
unset KVCORE_LONG_RUN_BYTES KVCORE_MAX_BATCHED_RUNS
# The other copy-engine way for vLLM's jobs: DMA into device staging, then a scatter.
(KVCORE_STAGING_BYTES=2GiB OUT=$OUT/vllm-staged BESIDE_SECONDS=120 \
    bash scripts/beside_compute_vllm_gpu.sh --sizes 8192)
