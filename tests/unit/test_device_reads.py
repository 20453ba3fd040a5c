"""kvcore_sglang.device_reads: device indices read back at their move, kept by identity."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import SimpleNamespace

import torch

from kvcore_sglang.device_reads import (
    DMA_BELOW_TOKENS,
    DeviceIndexReads,
    pages_by_dma,
    worth_reading,
)


class StandInReader:
    """A read that copies on the CPU and counts the reads started and the waits."""

    def __init__(self) -> None:
        self.started = 0
        self.waits = 0

    def __call__(self, device_indices: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        self.started += 1
        return device_indices.clone(), self._wait

    def _wait(self) -> None:
        self.waits += 1


def test_a_read_is_recalled_for_its_own_tensor_after_its_wait():
    reader = StandInReader()
    reads = DeviceIndexReads(reader)
    device = torch.randperm(4096)[:300]
    reads.start(device)
    assert reader.started == 1 and reader.waits == 0
    other = device.clone()
    assert reads.recall(other) is None, "a tensor of equal values is not the one read"
    found = reads.recall(device)
    assert found is not None and found is not device and torch.equal(found, device)
    assert reader.waits == 1


def test_a_write_after_the_read_makes_it_stale():
    reads = DeviceIndexReads(StandInReader())
    device = torch.randperm(4096)[:64]
    reads.start(device)
    device[0] = 4095
    assert reads.recall(device) is None


def test_an_inference_tensor_is_not_read():
    reader = StandInReader()
    reads = DeviceIndexReads(reader)
    with torch.inference_mode():
        device = torch.arange(64)
    reads.start(device)
    assert reader.started == 0 and len(reads) == 0 and reads.recall(device) is None


def test_a_read_goes_with_its_tensor():
    reads = DeviceIndexReads(StandInReader())
    device = torch.arange(64)
    reads.start(device)
    assert len(reads) == 1
    del device
    gc.collect()
    assert len(reads) == 0


def _controller(
    io_backend: str = "kernel", page_size: int = 64, layout: str = "layer_first", heads: int = 8
) -> SimpleNamespace:
    """A controller over a host pool whose buffer has rows of ``heads`` x 128 bf16 values
    (2 KiB a token at 8 heads), as SGLang's MHA pool lays them out."""
    buffer = torch.empty((2, 1, 4 * page_size, heads, 128), dtype=torch.bfloat16, device="meta")
    pool = SimpleNamespace(page_size=page_size, layout=layout, kv_buffer=buffer)
    return SimpleNamespace(io_backend=io_backend, mem_pool_host=pool)


def test_only_the_kernel_backends_layer_first_pages_long_enough_are_worth_reading():
    on_device = torch.arange(64).to("meta")
    page = 128 << 10
    assert worth_reading(on_device, _controller(), page)
    assert worth_reading(on_device, _controller(page_size=16, heads=32), page)
    assert not worth_reading(on_device, _controller(page_size=32), page)
    assert not worth_reading(on_device, _controller(page_size=16), page)
    assert worth_reading(on_device, _controller(page_size=16), 32 << 10)
    assert not worth_reading(on_device, _controller(page_size=1), 1)
    assert not worth_reading(on_device, _controller("direct"), page)
    assert not worth_reading(on_device, _controller(layout="page_first"), page)
    assert not worth_reading(torch.arange(64), _controller(), page)
    assert not worth_reading(on_device.reshape(8, 8), _controller(), page)
    assert not worth_reading([1, 2, 3], _controller(), page)
    assert not worth_reading(on_device, SimpleNamespace(), page)
    unbuilt = _controller()
    unbuilt.mem_pool_host.kv_buffer = None
    assert not worth_reading(on_device, unbuilt, page)


def test_requests_from_the_rings_size_on_are_not_read_for():
    below = torch.empty(DMA_BELOW_TOKENS - 1, dtype=torch.int64, device="meta")
    at = torch.empty(DMA_BELOW_TOKENS, dtype=torch.int64, device="meta")
    assert worth_reading(below, _controller(), 128 << 10)
    assert not worth_reading(at, _controller(), 128 << 10)


def test_pages_by_dma_asks_the_page_of_one_layer_in_bytes():
    pool = _controller().mem_pool_host
    assert pages_by_dma(pool, "kernel", 128 << 10)
    assert not pages_by_dma(pool, "kernel", (128 << 10) + 1)
    assert not pages_by_dma(pool, "direct", 1)
