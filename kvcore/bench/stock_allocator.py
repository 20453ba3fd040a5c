"""StockSlotAllocator: a model of SGLang's host-pool slot allocator, for comparison.

It models ``HostKVCache.clear / available_size / alloc / free`` of SGLang 0.5.23
(``python/sglang/srt/mem_cache/pool_host/base.py``), written from reading that
release, without its DCP widening or its unused ``mem_state`` tensor:

- ``free_slots`` starts as ``arange(size)``; ``alloc(n)`` asserts page alignment,
  returns None when ``n > available_size()``, else returns a view of the first
  ``n`` free slots and keeps the rest as a view;
- ``free`` only appends to ``release_slots``; those are concatenated, unsorted,
  after what is left of ``free_slots`` only when an allocation needs them (a lone
  release chunk on an empty free list becomes the free list as is);
- ``slot_used`` flags catch double alloc and double free (AssertionError); like
  SGLang, a free checks neither range, page structure nor duplicates within the
  call, and a negative slot wraps around;
- ``alloc``, ``free`` and ``clear`` hold an RLock, as SGLang's ``@synchronized``.

SGLang's ``free`` returns the number of slots freed; this model returns None like
:class:`~kvcore.allocator.ContiguousSlotAllocator`.
"""

from __future__ import annotations

import threading

import torch

from kvcore.allocator import AllocatorStats, check_pool_size
from kvcore.runs import find_runs

# Allocations counted together, so the list of uncounted ones stays bounded.
_COUNT_BATCH = 4096


class StockSlotAllocator:
    """First-fit-in-list-order slot allocator with lazily merged releases."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        size, page_size = check_pool_size(size, page_size)
        self.size = size
        self.page_size = page_size
        self.lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        with self.lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.release_slots: list[torch.Tensor] = []
            self.num_release_slots = 0
            self.slot_used = torch.zeros(self.size, dtype=torch.bool)
            # Returned slot tensors not yet counted into the statistics: counting
            # them one by one inside alloc() would slow the model it measures.
            self._uncounted: list[torch.Tensor] = []
            self._allocations = 0
            self._one_run_allocations = 0
            self._runs_total = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def alloc(self, need_size: int) -> torch.Tensor | None:
        with self.lock:
            if need_size % self.page_size != 0:
                raise AssertionError("The requested size should be a multiple of the page size.")
            if need_size > self.available_size():
                return None
            if need_size > len(self.free_slots):
                self._merge_release_slots()
            select_index = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            if bool(self.slot_used[select_index].any()):
                raise AssertionError(
                    "Double-alloc detected: slots already allocated: "
                    f"{select_index[self.slot_used[select_index]].tolist()}."
                )
            self.slot_used[select_index] = True
            if need_size:
                self._uncounted.append(select_index)
                if len(self._uncounted) >= _COUNT_BATCH:
                    self._count_runs()
            return select_index

    def free(self, slots: torch.Tensor) -> None:
        with self.lock:
            slots_cpu = slots.cpu()
            if slots_cpu.numel() == 0:
                return
            if not bool(self.slot_used[slots_cpu].all()):
                raise AssertionError(
                    "Double-free detected: slots not currently allocated: "
                    f"{slots_cpu[~self.slot_used[slots_cpu]].tolist()}."
                )
            self.slot_used[slots_cpu] = False
            self.release_slots.append(slots_cpu)
            self.num_release_slots += len(slots_cpu)

    @property
    def stats(self) -> AllocatorStats:
        """Contiguity of the returned slot tensors, counted with :func:`find_runs`."""
        with self.lock:
            self._count_runs()
            free = torch.cat([self.free_slots, *self.release_slots]).sort().values
            return AllocatorStats(
                allocations=self._allocations,
                one_run_allocations=self._one_run_allocations,
                runs_total=self._runs_total,
                free_runs=find_runs(free).count,
            )

    def _merge_release_slots(self) -> None:
        if self.num_release_slots == 0:
            return
        # Count before the old free list is dropped, so that returned views do not
        # keep every superseded free list alive.
        self._count_runs()
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def _count_runs(self) -> None:
        """Fold the uncounted allocations into the statistics in one vectorised pass.

        The allocations are concatenated; :func:`find_runs` splits that at every
        break, and each allocation's own start splits it once more.
        """
        if not self._uncounted:
            return
        lengths = torch.tensor([t.numel() for t in self._uncounted], dtype=torch.int64)
        joined = torch.cat(self._uncounted)
        self._uncounted = []
        runs = find_runs(joined)
        run_offsets = torch.cumsum(runs.lengths, 0) - runs.lengths
        alloc_offsets = torch.cumsum(lengths, 0) - lengths
        cuts = torch.unique(torch.cat([run_offsets, alloc_offsets]))
        ends = alloc_offsets + lengths
        per_alloc = torch.searchsorted(cuts, ends) - torch.searchsorted(cuts, alloc_offsets)
        self._allocations += int(per_alloc.numel())
        self._one_run_allocations += int((per_alloc == 1).sum())
        self._runs_total += int(per_alloc.sum())
