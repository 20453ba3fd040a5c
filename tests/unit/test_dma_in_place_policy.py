"""path_policy.dma_in_place_policy: paged rows go by DMA into place unless the settings say not
(vLLM's handlers always; SGLang's hooks under KVCORE_SGLANG_DMA_IN_PLACE)."""

from __future__ import annotations

import pytest

from kvcore.config import KVCoreConfig
from kvcore.planning.path_choice import choose_path
from kvcore.planning.path_policy import (
    DMA_IN_PLACE_MOST_RUNS,
    DMA_IN_PLACE_RUN_BYTES,
    SGLANG_DMA_IN_PLACE_RUN_BYTES,
    PathPolicy,
    TransferPath,
    dma_in_place_policy,
    policy_from_config,
)
from kvcore_sglang.hook_mover import sglang_policy


def test_without_either_setting_blocks_go_by_dma_into_place():
    policy = dma_in_place_policy(KVCoreConfig.from_env({}), environ={})
    assert (policy.long_run_bytes, policy.max_batched_runs) == (
        DMA_IN_PLACE_RUN_BYTES,
        DMA_IN_PLACE_MOST_RUNS,
    )
    # 2048 scattered 32 KiB blocks of one layer (32k tokens), host side in one run.
    blocks, block_bytes = 2048, 32 << 10
    assert choose_path(blocks, 1, blocks * block_bytes, policy) is TransferPath.BATCHED_RUNS
    assert choose_path(blocks, 1, blocks * block_bytes, PathPolicy()) is not (
        TransferPath.BATCHED_RUNS
    )
    # Blocks under the threshold (MLA's 18 KiB, a small model's 8 KiB) keep the other paths.
    for small in (18 << 10, 8 << 10):
        assert choose_path(blocks, 1, blocks * small, policy) is not TransferPath.BATCHED_RUNS


@pytest.mark.parametrize(
    "environ",
    [{"KVCORE_LONG_RUN_BYTES": "256KiB"}, {"KVCORE_MAX_BATCHED_RUNS": "256"}],
)
def test_either_setting_keeps_the_configured_policy(environ):
    config = KVCoreConfig.from_env(environ)
    policy = dma_in_place_policy(config, environ=environ)
    assert policy.long_run_bytes == config.long_run_bytes
    assert policy.max_batched_runs == config.max_batched_runs


def test_an_empty_setting_counts_as_unset():
    environ = {"KVCORE_LONG_RUN_BYTES": ""}
    policy = dma_in_place_policy(KVCoreConfig.from_env(environ), environ=environ)
    assert policy.long_run_bytes == DMA_IN_PLACE_RUN_BYTES


def test_the_other_settings_carry_through():
    environ = {"KVCORE_STAGING_BYTES": "64MiB", "KVCORE_GATHER_CTAS": "6"}
    policy = dma_in_place_policy(KVCoreConfig.from_env(environ), environ=environ)
    assert policy.staging_bytes == 64 << 20 and policy.gather_ctas == 6


def test_sglangs_hooks_take_pages_by_dma_from_128_kib():
    """MHA's 128 KiB pages by DMA; its 32 KiB pages and MLA's 72 KiB ones keep the other
    paths, which left the hit's own forward faster beside compute."""
    config = KVCoreConfig.from_env({"KVCORE_SGLANG_DMA_IN_PLACE": "1"})
    policy = sglang_policy(config)
    assert policy.long_run_bytes == SGLANG_DMA_IN_PLACE_RUN_BYTES == 128 << 10
    pages = 128
    for page_bytes, by_dma in ((128 << 10, True), (72 << 10, False), (32 << 10, False)):
        path = choose_path(pages, 1, pages * page_bytes, policy)
        assert (path is TransferPath.BATCHED_RUNS) == by_dma, page_bytes
    assert sglang_policy(KVCoreConfig.from_env({})) == policy_from_config(KVCoreConfig())
