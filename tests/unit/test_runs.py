from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.run_pieces import slice_runs
from kvcore.runs import (
    COUNT_PREFIX,
    check_bounds,
    check_index,
    find_paired_runs,
    find_runs,
    has_duplicates,
    has_duplicates_below,
    run_count_up_to,
    segment_transfer,
    span_and_run_count,
    span_and_runs_of,
)

index_lists = st.lists(st.integers(min_value=0, max_value=60), max_size=80)


def expand(starts: list[int], lengths: list[int]) -> list[int]:
    return [s + j for s, n in zip(starts, lengths, strict=True) for j in range(n)]


def runs_in_random_places(run_lengths: list[int], seed: int) -> torch.Tensor:
    """An index of runs of ``700 * length`` rows (1 for a length of 0) at random starts
    below 90 000: long enough that a bounded count reads a prefix of it."""
    rng = random.Random(seed)
    values: list[int] = []
    for length in run_lengths:
        start = rng.randrange(0, 90_000)
        values += range(start, start + max(length * 700, 1))
    return torch.tensor(values, dtype=torch.int64)


def reference_runs(values: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


@settings(max_examples=200, deadline=None)
@given(index_lists)
def test_find_runs_matches_reference(values: list[int]) -> None:
    runs = find_runs(torch.tensor(values, dtype=torch.int64))
    assert runs.as_list() == reference_runs(values)
    assert runs.total == len(values)
    assert expand(runs.starts.tolist(), runs.lengths.tolist()) == values


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_paired_runs_split_where_either_side_breaks(pairs: list[tuple[int, int]]) -> None:
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    runs = find_paired_runs(
        torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    )
    assert expand(runs.src_starts.tolist(), runs.lengths.tolist()) == src
    assert expand(runs.dst_starts.tolist(), runs.lengths.tolist()) == dst
    assert runs.offsets.tolist() == [0, *torch.cumsum(runs.lengths, 0).tolist()[:-1]][: runs.count]
    # maximal: two neighbouring runs could not have been joined
    for i in range(runs.count - 1):
        end = int(runs.offsets[i] + runs.lengths[i]) - 1
        joinable = src[end] + 1 == src[end + 1] and dst[end] + 1 == dst[end + 1]
        assert not joinable


@settings(max_examples=200, deadline=None)
@given(index_lists, st.data())
def test_slices_of_runs_cover_exactly_their_positions(values: list[int], data) -> None:
    runs = find_runs(torch.tensor(values, dtype=torch.int64))
    begin = data.draw(st.integers(0, len(values)))
    end = data.draw(st.integers(begin, len(values)))
    piece = slice_runs(runs, begin, end)
    assert expand(piece.starts.tolist(), piece.lengths.tolist()) == values[begin:end]
    assert piece.total == end - begin
    assert all(length > 0 for length in piece.lengths.tolist())


def test_slice_outside_the_runs_is_refused() -> None:
    runs = find_runs(torch.arange(5))
    with pytest.raises(ValueError, match="not within"):
        slice_runs(runs, 2, 6)


def test_bad_index_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="integer dtype"):
        check_index(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="one-dimensional"):
        check_index(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        check_index([1, 2])  # type: ignore[arg-type]
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    with pytest.raises(TypeError, match="CPU index tensors only"):
        find_runs(meta)


@pytest.mark.gpu
def test_cuda_index_is_refused_without_reading_it_back() -> None:
    with pytest.raises(TypeError, match="synchronise the GPU"):
        find_runs(torch.arange(8, device="cuda"))


def test_bounds_and_duplicates() -> None:
    assert check_bounds(torch.tensor([0, 9]), 10) == 10
    assert check_bounds(torch.tensor([3, 1]), 10) == 4
    assert check_bounds(torch.tensor([], dtype=torch.int64), 10) == 0
    with pytest.raises(ValueError, match="holds 10"):
        check_bounds(torch.tensor([0, 10]), 10)
    with pytest.raises(ValueError, match="holds -1"):
        check_bounds(torch.tensor([-1, 3]), 10)
    assert has_duplicates(torch.tensor([4, 1, 4]))
    assert not has_duplicates(torch.tensor([4, 1, 5]))
    assert find_runs(torch.tensor([1, 2, 3], dtype=torch.int32)).as_list() == [(1, 3)]


@pytest.mark.parametrize(
    "values",
    [[4, 1, 4], [0, 1, 2, 2], [7, 0, 500_000, 7], [-3, 5, -3], [2, 1, 0], [0, 1_000_000, 3]],
)
def test_duplicates_found_by_mask_and_by_sorting_alike(values: list[int]) -> None:
    # Small spans take the mask, spans far larger than the index take the sort.
    index = torch.tensor(values)
    assert has_duplicates(index) == (len(set(values)) != len(values))


@settings(max_examples=300, deadline=None)
@given(
    entries=st.integers(2, 300),
    spread=st.sampled_from([1, 4, 30, 500, 1 << 25]),
    repeats=st.integers(0, 3),
    ascending=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_duplicates_below_is_exact_at_every_density(
    entries: int, spread: int, repeats: int, ascending: bool, seed: int
) -> None:
    # Spreads from a dense mask through the skip of an ascending index, the sparse mask and
    # the stamped positions to the sort past the stamps' largest span.
    rng = random.Random(seed)
    span = max(entries, entries * spread // 2)
    values = rng.sample(range(span), entries)
    for _ in range(repeats):
        values[rng.randrange(entries)] = values[rng.randrange(entries)]
    if ascending:
        values.sort()
    index = torch.tensor(values)
    expected = len(set(values)) != len(values)
    assert has_duplicates(index) == expected
    assert has_duplicates_below(index, max(values) + 1) == expected
    assert has_duplicates_below(index, span) == expected


def test_stamped_positions_need_no_clearing_between_indices() -> None:
    # A slot stamped by one index holds a stale position for the next: it is always
    # overwritten before it is read, so nothing is found that is not there.
    span = 1 << 20
    first = torch.arange(0, span, 4096)
    assert not has_duplicates_below(first, span)
    second = torch.cat([first[:10], first[5:6]])
    assert has_duplicates_below(second, span)
    assert not has_duplicates_below(first[1:], span)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60),
    st.booleans(),
)
def test_segment_transfer_equals_the_separate_functions(
    pairs: list[tuple[int, int]], host_is_src: bool
) -> None:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    found = segment_transfer(src, dst, 41, 41, host_is_src=host_is_src)
    paired = find_paired_runs(src, dst)
    for mine, theirs in (
        (found.runs.src_starts, paired.src_starts),
        (found.runs.dst_starts, paired.dst_starts),
        (found.runs.lengths, paired.lengths),
        (found.runs.offsets, paired.offsets),
    ):
        assert mine.tolist() == theirs.tolist()
    assert found.host_runs.as_list() == find_runs(src if host_is_src else dst).as_list()
    assert found.src_span == check_bounds(src, 41)
    assert found.dst_span == check_bounds(dst, 41)
    assert found.dst_has_duplicates == has_duplicates(dst)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-3, max_value=45), max_size=60))
