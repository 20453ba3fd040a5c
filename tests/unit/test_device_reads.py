"""kvcore_sglang.device_reads: device indices read back at their move, kept by identity."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import SimpleNamespace

import torch

from kvcore_sglang.device_reads import DeviceIndexReads, worth_reading


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


def test_only_the_kernel_backends_paged_layer_first_device_tensors_are_worth_reading():
    def controller(
        io_backend: str = "kernel", page_size: int = 64, layout: str = "layer_first"
    ) -> SimpleNamespace:
        pool = SimpleNamespace(page_size=page_size, layout=layout)
        return SimpleNamespace(io_backend=io_backend, mem_pool_host=pool)

    on_device = torch.arange(64).to("meta")
    assert worth_reading(on_device, controller())
    assert worth_reading(on_device, controller(page_size=2))
    assert not worth_reading(on_device, controller(page_size=1))
    assert not worth_reading(on_device, controller("direct"))
    assert not worth_reading(on_device, controller(layout="page_first"))
    assert not worth_reading(torch.arange(64), controller())
    assert not worth_reading(on_device.reshape(8, 8), controller())
    assert not worth_reading([1, 2, 3], controller())
    assert not worth_reading(on_device, SimpleNamespace())
