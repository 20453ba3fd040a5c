"""kvcore.kernels.cudart on a machine without a CUDA runtime, and with a stand-in for one."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvcore.kernels import cuda, cudart
from kvcore.layers import layer_pairs


def test_without_a_loaded_runtime_there_is_no_device_address(monkeypatch):
    monkeypatch.setattr(cudart, "loaded_cudart", lambda: None)
    cudart._pointer_attributes.cache_clear()
    try:
        assert cudart.device_address(4096) is None
    finally:
        cudart._pointer_attributes.cache_clear()


class FakeRuntime:
    """cudaPointerGetAttributes over a table of mapped ranges; counts cudaGetLastError."""

    def __init__(self, mapped: dict[int, int]) -> None:
        self.mapped = mapped
        self.errors_taken = 0

    def get_attributes(self, attributes, pointer: int) -> int:
        if pointer == 0:
            return 1  # cudaErrorInvalidValue
        target = ctypes.cast(attributes, ctypes.POINTER(cudart._PointerAttributes)).contents
        target.device_pointer = self.mapped.get(pointer)
        return 0

    def cudaGetLastError(self) -> int:
        self.errors_taken += 1
        return 0


@pytest.fixture
def fake_runtime(monkeypatch):
    runtime = FakeRuntime({4096: 1 << 40})
    monkeypatch.setattr(cudart, "_pointer_attributes", lambda: runtime.get_attributes)
    monkeypatch.setattr(cudart, "loaded_cudart", lambda: runtime)
    return runtime


def test_device_address_is_the_runtimes_mapping(fake_runtime):
    assert cudart.device_address(4096) == 1 << 40
    # Known to the runtime but not mapped (pageable): no address for the GPU.
    assert cudart.device_address(8192) is None
    assert fake_runtime.errors_taken == 0


def test_a_refused_query_is_taken_back_from_the_runtime(fake_runtime):
    assert cudart.device_address(0) is None
    assert fake_runtime.errors_taken == 1


def test_layers_whose_host_memory_the_gpu_cannot_reach_are_gathered_one_by_one(monkeypatch):
    monkeypatch.setattr(cuda, "triton_available", lambda: True)
    monkeypatch.setattr(cuda, "_host_pinned", lambda pairs: True)
    monkeypatch.setattr(cuda, "device_address", lambda pointer: None)
    host = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    device = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    ops = cuda._CudaIndexedOps(gather_ctas=4)
    assert ops._table(layer_pairs(host, device)) == "gather_layers_unavailable:host_pointer"
