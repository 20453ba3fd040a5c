"""``kvcore bench --host-pool``'s vLLM shared-region rows on the CPU: vLLM's own region with
and without kvcore's faulting, nothing pinned."""

from __future__ import annotations

import mmap

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")
pytestmark = pytest.mark.vllm

from benchmarks import host_pool  # noqa: E402
from benchmarks.vllm import shared_region_build  # noqa: E402
from kvcore_vllm.releases import installed_shape  # noqa: E402


def test_both_sides_build_the_region_exactly_resident_and_readable():
    row = host_pool.measure(0.04, False, host_pool.REGION_ENGINE)
    if installed_shape().worker_pins_each_tensor:
        assert row["skipped"] == "ModuleNotFoundError: vLLM before 0.32 maps no shared region"
        return
    assert "skipped" not in row, row
    chunks, chunk_bytes = shared_region_build.region_shape(0.04)
    region_gib = chunks * chunk_bytes / (1 << 30)
    assert row["tensor_bytes_gib"] == region_gib
    for side in host_pool.SIDES:
        assert f"{side}_error" not in row, row
        # vLLM's mapping is the region's exact bytes on both sides, all faulted in.
        assert row[f"{side}_tier_gib"] == region_gib
        assert row[f"{side}_rss_gib"] >= 0.9 * region_gib
        assert row[f"{side}_identical"]
    assert "in one shared region" in host_pool.format_row(row)


def test_region_shape_fills_the_size_with_whole_page_aligned_chunks():
    chunks, chunk_bytes = shared_region_build.region_shape(16)
    assert chunk_bytes == host_pool.LAYERS * host_pool.BLOCK_BYTES * 16
    assert chunk_bytes % mmap.PAGESIZE == 0
    assert chunks * chunk_bytes == 16 << 30
    chunks, _ = shared_region_build.region_shape(1.01)
    assert chunks * chunk_bytes <= 1.01 * (1 << 30) < (chunks + 1) * chunk_bytes
    assert shared_region_build.region_shape(0.001)[0] == 1


def test_the_pin_first_rows_read_back_inside_the_first_step():
    import torch

    chunk = shared_region_build.CHUNK_BYTES
    first_step = shared_region_build.PIN_FIRST_BYTES // chunk
    for chunks, expected in ((100, 3), (96 * 32, first_step), (1, 1)):
        base = torch.empty(chunks * chunk, dtype=torch.int8, device="meta")
        assert shared_region_build.first_step_chunks(base).numel() == expected * chunk


def test_the_pin_first_rows_run_as_the_region_rows_where_nothing_pins():
    row = host_pool.measure(0.04, False, host_pool.REGION_PIN_FIRST)
    if installed_shape().worker_pins_each_tensor:
        assert row["skipped"].startswith("ModuleNotFoundError")
        return
    assert all(row[f"{side}_identical"] for side in host_pool.SIDES), row
