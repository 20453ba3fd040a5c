"""kvcore_vllm.releases: per-release names, read without vLLM installed."""

from __future__ import annotations

import pytest

from kvcore_vllm import releases


def test_current_names_are_kept():
    shape = releases.shape_of("0.33.0")
    assert shape is releases.CURRENT
    assert shape.qualname("CPUOffloadingManager._allocate_chunks") == (
        "CPUOffloadingManager._allocate_chunks"
    )
    assert not shape.fills_in_transfer_async


def test_025_renames_each_part_of_a_qualname():
    shape = releases.shape_of("0.25.1")
    assert shape.qualname("CPUOffloadingManager._get_num_free_chunks") == (
        "CPUOffloadingManager._get_num_free_blocks"
    )
    assert shape.qualname("ChunkStatus.__init__") == "BlockStatus.__init__"
    assert shape.name("chunk_id") == "block_id"
    assert shape.name("CPUOffloadingSpec") == "CPUOffloadingSpec"
    assert shape.name("src_blocks_per_chunk") == "src_block_size_factor"
    assert shape.name("layer_refs_per_group") == "kv_cache_groups_data_refs"
    assert shape.fills_in_transfer_async


def test_installed_shape_follows_the_installed_release(monkeypatch):
    seen: list[str] = []

    def version(distribution: str) -> str:
        seen.append(distribution)
        return "0.25.1+cu130"

    monkeypatch.setattr(releases.importlib.metadata, "version", version)
    assert releases.installed_shape() is releases.SHAPES["0.25.1"]
    assert seen == ["vllm"]


@pytest.mark.parametrize("release", ["0.25.0", "0.25.1.post1", "0.35.0"])
def test_releases_without_a_shape_get_the_current_names(release):
    assert releases.shape_of(release) is releases.CURRENT


def test_0_34_passes_device_pointers_and_reports_failures_under_0_33s_names():
    shape = releases.shape_of("0.34.0")
    assert shape.device_pointers and shape.reports_failed_transfers
    assert not shape.fills_in_transfer_async and shape.name("chunks") == "chunks"
    assert not releases.CURRENT.device_pointers
