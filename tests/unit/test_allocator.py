from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.allocator import ContiguousSlotAllocator, DoubleAllocationError, expand_runs
from kvcore.bench.churn import make_trace, replay
from kvcore.bench.stock_allocator import StockSlotAllocator
from kvcore.metrics import METRICS, Metrics
from kvcore.runs import find_runs


def runs_of(slots: set[int] | list[int]) -> list[tuple[int, int]]:
    """Maximal runs of a set of ints, sorted by start (plain reference)."""
    out: list[tuple[int, int]] = []
    for s in sorted(slots):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def with_holes(
    size: int, holes: list[tuple[int, int]], page_size: int = 1
) -> ContiguousSlotAllocator:
    """An allocator with everything allocated except ``holes`` (slot runs)."""
    allocator = ContiguousSlotAllocator(size, page_size)
    assert allocator.alloc_runs(size) == [(0, size)]
    allocator.free_runs(holes)
    assert allocator.free_runs_snapshot() == sorted(holes)
    return allocator


def state(allocator: ContiguousSlotAllocator) -> tuple[object, ...]:
    return (
        allocator.available_size(),
        allocator.free_runs_snapshot(),
        allocator.page_used.clone(),
        allocator.stats,
    )


def assert_same_state(before: tuple[object, ...], after: tuple[object, ...]) -> None:
    assert before[0] == after[0]
    assert before[1] == after[1]
    assert torch.equal(before[2], after[2])  # type: ignore[arg-type]
    assert before[3] == after[3]