def test_span_and_run_count_equal_bounds_and_runs(values: list[int]) -> None:
    index = torch.tensor(values, dtype=torch.int64)
    try:
        expected = (check_bounds(index, 41), find_runs(index).count)
    except ValueError as refused:
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            span_and_run_count(index, 41)
        return
    assert span_and_run_count(index, 41) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=9), min_size=2, max_size=40),
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=0, max_value=3),
)
def test_a_bounded_run_count_is_exact_up_to_its_bound(
    run_lengths: list[int], bound: int, seed: int
) -> None:
    """Runs of the given lengths (0: a scattered entry) in random places of a long index:
    at most ``bound`` runs come back exact, more come back as some count above it; the
    bounds are the whole index's either way."""
    index = runs_in_random_places(run_lengths, seed)
    exact = span_and_run_count(index, 100_000)
    found = span_and_run_count(index, 100_000, count_up_to=bound)
    assert found[0] == exact[0]
    if exact[1] <= bound:
        assert found == exact
    else:
        assert found[1] > bound


def test_a_bounded_run_count_still_bounds_every_entry() -> None:
    # Past the prefix that decides the count, an entry out of range is still refused.
    scattered = torch.randperm(20_000, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="holds 20000, outside"):
        span_and_run_count(torch.cat([scattered, torch.tensor([20_000])]), 20_000, count_up_to=2)
    # One run past the prefix (of an index long enough to have one) and a break after it:
    # counted past the prefix.
    long_run = 2 * COUNT_PREFIX + 1
    index = torch.cat([torch.arange(long_run), torch.tensor([long_run + 4])])
    assert span_and_run_count(index, 10**6, count_up_to=1) == (long_run + 5, 2)


