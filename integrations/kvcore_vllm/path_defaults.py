"""The path policy kvcore's vLLM handlers copy with.

A vLLM job moves whole blocks (16 tokens of one layer: 18-64 KiB on common models), each
its own run on the GPU side. Beside the model's compute, such blocks copied by DMA straight
into place (one ``cudaMemcpyBatchAsync`` descriptor a block, no kernel) left another batch's
forward exactly as fast as beside stock's copy, where kvcore's gather kernel slowed it by
4-12%, for loads as fast as the gather's (docs/performance.md, "Reloads beside the model's
compute"). So vLLM's handlers take blocks of :data:`DMA_BLOCK_BYTES` and more by DMA,
unless ``KVCORE_LONG_RUN_BYTES`` or ``KVCORE_MAX_BATCHED_RUNS`` says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from kvcore.config import KVCoreConfig
from kvcore.planning.path_policy import PathPolicy, policy_from_config

DMA_BLOCK_BYTES = 32 << 10
"""The smallest block vLLM's handlers copy by DMA into place: the smallest measured so
(MHA's 32 KiB blocks); MLA's 18 KiB blocks keep the gather until they are measured."""
DMA_MOST_BLOCKS = 1 << 16
"""The most blocks of one layer a job copies that way (131072 tokens of 16-token blocks)."""
OVERRIDES = ("KVCORE_LONG_RUN_BYTES", "KVCORE_MAX_BATCHED_RUNS")
"""The settings that, when set, keep the policy as configured."""


def vllm_policy(config: KVCoreConfig, environ: Mapping[str, str] | None = None) -> PathPolicy:
    """``config``'s path policy, with blocks copied by DMA into place where the environment
    sets neither of :data:`OVERRIDES` (an empty variable counts as unset)."""
    environ = os.environ if environ is None else environ
    policy = policy_from_config(config)
    if any(environ.get(name) for name in OVERRIDES):
        return policy
    return replace(policy, long_run_bytes=DMA_BLOCK_BYTES, max_batched_runs=DMA_MOST_BLOCKS)
