"""NUMA placement of pinned host memory on a real GPU host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvcore import numa
from kvcore.bench.host_buffers import RegisteredBuffer, allocate_host_buffer
from kvcore.host_pinning import CudaHostRegistrar

pytestmark = pytest.mark.gpu

NBYTES = 64 << 20


def round_trip_is_exact(host: torch.Tensor) -> bool:
    """Random bytes host -> GPU -> host through the pinned buffer, compared with the source."""
    data = torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, device="cuda")
    host.copy_(data, non_blocking=True)
    torch.cuda.synchronize()
    back = torch.empty_like(data)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return bool(torch.equal(back, data)) and bool(torch.equal(host, data.cpu()))


def test_bus_id_names_the_gpu_in_sysfs() -> None:
    bus_id = numa.cuda_pci_bus_id(0)
    assert bus_id is not None
    device = Path("/sys/bus/pci/devices") / bus_id
    assert (device / "vendor").read_text().strip() == "0x10de"  # NVIDIA
    node = numa.cuda_numa_node(0)
    assert node is None or node in numa.online_nodes()


def test_policy_set_before_first_touch_places_registered_memory_on_the_node() -> None:
    """mbind, pre-fault and cudaHostRegister for real, even on a one-node host (node 0)."""
    cpus = tuple(sorted(os.sched_getaffinity(0) & set(numa.node_cpus(0))))
    buffer = RegisteredBuffer(
        NBYTES,
        CudaHostRegistrar(),
        prefault_threads=4,
        register_chunk_bytes=NBYTES,  # one registration: one DMA may cover it all
        placement=numa.Placement(0, cpus),
    )
    try:
        address = buffer.tensor.data_ptr()
        assert buffer.numa_node == 0
        pages = numa.pages_by_node(address, NBYTES)
        assert pages.get(0, 0) >= NBYTES // 4096 * 0.99, pages
        assert round_trip_is_exact(buffer.tensor)
    finally:
        buffer.close()


def test_auto_places_pinned_memory_on_the_gpu_node() -> None:
    node = numa.resolve_node("auto", 0)
    buffer = allocate_host_buffer(NBYTES, pin=True, numa_node=node)
    try:
        if numa.node_count() == 1 or node is None:
            assert buffer.numa_node is None
        else:
            assert buffer.numa_node == node
            pages = numa.pages_by_node(buffer.tensor.data_ptr(), NBYTES)
            assert pages.get(node, 0) >= 0.99 * sum(pages.values()), pages
        assert round_trip_is_exact(buffer.tensor)
    finally:
        buffer.close()


@pytest.mark.skipif(numa.node_count() < 2, reason="needs a host with several NUMA nodes")
def test_every_node_with_memory_can_hold_a_pinned_buffer() -> None:
    with_memory = numa.parse_cpulist(Path("/sys/devices/system/node/has_memory").read_text())
    for node in with_memory:
        buffer = allocate_host_buffer(NBYTES, pin=True, numa_node=node)
        try:
            pages = numa.pages_by_node(buffer.tensor.data_ptr(), NBYTES)
            assert pages.get(node, 0) >= 0.99 * sum(pages.values()), (node, pages)
            assert round_trip_is_exact(buffer.tensor)
        finally:
            buffer.close()
