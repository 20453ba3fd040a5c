from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcore.free_list import FreeSlotList


def assert_lists(free_list: FreeSlotList, free_pages: set[int]) -> None:
    """The view holds exactly the slots of ``free_pages``, each page whole and ascending."""
    ps = free_list.page_size
    slots = free_list.slots
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert len(free_list) == len(slots) == len(free_pages) * ps
    rows = slots.reshape(-1, ps)
    assert torch.equal(rows - rows[:, :1], torch.arange(ps).expand_as(rows))
    assert bool((rows[:, 0] % ps == 0).all())
    assert set((rows[:, 0] // ps).tolist()) == free_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_takes_and_give_backs_keep_the_free_set(page_size: int) -> None:
    pages = 97
    free_list = FreeSlotList(pages * page_size, page_size)
    free = set(range(pages))
    rng = np.random.default_rng(11)
    assert_lists(free_list, free)
    for _ in range(400):
        used = sorted(set(range(pages)) - free)
        if free and (not used or rng.random() < 0.55):
            batch = rng.choice(sorted(free), rng.integers(1, len(free) + 1), replace=False)
            free_list.take(batch)
            free -= set(batch.tolist())
        else:
            batch = rng.choice(used, rng.integers(1, len(used) + 1), replace=False)
            free_list.give_back(batch)
            free |= set(batch.tolist())
        assert_lists(free_list, free)
    free_list.give_back(np.array(sorted(set(range(pages)) - free), dtype=np.int64))
    assert_lists(free_list, set(range(pages)))


@pytest.mark.parametrize(
    ("call", "pages", "match"),
    [
        ("take", [2, 5], "pages to take is free"),
        ("take", [9], "pages to take is free"),
        ("give_back", [0, 1], "pages to give back is allocated"),
        ("give_back", [4, 12], r"page ids must lie in \[0, 12\)"),
        ("take", [-1], r"page ids must lie in \[0, 12\)"),
    ],
)
def test_refusals_change_nothing(call: str, pages: list[int], match: str) -> None:
    free_list = FreeSlotList(12 * 2, 2)
    free_list.take(np.array([5, 9, 4], dtype=np.int64))
    before = free_list.slots.clone()
    with pytest.raises(ValueError, match=match):
        getattr(free_list, call)(np.array(pages, dtype=np.int64))
    assert torch.equal(free_list.slots, before)


def test_taking_more_pages_than_are_free_is_refused() -> None:
    free_list = FreeSlotList(3)
    free_list.take(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="pages to take is free"):
        free_list.take(np.array([0, 1], dtype=np.int64))
    assert free_list.slots.tolist() == [0]


def test_rejects_a_size_that_is_not_whole_pages() -> None:
    with pytest.raises(ValueError, match="not a non-negative multiple"):
        FreeSlotList(10, 4)
