from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.bench.stock_allocator import StockSlotAllocator
from kvcore.runs import find_runs


class ListModel:
    """SGLang's host slot list semantics in plain Python lists."""

    def __init__(self, size: int) -> None:
        self.free = list(range(size))
        self.released: list[list[int]] = []

    def available(self) -> int:
        return len(self.free) + sum(map(len, self.released))

    def alloc(self, need: int) -> list[int] | None:
        if need > self.available():
            return None
        if need > len(self.free):
            self.free = self.free + [s for chunk in self.released for s in chunk]
            self.released = []
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def release(self, slots: list[int]) -> None:
        if slots:
            self.released.append(slots)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_matches_the_list_model_slot_for_slot(data: st.DataObject) -> None:
    page_size = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    pages = data.draw(st.integers(1, 32), label="pages")
    size = pages * page_size
    rng = data.draw(st.randoms(use_true_random=False))
    stock = StockSlotAllocator(size, page_size)
    model = ListModel(size)
    live: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        if live and data.draw(st.booleans(), label="free?"):
            slots = live.pop(rng.randrange(len(live)))
            keep = rng.randrange(slots.numel() // page_size + 1) * page_size
            if keep:
                live.append(slots[:keep])
            piece = slots[keep:]
            stock.free(piece)
            model.release(piece.tolist())
        else:
            need = data.draw(st.integers(0, pages + 1), label="need pages") * page_size
            got = stock.alloc(need)
            expected = model.alloc(need)
            assert (got is None) == (expected is None)
            if got is not None:
                assert got.tolist() == expected
                if need:
                    live.append(got)
                    returned.append(got.clone())
        assert stock.available_size() == model.available()
        assert stock.free_slots.tolist() == model.free
        assert [t.tolist() for t in stock.release_slots] == model.released
        allocated = [s for t in live for s in t.tolist()]
        assert sorted(torch.nonzero(stock.slot_used).flatten().tolist()) == sorted(allocated)
    stats = stock.stats
    counts = [find_runs(t).count for t in returned]
    assert stats.allocations == len(returned)
    assert stats.runs_total == sum(counts)
    assert stats.one_run_allocations == counts.count(1)


def test_alloc_returns_a_view_of_the_free_list() -> None:
    stock = StockSlotAllocator(16)
    first = stock.alloc(4)
    assert first is not None and first.tolist() == [0, 1, 2, 3]
    assert first.untyped_storage().data_ptr() == stock.free_slots.untyped_storage().data_ptr()
    assert stock.free_slots.tolist() == list(range(4, 16))


def test_frees_wait_until_the_free_list_runs_short() -> None:
    stock = StockSlotAllocator(10)
    a = stock.alloc(4)
    b = stock.alloc(4)
    assert a is not None and b is not None
    stock.free(b)
    stock.free(a)
    assert stock.free_slots.tolist() == [8, 9]
    assert stock.num_release_slots == 8 and stock.available_size() == 10
    assert stock.alloc(2).tolist() == [8, 9]  # enough left: no merge
    assert len(stock.release_slots) == 2
    assert stock.alloc(5).tolist() == [4, 5, 6, 7, 0]  # merged in free order, unsorted
    assert stock.release_slots == [] and stock.free_slots.tolist() == [1, 2, 3]


def test_a_lone_release_chunk_becomes_the_free_list() -> None:
    stock = StockSlotAllocator(6)
    everything = stock.alloc(6)
    assert everything is not None
    chunk = everything[1:4].flip(0)
    stock.free(chunk)
    assert stock.alloc(1).tolist() == [3]
    assert stock.free_slots.untyped_storage().data_ptr() == chunk.untyped_storage().data_ptr()


def test_failure_exactly_when_short_and_empty_requests() -> None:
    stock = StockSlotAllocator(8, 2)
    assert stock.alloc(10) is None
    got = stock.alloc(0)
    assert got is not None and got.numel() == 0
    assert stock.alloc(8) is not None
    assert stock.alloc(2) is None
    stock.free(torch.empty(0, dtype=torch.int64))
    assert stock.release_slots == [] and stock.available_size() == 0
    assert stock.stats.allocations == 1


def test_sglang_assertions() -> None:
    stock = StockSlotAllocator(8, 4)
    with pytest.raises(AssertionError, match="multiple of the page size"):
        stock.alloc(2)
    slots = stock.alloc(4)
    assert slots is not None
    stock.free(slots)
    with pytest.raises(AssertionError, match=r"Double-free detected: .*\[0, 1, 2, 3\]"):
        stock.free(slots)
    with pytest.raises(AssertionError, match=r"Double-free detected: .*\[6\]"):
        stock.free(torch.tensor([6]))
    with pytest.raises(IndexError):
        stock.free(torch.tensor([8]))
    with pytest.raises(ValueError, match="multiple of page_size"):
        StockSlotAllocator(10, 4)


def test_like_sglang_no_range_page_or_duplicate_checks_on_free() -> None:
    stock = StockSlotAllocator(8, 4)
    assert stock.alloc(8) is not None
    stock.free(torch.tensor([-1]))  # wraps to slot 7
    stock.free(torch.tensor([1, 1]))  # counted twice
    stock.free(torch.tensor([2]))  # part of a page
    assert stock.available_size() == 4
    assert not bool(stock.slot_used[[1, 2, 7]].any())


def test_stats_on_a_hand_made_sequence() -> None:
    stock = StockSlotAllocator(8)
    a = stock.alloc(4)
    assert a is not None and stock.alloc(2) is not None
    stock.free(a)
    assert stock.alloc(4).tolist() == [6, 7, 0, 1]
    stats = stock.stats
    assert (stats.allocations, stats.one_run_allocations, stats.runs_total) == (3, 2, 4)
    assert stats.one_run_fraction == pytest.approx(2 / 3)
    assert stats.runs_per_allocation == pytest.approx(4 / 3)
    assert stats.free_runs == 1  # slots 2 and 3


def test_stats_stay_exact_past_the_counting_batch() -> None:
    stock = StockSlotAllocator(64)
    rng = random.Random(5)
    live: list[torch.Tensor] = []
    expected_runs: list[int] = []
    for _ in range(12_000):
        if live and (rng.random() < 0.5 or stock.available_size() < 8):
            stock.free(live.pop(rng.randrange(len(live))))
        else:
            slots = stock.alloc(rng.randint(1, 8))
            assert slots is not None
            expected_runs.append(find_runs(slots).count)
            live.append(slots)
    stats = stock.stats
    assert stats.allocations == len(expected_runs) > 4096
    assert stats.runs_total == sum(expected_runs)
    assert stats.one_run_allocations == expected_runs.count(1)
    assert 0.0 < stats.one_run_fraction < 1.0


def test_clear_restores_the_initial_order() -> None:
    stock = StockSlotAllocator(6)
    slots = stock.alloc(3)
    assert slots is not None
    stock.free(slots)
    stock.clear()
    assert stock.free_slots.tolist() == list(range(6))
    assert stock.release_slots == [] and stock.num_release_slots == 0
    assert not bool(stock.slot_used.any())
    assert stock.stats.allocations == 0
    assert stock.alloc(6).tolist() == list(range(6))
