"""kvcore_sglang.device_reads on a GPU: the read is ordered after what made the indices."""

from __future__ import annotations

import pytest
import torch

from kvcore_sglang.device_reads import DeviceIndexReads

pytestmark = pytest.mark.gpu


def test_a_read_holds_the_values_its_stream_wrote_before_it():
    reads = DeviceIndexReads()
    allocator = torch.cuda.Stream()
    generator = torch.Generator(device="cuda").manual_seed(7)
    with torch.cuda.stream(allocator):
        # The allocator's stream is busy when the indices are made and read: the read must
        # wait for the kernel that writes them, as SGLang's allocator ops come first.
        torch.cuda._sleep(50_000_000)
        device = torch.randperm(1 << 16, device="cuda", generator=generator)[:5000]
        reads.start(device)
    found = reads.recall(device)
    assert found is not None and found.device.type == "cpu" and found.is_pinned()
    torch.cuda.synchronize()
    assert torch.equal(found, device.cpu())


def test_a_write_queued_after_the_read_makes_it_stale():
    reads = DeviceIndexReads()
    device = torch.arange(4096, device="cuda")
    reads.start(device)
    device.add_(1)
    assert reads.recall(device) is None