# --- random operation sequences against a set model and the stock allocator ---------------


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_ops_match_set_model_and_stock(data: st.DataObject) -> None:
    page_size = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    pages = data.draw(st.integers(1, 40), label="pages")
    size = pages * page_size
    rng = data.draw(st.randoms(use_true_random=False))
    ours = ContiguousSlotAllocator(size, page_size)
    stock = StockSlotAllocator(size, page_size)
    free: set[int] = set(range(size))
    # key -> (our slots, stock slots), both viewed as (pages, page_size)
    live: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    next_key = 0
    for _ in range(data.draw(st.integers(1, 50), label="steps")):
        if live and data.draw(st.booleans(), label="free?"):
            key = data.draw(st.sampled_from(sorted(live)), label="key")
            mine, theirs = live.pop(key)
            n_pages = mine.numel() // page_size
            how = data.draw(st.sampled_from(["all", "head", "tail", "subset"]), label="how")
            cut = data.draw(st.integers(0, n_pages), label="cut")
            if how == "all":
                chosen = list(range(n_pages))
            elif how == "head":
                chosen = list(range(cut))
            elif how == "tail":
                chosen = list(range(cut, n_pages))
            else:
                chosen = sorted(rng.sample(range(n_pages), cut))
            kept = [p for p in range(n_pages) if p not in chosen]
            picked = torch.tensor(chosen, dtype=torch.int64)
            piece = mine.view(-1, page_size)[picked].flatten()
            shuffled = piece[
                torch.randperm(piece.numel(), generator=torch.Generator().manual_seed(cut))
            ]
            ours.free(shuffled)
            stock.free(theirs.view(-1, page_size)[picked].flatten())
            free |= set(piece.tolist())
            if kept:
                rest = torch.tensor(kept, dtype=torch.int64)
                live[key] = (
                    mine.view(-1, page_size)[rest].flatten(),
                    theirs.view(-1, page_size)[rest].flatten(),
                )
        else:
            need = data.draw(st.integers(0, pages + 2), label="need pages") * page_size
            mine = ours.alloc(need)
            theirs = stock.alloc(need)
            assert (mine is None) == (need > len(free))
            assert (theirs is None) == (mine is None)
            if mine is not None and theirs is not None:
                assert mine.dtype == torch.int64 and mine.device.type == "cpu" and mine.dim() == 1
                assert mine.numel() == need
                got = mine.tolist()
                assert len(set(got)) == need
                assert set(got) <= free, "handed out a slot that is not free"
                if page_size > 1:
                    rows = mine.view(-1, page_size)
                    assert bool((rows[:, 0] % page_size == 0).all())
                    assert torch.equal(rows - rows[:, :1], torch.arange(page_size).expand_as(rows))
                free -= set(got)
                if need:
                    live[next_key] = (mine, theirs)
                    next_key += 1
        assert ours.available_size() == len(free)
        assert stock.available_size() == len(free)
        assert ours.free_runs_snapshot() == runs_of(free)
        assert ours.stats.free_runs == len(runs_of(free))
        expected_used = torch.ones(pages, dtype=torch.bool)
        for slot in free:
            expected_used[slot // page_size] = False
        assert torch.equal(ours.page_used, expected_used)


# --- best fit on hand-made layouts ---------------------------------------------------------


def test_best_fit_takes_the_smallest_run_that_fits_from_its_start() -> None:
    allocator = with_holes(100, [(0, 10), (20, 5), (40, 7), (60, 20)])
    assert allocator.alloc(6).tolist() == list(range(40, 46))
    assert allocator.free_runs_snapshot() == [(0, 10), (20, 5), (46, 1), (60, 20)]
    assert allocator.alloc(5).tolist() == list(range(20, 25))  # exact fit beats larger runs
    assert allocator.alloc(1).tolist() == [46]
    assert allocator.free_runs_snapshot() == [(0, 10), (60, 20)]


def test_equal_runs_are_taken_lowest_start_first() -> None:
    allocator = with_holes(64, [(50, 4), (10, 4), (30, 4)])
    assert allocator.alloc(4).tolist() == [10, 11, 12, 13]
    assert allocator.alloc(3).tolist() == [30, 31, 32]
    assert allocator.alloc(2).tolist() == [50, 51]


def test_no_single_fit_takes_largest_runs_then_best_fit_remainder() -> None:
    allocator = with_holes(200, [(0, 10), (20, 3), (40, 30), (100, 25), (150, 12)])
    slots = allocator.alloc(60)
    assert slots is not None
    # 30 + 25 whole, then the remaining 5 from the smallest run that holds 5 (the 10 at 0).
    assert find_runs(slots).as_list() == [(40, 30), (100, 25), (0, 5)]
    assert allocator.free_runs_snapshot() == [(5, 5), (20, 3), (150, 12)]
    # The set-up allocation of everything was one run; this one took three.
    assert allocator.stats.runs_total == 1 + 3 and allocator.stats.one_run_allocations == 1


def test_gathering_fails_only_when_total_free_is_short() -> None:
    allocator = with_holes(40, [(1, 1), (5, 2), (10, 3), (20, 4)])
    assert allocator.alloc(11) is None
    assert allocator.alloc_runs(11) is None
    assert allocator.available_size() == 10
    slots = allocator.alloc(10)
    assert slots is not None and sorted(slots.tolist()) == [1, 5, 6, 10, 11, 12, 20, 21, 22, 23]
    assert allocator.available_size() == 0
    assert allocator.alloc(1) is None
    assert allocator.alloc(0) is not None and allocator.alloc(0).numel() == 0


def test_best_fit_in_pages() -> None:
    allocator = with_holes(64, [(0, 8), (16, 12), (40, 16)], page_size=4)
    assert allocator.alloc(12).tolist() == list(range(16, 28))
    assert allocator.alloc_runs(20) == [(40, 16), (0, 4)]
    assert allocator.free_runs_snapshot() == [(4, 4)]


def test_alloc_run_never_splits() -> None:
    allocator = with_holes(64, [(0, 6), (10, 6), (30, 9)])
    assert allocator.alloc_run(10) is None
    assert allocator.available_size() == 21
    assert allocator.alloc_run(7) == 30
    assert allocator.alloc_run(6) == 0
    assert allocator.free_runs_snapshot() == [(10, 6), (37, 2)]
    with pytest.raises(ValueError, match="positive"):
        allocator.alloc_run(0)


def test_free_merges_with_both_neighbours() -> None:
    allocator = ContiguousSlotAllocator(30)
    a, b, c = allocator.alloc(10), allocator.alloc(10), allocator.alloc(10)
    assert a is not None and b is not None and c is not None
    allocator.free(a)
    allocator.free(c)
    assert allocator.free_runs_snapshot() == [(0, 10), (20, 10)]
    allocator.free(b)
    assert allocator.free_runs_snapshot() == [(0, 30)]
    assert allocator.alloc(30).tolist() == list(range(30))


def test_alloc_runs_and_free_runs_round_trip() -> None:
    allocator = with_holes(32, [(2, 4), (10, 8)], page_size=2)
    runs = allocator.alloc_runs(12)
    assert runs == [(10, 8), (2, 4)]
    allocator.free_runs([(2, 2), (4, 2), (14, 4), (10, 4), (20, 0)])
    assert allocator.free_runs_snapshot() == [(2, 4), (10, 8)]


def test_expand_runs_matches_a_plain_expansion() -> None:
    rng = random.Random(3)
    for count in (0, 1, 5, 16, 17, 300):
        runs = [(rng.randrange(10_000), rng.randrange(1, 9)) for _ in range(count)]
        expected = [s + j for s, n in runs for j in range(n)]
        ids = expand_runs(runs)
        assert ids.dtype == torch.int64 and ids.tolist() == expected


# --- misuse -----------------------------------------------------------------------------------


@pytest.fixture
def half_used() -> ContiguousSlotAllocator:
    allocator = ContiguousSlotAllocator(64, 4)
    assert allocator.alloc(32) is not None
    return allocator


@pytest.mark.parametrize(
    ("slots", "error", "match"),
    [
        (torch.arange(32, 36), ValueError, "slot 32 is not allocated"),  # never allocated
        (torch.tensor([28, 29, 30, 31, 64, 65, 66, 67]), ValueError, "slot 67 is outside"),
        (torch.tensor([-4, -3, -2, -1]), ValueError, "slot -4 is outside"),
        (torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), ValueError, "slot 0 is listed more than once"),
        (torch.tensor([4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]), ValueError, "more than once"),
        (torch.tensor([0, 1, 2]), ValueError, "not whole pages"),
        (torch.tensor([2, 3, 4, 5]), ValueError, "slot 2 does not start a page"),
        (torch.tensor([8, 9, 10, 11, 2, 3, 4, 5]), ValueError, "from 2 on are not whole"),
        (torch.tensor([0.0, 1.0, 2.0, 3.0]), TypeError, "integer dtype"),
        (torch.arange(4, device="meta"), TypeError, "CPU index tensors only"),
        (torch.arange(8).view(2, 4), ValueError, "one-dimensional"),
    ],
)
def test_bad_free_raises_and_changes_nothing(
    half_used: ContiguousSlotAllocator, slots: torch.Tensor, error: type, match: str
) -> None:
    before = state(half_used)
    with pytest.raises(error, match=match):
        half_used.free(slots)
    assert_same_state(before, state(half_used))