def test_a_bounded_count_of_ends_one_run_apart_reads_the_whole_index() -> None:
    # First and last entry a run apart, but the middle shuffled: counted over every entry
    # in one pass (no prefix), exact within the bound and above it past the bound.
    n = 4 * COUNT_PREFIX
    middle = torch.randperm(n - 2, generator=torch.Generator().manual_seed(4)) + 1
    shuffled = torch.cat([torch.tensor([0]), middle, torch.tensor([n - 1])])
    assert shuffled[-1] - shuffled[0] == n - 1
    exact = find_runs(shuffled).count
    assert run_count_up_to(shuffled, 3) > 3 and run_count_up_to(shuffled, n) == exact
    # One entry moved near the end: three breaks, all past the prefix, counted exactly.
    swapped = torch.cat([torch.arange(3 * COUNT_PREFIX), torch.arange(3 * COUNT_PREFIX, n)[1:]])
    swapped = torch.cat([swapped[:-1], torch.tensor([3 * COUNT_PREFIX]), swapped[-1:]])
    assert swapped[-1] - swapped[0] == n - 1
    assert run_count_up_to(swapped, 8) == find_runs(swapped).count == 4
    assert span_and_run_count(swapped, n, count_up_to=8) == (n, 4)


def test_a_limit_of_zero_still_bounds_one_long_run_by_every_entry() -> None:
    # One run through the prefix, an out-of-range entry after it: a count of one is exact.
    index = torch.cat([torch.arange(2 * COUNT_PREFIX + 1), torch.tensor([10**6])])
    with pytest.raises(ValueError, match="outside"):
        span_and_run_count(index, 10**6, count_up_to=0)
    assert run_count_up_to(index, 0) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(0, 20))
def test_run_count_up_to_agrees_with_the_runs_found(run_lengths: list[int], limit: int) -> None:
    values: list[int] = []
    for number, length in enumerate(run_lengths):
        values += range(number * 10_000, number * 10_000 + max(length * 1500, 1))
    index = torch.tensor(values, dtype=torch.int64)
    exact = find_runs(index).count
    found = run_count_up_to(index, limit)
    assert found == exact if exact <= max(limit, 1) else found > limit


def test_negative_entries_are_refused_whatever_the_size() -> None:
    # The bound is checked in one unsigned pass: a negative entry must still be named.
    for negative in (-1, -(2**63)):
        index = torch.tensor([7, negative, 3], dtype=torch.int64)
        with pytest.raises(ValueError, match=f"holds {negative}, outside"):
            check_bounds(index, 2**62)
    assert check_bounds(torch.tensor([7, 0, 3]), 8) == 8


def test_span_and_run_count_checks_the_ends_of_one_run() -> None:
    assert span_and_run_count(torch.arange(3, 9), 9) == (9, 1)
    with pytest.raises(ValueError, match="holds 9, outside"):
        span_and_run_count(torch.arange(4, 10), 9)
    with pytest.raises(ValueError, match="holds -2, outside"):
        span_and_run_count(torch.arange(-2, 3), 9)


def test_segment_transfer_checks_bounds_and_lengths() -> None:
    with pytest.raises(ValueError, match="src_idx holds 8"):
        segment_transfer(torch.tensor([8]), torch.tensor([0]), 8, 8, host_is_src=True)
    with pytest.raises(ValueError, match="dst_idx holds -1"):
        segment_transfer(torch.tensor([0]), torch.tensor([-1]), 8, 8, host_is_src=True)
    with pytest.raises(ValueError, match="2 entries but dst_idx has 1"):
        segment_transfer(torch.tensor([0, 1]), torch.tensor([0]), 8, 8, host_is_src=False)


def test_scattered_rows_are_runs_of_one_that_stay_intact_after_larger_calls() -> None:
    small = torch.tensor([5, 3, 9, 0])
    found = segment_transfer(small, torch.tensor([7, 1, 2, 8]), 10, 10, host_is_src=True)
    # Every row is a run of its own: the indices are the starts.
    assert found.runs.src_starts.tolist() == [5, 3, 9, 0]
    assert found.runs.lengths.tolist() == [1, 1, 1, 1]
    assert found.runs.offsets.tolist() == [0, 1, 2, 3]
    assert found.host_runs.as_list() == [(5, 1), (3, 1), (9, 1), (0, 1)]
    generator = torch.Generator().manual_seed(1)
    large = torch.randperm(50_000, generator=generator)
    bigger = segment_transfer(large, large.flip(0), 50_000, 50_000, host_is_src=False)
    assert bigger.runs.count == 50_000 and bigger.runs.total == 50_000
    assert bigger.runs.offsets[-1].item() == 49_999
    # The small transfer's runs did not change under the larger one.
    assert found.runs.lengths.tolist() == [1, 1, 1, 1]
    assert found.runs.offsets.tolist() == [0, 1, 2, 3]
    assert found.host_runs.as_list() == [(5, 1), (3, 1), (9, 1), (0, 1)]


