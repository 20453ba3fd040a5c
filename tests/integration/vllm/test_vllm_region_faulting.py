"""kvcore's spec having vLLM's own shared CPU-tier region (0.32 and later) faulted in by
every usable CPU for an engine of one worker, each worker's part by its share of them for
an engine of several, and leaving it to vLLM under ``KVCORE_HOST_POOL=0``."""

from __future__ import annotations

import dataclasses
import mmap
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import SHARED_REGION_ONLY, second_workers_region, shared_region, spec_args

from kvcore.host_mapping import mapping_address
from kvcore.host_pinning import usable_cpus
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


@pytest.mark.parametrize("world_size", [1, 2])
def test_vllm_faults_its_region_itself_where_kvcore_leaves_it(monkeypatch, faulted, world_size):
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")
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


SLOT = 4 * mmap.PAGESIZE  # a worker's slot of each row: the row holds two workers' slots


def _second_worker_create(self: Any, kv_caches: Any) -> Any:
    """The stock create_worker of the second of two workers: the region built by vLLM's own
    class, which faults in that worker's slot of each row."""
    return SimpleNamespace(region=second_workers_region(CHUNKS, SLOT))


@pytest.mark.parametrize("fails", [False, True])
def test_each_worker_of_several_faults_its_own_slots_by_its_share_of_the_cpus(monkeypatch, fails):
    from vllm.v1.kv_offload.cpu import shared_offload_region

    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    spec = _spec(monkeypatch, world_size=2)
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", _second_worker_create)
    kvcore_calls: list[tuple[int, int, int]] = []
    real = region_faulting.fault_in

    def recorded(address: int, nbytes: int, **kwargs: Any) -> Any:
        if fails:
            raise OSError(12, "Cannot allocate memory")
        kvcore_calls.append((address, nbytes, kwargs["threads"]))
        return real(address, nbytes, **kwargs)

    vllm_calls: list[tuple[int, int]] = []
    stock = shared_offload_region._get_populate_write_fn

    def stock_recorded(mapping: mmap.mmap) -> Any:
        own = stock(mapping)

        def populate(target: mmap.mmap, offset: int, length: int) -> None:
            vllm_calls.append((offset, length))
            own(target, offset, length)

        return populate

    monkeypatch.setattr(region_faulting, "fault_in", recorded)
    monkeypatch.setattr(shared_offload_region, "_get_populate_write_fn", stock_recorded)
    before = METRICS.snapshot()["fallbacks"].get("host_pool_stock:OSError", 0)
    worker = spec.create_worker(SimpleNamespace(tensors=[]))
    region = worker.region
    try:
        slots = list(region.iter_worker_slot_ranges())
        assert len(slots) == CHUNKS
        if fails:
            # Counted once; vLLM's own faulting did every range, the first included.
            assert METRICS.snapshot()["fallbacks"]["host_pool_stock:OSError"] == before + 1
            assert vllm_calls == slots and kvcore_calls == []
        else:
            base = mapping_address(region.mmap_obj)
            threads = max(1, usable_cpus() // 2)
            assert kvcore_calls == [(base + o, n, threads) for o, n in slots]
            assert vllm_calls == []
        # The second worker's slots are in memory, the first worker's are not (but the
        # mapping's first page, which vLLM's set-up faults in to try MADV_POPULATE_WRITE).
        base = mapping_address(region.mmap_obj)
        for offset, nbytes in slots:
            assert resident_pages(base + offset, nbytes) == (nbytes // mmap.PAGESIZE,) * 2
        resident, _ = _resident(region)
        assert resident <= CHUNKS * SLOT // mmap.PAGESIZE + 1
        assert shared_offload_region._get_populate_write_fn is stock_recorded
    finally:
        region.cleanup()