def test_double_free_names_the_slot() -> None:
    allocator = ContiguousSlotAllocator(16)
    slots = allocator.alloc(8)
    assert slots is not None
    allocator.free(slots[2:5])
    before = state(allocator)
    with pytest.raises(ValueError, match="slot 3 is not allocated"):
        allocator.free(torch.tensor([6, 3]))
    with pytest.raises(ValueError, match="slot 4 is not allocated"):
        allocator.free(slots[4:6])
    assert_same_state(before, state(allocator))
    allocator.free(slots[5:])
    allocator.free(slots[:2])
    assert allocator.free_runs_snapshot() == [(0, 16)]


def test_large_scattered_free_checks_duplicates_and_state() -> None:
    allocator = ContiguousSlotAllocator(2000)
    slots = allocator.alloc(2000)
    assert slots is not None
    scattered = slots[::3]  # 667 single-slot runs: the sort-the-index path
    order = torch.randperm(scattered.numel(), generator=torch.Generator().manual_seed(0))
    with_repeat = torch.cat([scattered[order], scattered[5:6]])
    before = state(allocator)
    with pytest.raises(ValueError, match=f"slot {int(scattered[5])} is listed more than once"):
        allocator.free(with_repeat)
    assert_same_state(before, state(allocator))
    allocator.free(scattered[order])
    assert allocator.available_size() == 667
    assert allocator.free_runs_snapshot() == [(s, 1) for s in range(0, 2000, 3)]


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([(0, 8), (4, 4)], "slot 4 is listed more than once"),
        ([(28, 4), (32, 4)], "slot 32 is not allocated"),
        ([(60, 8)], "slot 67 is outside"),
        ([(-4, 4)], "slot -4 is outside"),
        ([(1, 4)], "not whole pages"),
        ([(0, -4)], "negative length"),
    ],
)
def test_bad_free_runs_raise_and_change_nothing(
    half_used: ContiguousSlotAllocator, runs: list[tuple[int, int]], match: str
) -> None:
    before = state(half_used)
    with pytest.raises(ValueError, match=match):
        half_used.free_runs(runs)
    assert_same_state(before, state(half_used))


