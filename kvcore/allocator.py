"""ContiguousSlotAllocator: host slots handed out as few, long runs.

Free space is a set of maximal runs kept in page units. An allocation takes the
best-fitting single run when one is big enough, else the largest runs whole and
the remainder from the best-fitting run. It fails exactly when fewer slots are
free than asked for, like the engines' own allocators, so a caller that decides
evictions from ``available_size()`` behaves the same.

Not thread-safe: callers serialise (SGLang's pool lock).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from sortedcontainers import SortedList

from kvcore.metrics import Metrics
from kvcore.runs import check_index, find_runs

# Up to this many runs a concatenation of aranges is cheaper than the vectorised expansion.
_FEW_RUNS = 16
# Up to this many runs in a freed index, sorting the runs beats sorting the index.
_FEW_RUNS_TO_SORT = 256


class DoubleAllocationError(RuntimeError):
    """The free map handed out slots the used map holds as allocated.

    Only a corrupted allocator gets here, never a caller's mistake. ``slots`` lists
    those slots in the order they were handed out, so that an adapter can report them
    in its engine's words; ``runs`` are the slot runs handed out, which stay out of
    the free map and unmarked, as an engine's free list that handed out the same
    slots would have left them.
    """

    def __init__(self, slots: list[int], runs: list[tuple[int, int]]) -> None:
        super().__init__(f"allocator free map handed out allocated slots {slots}")
        self.slots = slots
        self.runs = runs


@dataclass(frozen=True)
class AllocatorStats:
    """Contiguity of the allocations made since construction or the last clear()."""

    allocations: int
    one_run_allocations: int
    runs_total: int
    free_runs: int

    @property
    def one_run_fraction(self) -> float:
        return self.one_run_allocations / self.allocations if self.allocations else 1.0

    @property
    def runs_per_allocation(self) -> float:
        return self.runs_total / self.allocations if self.allocations else 0.0


def expand_runs(runs: list[tuple[int, int]]) -> torch.Tensor:
    """int64 ids ``start, start + 1, ...`` for each ``(start, length)``, run by run."""
    if not runs:
        return torch.empty(0, dtype=torch.int64)
    if len(runs) == 1:
        start, length = runs[0]
        ids = np.arange(start, start + length, dtype=np.int64)
    elif len(runs) <= _FEW_RUNS:
        ids = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs])
    else:
        starts = np.array([s for s, _ in runs], dtype=np.int64)
        lengths = np.array([n for _, n in runs], dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        total = int(offsets[-1] + lengths[-1])
        ids = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, lengths)
    return torch.from_numpy(ids)


def check_pool_size(size: int, page_size: int) -> tuple[int, int]:
    """``size`` and ``page_size`` as ints, or ValueError unless size is whole pages."""
    size = operator.index(size)
    page_size = operator.index(page_size)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if size < 0 or size % page_size:
        raise ValueError(f"size {size} is not a non-negative multiple of page_size {page_size}")
    return size, page_size


class ContiguousSlotAllocator:
    """Slots ``[0, size)`` in pages of ``page_size``, handed out as contiguous runs."""

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        *,
        metrics: Metrics | None = None,
        ready: int | None = None,
    ) -> None:
        size, page_size = check_pool_size(size, page_size)
        self.size = size
        self.page_size = page_size
        self._pages = size // page_size
        self._metrics = metrics
        self._ready_pages = self._ready_pages_of(size if ready is None else ready)
        self.clear()

    @property
    def ready_size(self) -> int:
        """Slots ``[0, ready_size)`` may be handed out; the rest wait for :meth:`grow_ready`
        (memory not ready yet, such as a host pool still being pinned)."""
        return self._ready_pages * self.page_size

    def grow_ready(self, ready: int) -> None:
        """Slots ``[0, ready)`` may be handed out from now on (whole pages); a smaller
        ``ready`` than today's changes nothing."""
        pages = self._ready_pages_of(ready)
        if pages > self._ready_pages:
            self._release(((self._ready_pages, pages - self._ready_pages),))
            self._ready_pages = pages

    def _ready_pages_of(self, ready: int) -> int:
        ready = operator.index(ready)
        if not 0 <= ready <= self.size or ready % self.page_size:
            raise ValueError(
                f"ready size {ready} is not whole pages of {self.page_size} within [0, {self.size}]"
            )
        return ready // self.page_size

    def clear(self) -> None:
        """Everything ready free again, statistics reset."""
        self._by_length: SortedList = SortedList()
        self._length_at: dict[int, int] = {}
        self._start_before: dict[int, int] = {}
        # Allocated state per page, kept apart from the run map as a guard against
        # the map ever handing out a page twice; numpy reads it far cheaper per call.
        self.page_used = torch.zeros(self._pages, dtype=torch.bool)
        self._used = self.page_used.numpy()
        if self._ready_pages:
            self._add_free(0, self._ready_pages)
        self._free_pages = self._ready_pages
        self._allocations = 0
        self._one_run_allocations = 0
        self._runs_total = 0

    def available_size(self) -> int:
        return self._free_pages * self.page_size

    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocations=self._allocations,
            one_run_allocations=self._one_run_allocations,
            runs_total=self._runs_total,
            free_runs=len(self._length_at),
        )

    def free_runs_snapshot(self) -> list[tuple[int, int]]:
        """Free runs ``(start, length)`` in slots, sorted by start."""
        ps = self.page_size
        return [(start * ps, length * ps) for start, length in sorted(self._length_at.items())]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slot ids (int64, run by run, each run ascending), or None when short."""
        runs = self.alloc_runs(need_size)
        if runs is None:
            return None
        return expand_runs(runs)

    def alloc_runs(self, need_size: int) -> list[tuple[int, int]] | None:
        """Like :meth:`alloc`, as ``(start, length)`` slot runs."""
        pages = self._pages_for(need_size)
        if pages > self._free_pages:
            return None
        if pages == 0:
            return []
        runs = self._take(pages)
        self._mark_used(runs)
        self._record(len(runs))
        ps = self.page_size
        if ps == 1:
            return runs
        return [(first * ps, count * ps) for first, count in runs]

    def alloc_run(self, need_size: int) -> int | None:
        """First slot of one contiguous run of ``need_size`` slots, or None if no run fits."""
        pages = self._pages_for(need_size)
        if pages == 0:
            raise ValueError("alloc_run needs a positive size")
        index = self._by_length.bisect_left((pages, -1))
        if index == len(self._by_length):
            return None
        length, first = self._by_length[index]
        self._take_from(first, length, pages)
        self._free_pages -= pages
        self._mark_used([(first, pages)])
        self._record(1)
        return first * self.page_size

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (any order, whole pages) to the free map.

        Nothing changes unless every slot is in range, listed once and currently
        allocated; otherwise ValueError names an offending slot.
        """
        ids = check_index(slots, "slots").numpy()
        n = len(ids)
        if n == 0:
            return
        ps = self.page_size
        if n % ps:
            raise ValueError(f"freeing {n} slots, not whole pages of {ps}")
        low = int(ids[0])
        if n == 1 or bool((ids == np.arange(low, low + n, dtype=np.int64)).all()):
            self._free_one_run(low, n)
            return
        pages = ids if ps == 1 else self._whole_pages(ids)
        self._check_range(int(pages.min()) * ps, int(pages.max()) * ps + ps - 1)
        runs = self._disjoint_runs(pages)
        used = self._used[pages]
        if not used.all():
            raise ValueError(self._not_allocated(int(pages[~used][0])))
        self._used[pages] = False
        self._release(runs)

    def free_runs(self, runs: Iterable[tuple[int, int]]) -> None:
        """Return slot runs ``(start, length)``; validated as a whole like :meth:`free`."""
        ps = self.page_size
        pending: list[tuple[int, int]] = []
        for start, length in sorted((operator.index(s), operator.index(n)) for s, n in runs):
            if length < 0:
                raise ValueError(f"run at slot {start} has negative length {length}")
            if length == 0:
                continue
            self._check_range(start, start + length - 1)
            if start % ps or length % ps:
                raise ValueError(f"run ({start}, {length}) is not whole pages of {ps}")
            if pending and (pending[-1][0] + pending[-1][1]) * ps > start:
                raise ValueError(self._listed_twice(start // ps))
            first, count = start // ps, length // ps
            self._check_allocated(first, count)
            pending.append((first, count))
        for first, count in pending:
            self._used[first : first + count] = False
        self._release(pending)

    def _free_one_run(self, low: int, n: int) -> None:
        ps = self.page_size
        self._check_range(low, low + n - 1)
        if low % ps:
            raise ValueError(f"slot {low} does not start a page of {ps}")
        first, count = low // ps, n // ps
        self._check_allocated(first, count)
        self._used[first : first + count] = False
        self._release(((first, count),))

    def _pages_for(self, need_size: int) -> int:
        need_size = operator.index(need_size)
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size % self.page_size:
            raise ValueError(
                f"need_size {need_size} is not a multiple of page_size {self.page_size}"
            )
        return need_size // self.page_size

    def _check_range(self, low: int, high: int) -> None:
        if low < 0 or high >= self.size:
            bad = low if low < 0 else high
            raise ValueError(f"slot {bad} is outside [0, {self.size})")

    def _check_allocated(self, first: int, count: int) -> None:
        used = self._used[first : first + count]
        if not used.all():
            raise ValueError(self._not_allocated(first + int(np.argmin(used))))

    def _not_allocated(self, page: int) -> str:
        return f"slot {page * self.page_size} is not allocated (double free, or never allocated)"

    def _whole_pages(self, ids: np.ndarray) -> np.ndarray:
        """Page ids of ``ids``; ValueError unless they are whole, aligned pages."""
        pages = self._page_starts(ids)
        if pages is None:
            # Pages listed with their slots out of order: only sorting can tell.
            pages = self._page_starts(np.sort(ids))
        if pages is None:
            ps = self.page_size
            rows = np.sort(ids).reshape(-1, ps)
            bad_rows = (rows - rows[:, :1] != np.arange(ps)).any(axis=1) | (rows[:, 0] % ps != 0)
            bad = int(rows[bad_rows][0, 0])
            raise ValueError(f"slots from {bad} on are not whole, aligned pages of {ps}")
        return pages

    def _page_starts(self, ids: np.ndarray) -> np.ndarray | None:
        ps = self.page_size
        rows = ids.reshape(-1, ps)
        first = rows[:, :1]
        if (first % ps).any() or (rows - first != np.arange(ps, dtype=np.int64)).any():
            return None
        return first.ravel() // ps

    def _disjoint_runs(self, pages: np.ndarray) -> list[tuple[int, int]]:
        """Page runs covering ``pages``; ValueError if a page is listed twice."""
        runs = find_runs(torch.from_numpy(pages)).as_list()
        if len(runs) > _FEW_RUNS_TO_SORT:
            ordered = np.sort(pages)
            repeated = ordered[1:] == ordered[:-1]
            if repeated.any():
                raise ValueError(self._listed_twice(int(ordered[1:][repeated][0])))
            return find_runs(torch.from_numpy(ordered)).as_list()
        runs.sort()
        end = -1
        for first, count in runs:
            if first < end:
                raise ValueError(self._listed_twice(first))
            end = first + count
        return runs

    def _listed_twice(self, page: int) -> str:
        return f"slot {page * self.page_size} is listed more than once"

    def _take(self, pages: int) -> list[tuple[int, int]]:
        """Remove ``pages`` (0 < pages <= free pages) from the free map; the page runs taken."""
        runs: list[tuple[int, int]] = []
        remaining = pages
        by_length = self._by_length
        while True:
            index = by_length.bisect_left((remaining, -1))
            if index < len(by_length):
                length, first = by_length[index]
                self._take_from(first, length, remaining)
                runs.append((first, remaining))
                break
            length, first = by_length[-1]
            self._take_from(first, length, length)
            runs.append((first, length))
            remaining -= length
        self._free_pages -= pages
        return runs

    def _take_from(self, first: int, length: int, pages: int) -> None:
        self._drop_free(first, length)
        if length > pages:
            self._add_free(first + pages, length - pages)

    def _release(self, runs: Iterable[tuple[int, int]]) -> None:
        """Merge freed page runs (disjoint, no longer marked used) into the free map."""
        length_at = self._length_at
        start_before = self._start_before
        for first, count in runs:
            start, end = first, first + count
            left = start_before.get(start)
            if left is not None:
                self._drop_free(left, start - left)
                start = left
            right = length_at.get(end)
            if right is not None:
                self._drop_free(end, right)
                end += right
            self._add_free(start, end - start)
            self._free_pages += count

    def _add_free(self, first: int, length: int) -> None:
        self._by_length.add((length, first))
        self._length_at[first] = length
        self._start_before[first + length] = first

    def _drop_free(self, first: int, length: int) -> None:
        self._by_length.remove((length, first))
        del self._length_at[first]
        del self._start_before[first + length]

    def _mark_used(self, runs: list[tuple[int, int]]) -> None:
        """Mark page runs just taken from the free map allocated, all or none."""
        used = self._used
        if any(used[first : first + count].any() for first, count in runs):
            ps = self.page_size
            slot_runs = [(first * ps, count * ps) for first, count in runs]
            raise DoubleAllocationError(self._allocated_slots(runs), slot_runs)
        for first, count in runs:
            used[first : first + count] = True

    def _allocated_slots(self, runs: list[tuple[int, int]]) -> list[int]:
        ps = self.page_size
        offsets = np.arange(ps, dtype=np.int64)
        pages = np.concatenate(
            [first + np.flatnonzero(self._used[first : first + count]) for first, count in runs]
        )
        return (pages[:, None] * ps + offsets).ravel().tolist()

    def _record(self, runs: int) -> None:
        self._allocations += 1
        self._runs_total += runs
        if runs == 1:
            self._one_run_allocations += 1
        if self._metrics is not None:
            self._metrics.record_allocation(runs)
