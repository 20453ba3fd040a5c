"""ContiguousSlotAllocator's ready size: slots above it are never handed out until it grows."""

from __future__ import annotations

import random

import pytest
import torch

from kvcore.allocator import ContiguousSlotAllocator


def test_only_ready_slots_are_handed_out_until_the_size_grows() -> None:
    allocator = ContiguousSlotAllocator(64, 4, ready=16)
    assert allocator.available_size() == 16
    assert allocator.ready_size == 16
    taken = allocator.alloc(16)
    assert taken is not None and sorted(taken.tolist()) == list(range(16))
    assert allocator.alloc(4) is None
    allocator.grow_ready(40)
    assert allocator.available_size() == 24
    more = allocator.alloc(24)
    assert more is not None and sorted(more.tolist()) == list(range(16, 40))
    assert allocator.alloc(4) is None


def test_a_grown_range_joins_the_free_run_below_it() -> None:
    allocator = ContiguousSlotAllocator(32, 1, ready=8)
    allocator.grow_ready(32)
    assert allocator.free_runs_snapshot() == [(0, 32)]
    assert allocator.alloc_run(32) == 0


def test_a_smaller_ready_size_changes_nothing() -> None:
    allocator = ContiguousSlotAllocator(32, 1, ready=16)
    allocator.grow_ready(8)
    assert allocator.ready_size == 16
    assert allocator.available_size() == 16


def test_clear_keeps_the_ready_size() -> None:
    allocator = ContiguousSlotAllocator(32, 2, ready=8)
    allocator.grow_ready(20)
    assert allocator.alloc(20) is not None
    allocator.clear()
    assert allocator.available_size() == 20
    assert allocator.free_runs_snapshot() == [(0, 20)]


def test_slots_above_the_ready_size_are_not_allocated_for_free() -> None:
    allocator = ContiguousSlotAllocator(32, 1, ready=8)
    with pytest.raises(ValueError, match="slot 20 is not allocated"):
        allocator.free(torch.tensor([20]))
    assert allocator.available_size() == 8


@pytest.mark.parametrize("ready", [-1, 33, 3])
def test_a_ready_size_that_is_not_whole_pages_in_the_pool_is_refused(ready: int) -> None:
    with pytest.raises(ValueError, match=f"ready size {ready} is not whole pages of 2"):
        ContiguousSlotAllocator(32, 2, ready=ready)
    allocator = ContiguousSlotAllocator(32, 2, ready=0)
    with pytest.raises(ValueError, match="not whole pages"):
        allocator.grow_ready(ready)
    assert allocator.available_size() == 0


def test_growing_under_churn_hands_out_each_ready_slot_once() -> None:
    rng = random.Random(7)
    size, page = 256, 4
    allocator = ContiguousSlotAllocator(size, page, ready=0)
    held: list[torch.Tensor] = []
    for ready in range(0, size + 1, 32):
        allocator.grow_ready(ready)
        for _ in range(20):
            if held and rng.random() < 0.4:
                allocator.free(held.pop(rng.randrange(len(held))))
                continue
            slots = allocator.alloc(page * rng.randint(1, 4))
            if slots is not None:
                held.append(slots)
        every = torch.cat(held).tolist() if held else []
        assert len(every) == len(set(every))
        assert all(0 <= slot < ready for slot in every)
        assert allocator.available_size() == ready - len(every)