def test_sizes_must_be_whole_pages() -> None:
    with pytest.raises(ValueError, match="multiple of page_size"):
        ContiguousSlotAllocator(30, 4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        ContiguousSlotAllocator(30, 0)
    allocator = ContiguousSlotAllocator(32, 4)
    for bad in (3, 6, 33):
        with pytest.raises(ValueError, match="multiple of page_size"):
            allocator.alloc(bad)
    with pytest.raises(ValueError, match=">= 0"):
        allocator.alloc(-4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        allocator.alloc_run(2)
    assert allocator.available_size() == 32 and allocator.stats.allocations == 0


def test_free_accepts_any_order_within_whole_pages() -> None:
    allocator = ContiguousSlotAllocator(16, 4)
    slots = allocator.alloc(16)
    assert slots is not None
    allocator.free(torch.tensor([13, 12, 15, 14, 2, 0, 3, 1], dtype=torch.int32))
    assert allocator.free_runs_snapshot() == [(0, 4), (12, 4)]


# --- churn stress -----------------------------------------------------------------------------


def test_churn_stress_keeps_exact_accounting() -> None:
    size, page_size = 1 << 14, 2
    allocator = ContiguousSlotAllocator(size, page_size)
    rng = random.Random(20240611)
    model_free = np.ones(size, dtype=bool)
    free_count = size
    live: list[torch.Tensor] = []
    for step in range(100_000):
        if live and (rng.random() < 0.5 or free_count < size // 10):
            slots = live.pop(rng.randrange(len(live)))
            pages = slots.numel() // page_size
            if pages > 1 and rng.random() < 0.3:
                keep = rng.randrange(1, pages) * page_size
                live.append(slots[:keep])
                slots = slots[keep:]
            if rng.random() < 0.2:
                slots = slots.view(-1, page_size)[torch.randperm(slots.numel() // page_size)]
                slots = slots.flatten()
            allocator.free(slots)
            model_free[slots.numpy()] = True
            free_count += slots.numel()
        else:
            need = page_size * max(1, int(2 ** rng.uniform(0, 9)))
            if rng.random() < 0.005:
                need = free_count + page_size
            slots = allocator.alloc(need)
            if need > free_count:
                assert slots is None
            else:
                assert slots is not None and slots.numel() == need
                ids = slots.numpy()
                assert model_free[ids].all(), f"step {step}: handed out a slot that is not free"
                model_free[ids] = False
                assert not model_free[ids].any()  # distinct: every id now marked exactly once
                free_count -= need
                live.append(slots)
        assert allocator.available_size() == free_count
        if step % 1000 == 0:
            assert int(model_free.sum()) == free_count
            starts = np.flatnonzero(model_free)
            assert allocator.free_runs_snapshot() == find_runs(torch.from_numpy(starts)).as_list()
            assert torch.equal(allocator.page_used, ~torch.from_numpy(model_free[::page_size]))
    for slots in live:
        allocator.free(slots)
    assert allocator.free_runs_snapshot() == [(0, size)]
    assert allocator.available_size() == size
    assert allocator.stats.free_runs == 1
    assert not bool(allocator.page_used.any())


def test_churn_trace_matches_stock_outcomes_and_counts_runs_like_find_runs() -> None:
    trace = make_trace(1 << 14, page_size=4, mixed_ops=2000, max_request_pages=256, seed=7)
    ours = ContiguousSlotAllocator(1 << 14, 4)
    stock = StockSlotAllocator(1 << 14, 4)
    mine = replay(trace, ours)
    theirs = replay(trace, stock)
    assert mine.outcomes == theirs.outcomes
    assert mine.available == theirs.available
    assert False in mine.outcomes  # the trace does contain refused allocations
    assert ours.stats.allocations == mine.allocations
    assert ours.stats.one_run_allocations == mine.one_run_allocations
    assert stock.stats.one_run_allocations == theirs.one_run_allocations
    assert mine.one_run_fraction > theirs.one_run_fraction


# --- statistics, metrics, clear ---------------------------------------------------------------


def test_stats_on_a_hand_made_sequence() -> None:
    allocator = ContiguousSlotAllocator(10)
    assert allocator.stats.one_run_fraction == 1.0 and allocator.stats.runs_per_allocation == 0.0
    a = allocator.alloc(3)
    b = allocator.alloc(3)
    c = allocator.alloc(3)
    assert a is not None and b is not None and c is not None
    allocator.free(a)
    allocator.free(c)  # free runs: [0, 3) and [6, 10)
    d = allocator.alloc(5)
    assert d is not None and d.tolist() == [6, 7, 8, 9, 0]
    allocator.alloc(0)  # empty allocations are not counted
    stats = allocator.stats
    assert (stats.allocations, stats.one_run_allocations, stats.runs_total) == (4, 3, 5)
    assert stats.one_run_fraction == 0.75
    assert stats.runs_per_allocation == 1.25
    assert stats.free_runs == 1


def test_metrics_only_when_given() -> None:
    before = METRICS.snapshot()["allocator"]
    plain = with_holes(20, [(0, 2), (10, 4)])
    assert plain.alloc(5) is not None
    assert METRICS.snapshot()["allocator"] == before

    metrics = Metrics()
    allocator = ContiguousSlotAllocator(20, metrics=metrics)
    assert allocator.alloc_runs(20) == [(0, 20)]
    allocator.free_runs([(0, 2), (10, 4)])
    assert allocator.alloc(5) is not None  # two runs
    assert allocator.alloc_run(1) == 1
    snap = metrics.snapshot()["allocator"]
    assert snap["allocations"] == 3
    assert snap["one_run_fraction"] == pytest.approx(2 / 3)
    assert snap["runs_per_allocation"] == pytest.approx(4 / 3)


def test_clear_frees_everything_and_resets_stats() -> None:
    allocator = ContiguousSlotAllocator(12, 3)
    first = allocator.alloc(6)
    assert first is not None and allocator.alloc(6) is not None
    allocator.clear()
    assert allocator.available_size() == 12
    assert allocator.free_runs_snapshot() == [(0, 12)]
    assert allocator.stats.allocations == 0
    assert not bool(allocator.page_used.any())
    with pytest.raises(ValueError, match="slot 0 is not allocated"):
        allocator.free(first)
    assert allocator.alloc(12).tolist() == list(range(12))


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_corrupted_used_map_stops_the_hand_out_before_marking(page_size: int) -> None:
    allocator = ContiguousSlotAllocator(16 * page_size, page_size)
    allocator.alloc_runs(4 * page_size)
    allocator.free_runs([(page_size, 2 * page_size)])
    # Pages 1 and 9 marked used behind the free map's back.
    allocator.page_used[[1, 9]] = True
    with pytest.raises(DoubleAllocationError) as caught:
        allocator.alloc(14 * page_size)
    error = caught.value
    assert isinstance(error, RuntimeError)
    # Best fit takes the largest run (pages 4-15) whole, then pages 1-2.
    assert error.runs == [(4 * page_size, 12 * page_size), (page_size, 2 * page_size)]
    slots_of_page = [list(range(p * page_size, (p + 1) * page_size)) for p in (9, 1)]
    assert error.slots == slots_of_page[0] + slots_of_page[1]
    assert str(error) == f"allocator free map handed out allocated slots {error.slots}"
    # Nothing else was marked, and the runs handed out are gone from the free map.
    assert allocator.page_used.nonzero().flatten().tolist() == [0, 1, 3, 9]
    assert allocator.available_size() == 0
    assert allocator.free_runs_snapshot() == []