def test_segmenting_on_several_threads_at_once_matches_one_at_a_time() -> None:
    generator = torch.Generator().manual_seed(2)
    cases = []
    for size in (3_000, 40_000, 120_000, 7):
        pages = torch.randperm(size // 8 + 1, generator=generator)[:, None] * 8
        paged = (pages + torch.arange(8)).flatten()[:size]
        scattered = torch.randperm(2 * size, generator=generator)[:size]
        cases += [(paged, scattered), (scattered, paged), (paged, paged.sort().values)]

    def segment(case: tuple[torch.Tensor, torch.Tensor]) -> tuple[object, ...]:
        src, dst = case
        found = segment_transfer(
            src, dst, 2 * src.numel() + 16, 2 * src.numel() + 16, host_is_src=True
        )
        return (
            found.runs.src_starts.tolist(),
            found.runs.dst_starts.tolist(),
            found.runs.lengths.tolist(),
            found.host_runs.as_list(),
            found.dst_has_duplicates,
        )

    expected = [segment(case) for case in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            assert list(pool.map(segment, cases)) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-30, 4), st.integers(8, 24)), min_size=1, max_size=12),
    st.randoms(use_true_random=False),
    st.sampled_from(["in order", "reversed", "every other row, shuffled"]),
    st.booleans(),
)
def test_duplicates_between_page_runs_are_found_by_their_intervals(
    gaps: list[tuple[int, int]], rng: random.Random, source: str, host_is_src: bool
) -> None:
    # Pages of 8+ rows, each starting a gap after the previous one ends (a negative gap
    # overlaps it, 0 abuts it), listed in a shuffled order: the check compares the runs'
    # intervals, not the rows.
    pages, end = [], 40
    for gap, length in gaps:
        pages.append((max(0, end + gap), length))
        end = pages[-1][0] + length
    rng.shuffle(pages)
    dst_rows = [row for start, length in pages for row in range(start, start + length)]
    lengths = [length for _, length in pages]
    at = [sum(lengths[:k]) for k in range(len(pages))]
    if source == "every other row, shuffled":
        # No two source rows adjacent: every paired run is one row, and the destination's
        # own runs (its pages) carry the check.
        src_rows = [2 * row for row in range(len(dst_rows))]
        rng.shuffle(src_rows)
    else:
        # The source holds the pages back to back, in order or in reverse page order.
        if source == "reversed":
            at = [len(dst_rows) - a - n for a, n in zip(at, lengths, strict=True)]
        src_rows = [row for a, n in zip(at, lengths, strict=True) for row in range(a, a + n)]
    src = torch.tensor(src_rows, dtype=torch.int64)
    dst = torch.tensor(dst_rows, dtype=torch.int64)
    found = segment_transfer(src, dst, 2 * len(dst_rows), 400, host_is_src=host_is_src)
    if source == "every other row, shuffled":
        assert found.runs.count == len(dst_rows)
    else:
        assert found.runs.count * 8 <= len(dst_rows)
    assert found.dst_has_duplicates == (len(set(dst_rows)) != len(dst_rows))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=9), max_size=40),
    st.integers(min_value=0, max_value=6),
    st.integers(min_value=0, max_value=3),
)
def test_runs_found_with_the_count_are_find_runs_up_to_the_bound(
    run_lengths: list[int], bound: int, seed: int
) -> None:
    """Long indices (past the count's prefix) and short ones: up to ``bound`` runs the
    runs come back as find_runs finds them, with the span and count of
    span_and_run_count; past it, no runs and a count above the bound."""
    index = runs_in_random_places(run_lengths, seed)
    span, count, runs = span_and_runs_of(index.numpy(), 100_000, "index", count_up_to=bound)
    assert (span, count) == span_and_run_count(index, 100_000, count_up_to=bound)
    exact = find_runs(index)
    if exact.count <= max(bound, 1) or index.numel() < 2:
        assert runs is not None
        assert runs.starts.tolist() == exact.starts.tolist()
        assert runs.lengths.tolist() == exact.lengths.tolist()
    else:
        assert runs is None and count > bound


def test_runs_found_with_the_count_still_bound_every_entry() -> None:
    long_run = 2 * COUNT_PREFIX + 1
    index = torch.cat([torch.arange(long_run), torch.tensor([long_run + 4])])
    span, count, runs = span_and_runs_of(index.numpy(), 10**6, "host", count_up_to=2)
    assert (span, count) == (long_run + 5, 2)
    assert runs is not None and runs.lengths.tolist() == [long_run, 1]
    with pytest.raises(ValueError, match=f"host holds {long_run + 4}, outside"):
        span_and_runs_of(index.numpy(), long_run + 2, "host", count_up_to=2)
