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
        device = torch.randint(
            -128, 128, view.shape, dtype=torch.int8, device="cuda", generator=generator
        )
        untouched = view.clone()
        mover.execute(plan(device, view, blocks, slots, direction=Direction.D2H))
        torch.cuda.synchronize()
        expected = untouched.clone()
        expected[slots] = device[blocks].cpu()
        assert torch.equal(view, expected)
        back = torch.zeros_like(device)
        mover.execute(plan(view, back, slots, blocks, direction=Direction.H2D))
        torch.cuda.synchronize()
        assert torch.equal(back[blocks], device[blocks])
        assert not back[[b for b in range(BLOCKS) if b not in set(blocks.tolist())]].any()
    del views
    region.cleanup()
    assert not region.is_pinned and region.mmap_obj is None


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
        generator = torch.Generator(device="cuda").manual_seed(12)
        device = torch.randint(
            -128, 128, host.shape, dtype=torch.int8, device="cuda", generator=generator
        )
        # Rows from every segment, the last and the first of each included.
        picked = torch.randperm(rows, generator=torch.Generator().manual_seed(7))[: rows // 2]
        picked = torch.cat([picked, torch.arange(0, rows, rows // 5)]).unique()
        untouched = host.clone()
        mover = Mover()
        mover.execute(plan(device, host, picked, picked, direction=Direction.D2H))
        torch.cuda.synchronize()
        expected = untouched.clone()
        expected[picked] = device[picked].cpu()
        assert torch.equal(host, expected)
        back = torch.zeros_like(device)
        mover.execute(plan(host, back, picked, picked, direction=Direction.H2D))
        torch.cuda.synchronize()
        assert torch.equal(back[picked], device[picked])
    finally:
        registrar.unregister(shared.address)
    del host
