"""kvcore's spec building vLLM 0.25.1's worker on kvcore's exact host mapping, and leaving
the host memory of every other release, setting and device stock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import spec_args

from kvcore.config import KVCoreConfig
from kvcore.metrics import METRICS
from kvcore_vllm import spec as kvcore_spec
from kvcore_vllm.host_region import ExactHostRegion
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec

pytestmark = pytest.mark.vllm

PINS_EACH_TENSOR = pytest.mark.skipif(
    not installed_shape().worker_pins_each_tensor,
    reason="this vLLM's spec hands its worker a shared region of its own (0.25.1 does not)",
)


class _CudaLooking(torch.Tensor):
    """A host tensor whose device reads as CUDA, for decisions made on a CPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _kv_caches(pages: list[int], device: str = "cuda") -> Any:
    """What the spec reads of vLLM's canonical KV caches: each tensor and its page bytes."""
    tensors = []
    for page in pages:
        tensor = torch.zeros(4, page, dtype=torch.int8)
        if device == "cuda":
            tensor = tensor.as_subclass(_CudaLooking)
        tensors.append(SimpleNamespace(tensor=tensor, page_size_bytes=page))
    return SimpleNamespace(tensors=tensors)


class _Worker:
    """Takes one view per KV tensor from its region, as 0.25.1's worker does."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        region = kwargs["mmap_region"]
        factor = kwargs["block_size_factor"]
        self.cpu_tensors = [
            region.create_next_view(t.page_size_bytes * factor) for t in kwargs["kv_caches"].tensors
        ]


@pytest.fixture
def spec(monkeypatch) -> KVCoreCPUOffloadingSpec:
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")  # these workers have no handlers to replace
    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    monkeypatch.delenv("KVCORE_METRICS", raising=False)
    stock = SimpleNamespace(stock=True)
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", lambda self, kv_caches: stock)
    return KVCoreCPUOffloadingSpec(*spec_args({"cpu_bytes_to_use": 1 << 20}))


def _fallbacks() -> dict[str, int]:
    return dict(METRICS.snapshot()["fallbacks"])


@PINS_EACH_TENSOR
def test_the_worker_gets_the_exact_mapping_with_the_stock_arguments(spec, monkeypatch):
    monkeypatch.setattr(kvcore_spec, "CPUOffloadingWorker", _Worker)
    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)  # no GPU here to register with
    pages = [1024, 4096, 1024]
    kv_caches = _kv_caches(pages)
    worker = spec.create_worker(kv_caches)
    assert isinstance(worker, _Worker)
    factor, blocks = spec.block_size_factor, spec.num_blocks
    assert worker.kwargs["kv_caches"] is kv_caches
    assert (worker.kwargs["block_size_factor"], worker.kwargs["num_cpu_blocks"]) == (
        factor,
        blocks,
    )
    region = worker.kwargs["mmap_region"]
    assert isinstance(region, ExactHostRegion)
    assert [tuple(t.shape) for t in worker.cpu_tensors] == [(blocks, p * factor) for p in pages]
    assert region.tensor_bytes == blocks * factor * sum(pages)
    assert region.total_size_bytes <= 1.01 * region.tensor_bytes
    region.cleanup()


@PINS_EACH_TENSOR
def test_a_worker_that_fails_on_the_mapping_is_built_stock_and_counted(spec, monkeypatch):
    built: list[ExactHostRegion] = []

    def broken(**kwargs: Any) -> Any:
        built.append(kwargs["mmap_region"])
        raise AssertionError("vLLM refused it")

    monkeypatch.setattr(kvcore_spec, "CPUOffloadingWorker", broken)
    before = _fallbacks().get("host_pool_stock:AssertionError", 0)
    assert spec.create_worker(_kv_caches([2048])) == SimpleNamespace(stock=True)
    assert _fallbacks()["host_pool_stock:AssertionError"] == before + 1
    assert len(built) == 1 and built[0].memory is None  # given back


@PINS_EACH_TENSOR
def test_an_unregistered_mapping_goes_back_to_stock(spec, monkeypatch):
    """Where vLLM pins its tier but could not register kvcore's mapping, kvcore's copies
    must not read it through the GPU's address space: the stock worker is built."""
    monkeypatch.setattr(kvcore_spec, "CPUOffloadingWorker", _Worker)
    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", True)
    before = _fallbacks().get("host_pool_stock:RuntimeError", 0)
    assert spec.create_worker(_kv_caches([2048])) == SimpleNamespace(stock=True)
    assert _fallbacks()["host_pool_stock:RuntimeError"] == before + 1


@pytest.mark.parametrize(
    ("host_pool", "device"), [("0", "cuda"), ("1", "cpu")], ids=["setting-off", "host-device"]
)
def test_host_memory_stays_stock_where_kvcore_leaves_it(spec, monkeypatch, host_pool, device):
    monkeypatch.setenv("KVCORE_HOST_POOL", host_pool)

    def never(**kwargs: Any) -> Any:
        raise AssertionError("kvcore built the worker")

    monkeypatch.setattr(kvcore_spec, "CPUOffloadingWorker", never)
    before = _fallbacks()
    assert spec.create_worker(_kv_caches([2048], device)) == SimpleNamespace(stock=True)
    assert _fallbacks() == before


@pytest.mark.skipif(
    installed_shape().worker_pins_each_tensor, reason="0.25.1's worker takes kvcore's mapping"
)
def test_releases_with_a_shared_region_keep_it(spec, monkeypatch):
    def never(**kwargs: Any) -> Any:
        raise AssertionError("kvcore built the worker")

    monkeypatch.setattr(kvcore_spec, "CPUOffloadingWorker", never)
    assert spec.create_worker(_kv_caches([2048])) == SimpleNamespace(stock=True)


@pytest.mark.parametrize("host_pool", [True, False])
def test_doctor_shows_the_host_pool_setting(host_pool):
    from kvcore_vllm import plugin

    config = KVCoreConfig(enable=frozenset({"vllm"}), host_pool=host_pool)
    assert plugin.check(config).settings["host_pool"] is host_pool
