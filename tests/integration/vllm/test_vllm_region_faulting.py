"""kvcore's spec having vLLM's own shared CPU-tier region (0.32 and later) faulted in by
every usable CPU for an engine of one worker, and leaving it to vLLM everywhere else."""

from __future__ import annotations

import dataclasses
import mmap
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import SHARED_REGION_ONLY, shared_region, spec_args

from kvcore.host_mapping import mapping_address
from kvcore.metrics import METRICS
from kvcore_vllm import region_faulting
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec
from tests.support.resident import resident_pages

pytestmark = [pytest.mark.vllm, SHARED_REGION_ONLY]

CHUNK = 4 * mmap.PAGESIZE  # page-aligned, as vLLM requires of a chunk's bytes
CHUNKS = 37


def _resident(region: Any) -> tuple[int, int]:
    """(pages in memory, pages) of a region's mapping."""
    return resident_pages(mapping_address(region.mmap_obj), region.total_size_bytes)


def _stock_create_worker(self: Any, kv_caches: Any) -> Any:
    """What the stock create_worker does with host memory on a GPU: one shared region for
    the worker's slots, built by vLLM's own class."""
    return SimpleNamespace(region=shared_region(CHUNKS, CHUNK))


@pytest.fixture
def faulted(monkeypatch) -> list[int]:
    """The sizes kvcore faulted in during the test (the real faulting runs)."""
    sizes: list[int] = []
    real = region_faulting.fault_region

    def counted(mapping: mmap.mmap, placement: Any) -> None:
        sizes.append(len(mapping))
        real(mapping, placement)

    monkeypatch.setattr(region_faulting, "fault_region", counted)
    return sizes


def _spec(monkeypatch, world_size: int = 1) -> KVCoreCPUOffloadingSpec:
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")  # these workers have no handlers to replace
    monkeypatch.delenv("KVCORE_METRICS", raising=False)
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", _stock_create_worker)
    (config,) = spec_args({"cpu_bytes_to_use": 1 << 20})
    parallel = dataclasses.replace(config.parallel, world_size=world_size)
    return KVCoreCPUOffloadingSpec(dataclasses.replace(config, parallel=parallel))


def test_one_workers_region_is_faulted_in_by_kvcore_then_vllm(monkeypatch, faulted):
    from vllm.v1.kv_offload.cpu import shared_offload_region

    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    stock = shared_offload_region._get_populate_write_fn
    worker = _spec(monkeypatch).create_worker(SimpleNamespace(tensors=[]))
    region = worker.region
    try:
        assert faulted == [CHUNKS * CHUNK]
        resident, pages = _resident(region)
        assert resident == pages == CHUNKS * CHUNK // mmap.PAGESIZE
        assert not region.base_tensor.any()  # read as zeros, as vLLM's own faulting leaves it
        assert shared_offload_region._get_populate_write_fn is stock
    finally:
        region.cleanup()


@pytest.mark.parametrize(("host_pool", "world_size"), [("0", 1), ("1", 2)])
def test_vllm_faults_its_region_itself_where_kvcore_leaves_it(
    monkeypatch, faulted, host_pool, world_size
):
    monkeypatch.setenv("KVCORE_HOST_POOL", host_pool)
    worker = _spec(monkeypatch, world_size).create_worker(SimpleNamespace(tensors=[]))
    try:
        assert faulted == []
        resident, pages = _resident(worker.region)
        assert resident == pages  # vLLM's own faulting, as ever
    finally:
        worker.region.cleanup()


def test_a_failed_faulting_leaves_it_to_vllm_counted(monkeypatch):
    from vllm.v1.kv_offload.cpu import shared_offload_region

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    monkeypatch.setattr(region_faulting, "fault_in", refused)
    stock = shared_offload_region._get_populate_write_fn
    before = METRICS.snapshot()["fallbacks"].get("host_pool_stock:OSError", 0)
    worker = _spec(monkeypatch).create_worker(SimpleNamespace(tensors=[]))
    try:
        assert METRICS.snapshot()["fallbacks"]["host_pool_stock:OSError"] == before + 1
        resident, pages = _resident(worker.region)
        assert resident == pages
        assert shared_offload_region._get_populate_write_fn is stock
    finally:
        worker.region.cleanup()
