"""vLLM 0.25.1's CPU tier in kvcore's exact mapping, registered as vLLM registers a region,
copied through kvcore's mover both ways on a real GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_pool import register_as_vllm_does
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.plans import plan
from kvcore_vllm.host_region import ExactHostRegion

pytestmark = pytest.mark.gpu

BLOCKS, PAGES = 64, (4096, 18432, 4096)


def test_views_of_the_registered_mapping_are_pinned_and_copy_exactly_both_ways() -> None:
    region = ExactHostRegion(BLOCKS, PAGES)
    register_as_vllm_does(region)
    views = [region.create_next_view(page) for page in PAGES]
    generator = torch.Generator(device="cuda").manual_seed(11)
    mover = Mover()
    blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(5))[:40]
    slots = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(6))[:40]
    for view in views:
        assert view.is_pinned()
        _copies_exactly_both_ways(mover, view, blocks, slots, generator)
    del views
    region.cleanup()
    assert not region.is_pinned and region.memory is None


def test_a_pool_over_several_files_registers_once_and_copies_exactly_both_ways() -> None:
    """SGLang's pool buffers of 2 GiB and more sit on several memfd files side by side
    (kvcore.shared_segments); SGLang registers the whole buffer in one call across them."""
    from kvcore.host_mapping import fault_in
    from kvcore.host_pinning import CudaHostRegistrar
    from kvcore.shared_segments import segmented_shared

    rows, row_bytes = 4096, 4096
    shared = segmented_shared(rows * row_bytes, 5)
    fault_in(shared.address, shared.nbytes)
    host = torch.frombuffer(shared.buffer, dtype=torch.int8, count=shared.nbytes).view(
        rows, row_bytes
    )
    registrar = CudaHostRegistrar()
    registrar.register(shared.address, shared.nbytes)
    try:
        assert host.is_pinned()
        # Rows from every segment, the first of each included.
        picked = torch.randperm(rows, generator=torch.Generator().manual_seed(7))[: rows // 2]
        picked = torch.cat([picked, torch.arange(0, rows, rows // 5)]).unique()
        generator = torch.Generator(device="cuda").manual_seed(12)
        _copies_exactly_both_ways(Mover(), host, picked, picked, generator)
    finally:
        registrar.unregister(shared.address)
    del host


def _copies_exactly_both_ways(
    mover: Mover,
    host: torch.Tensor,
    device_rows: torch.Tensor,
    host_rows: torch.Tensor,
    generator: torch.Generator,
) -> None:
    """Random device rows stored into ``host`` at ``host_rows`` (every other host row
    keeping its bytes), then loaded back into fresh device rows (every other row left
    zero), both through ``mover``."""
    device = torch.randint(
        -128, 128, host.shape, dtype=torch.int8, device="cuda", generator=generator
    )
    expected = host.clone()
    expected[host_rows] = device[device_rows].cpu()
    mover.execute(plan(device, host, device_rows, host_rows, direction=Direction.D2H))
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    back = torch.zeros_like(device)
    mover.execute(plan(host, back, host_rows, device_rows, direction=Direction.H2D))
    torch.cuda.synchronize()
    assert torch.equal(back[device_rows], device[device_rows])
    others = sorted(set(range(host.shape[0])) - set(device_rows.tolist()))
    assert not back[others].any()
