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
