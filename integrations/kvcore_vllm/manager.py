"""vLLM's CPU offloading manager with host chunk ids from kvcore's contiguous allocator.

Stock vLLM hands out chunk ids from a bump counter, then from a LIFO free list, so
under churn a request's chunks scatter (often in descending order) and every chunk
becomes its own copy descriptor. Here the ids of one ``prepare_store`` come from
:class:`~kvcore.allocator.ContiguousSlotAllocator`: one ascending run whenever a free
run is long enough. Only which ids are picked changes; capacity, eviction, events and
statistics are the stock manager's, and the version guard checks the methods this
relies on. Where the worker pins the tier in steps (:mod:`kvcore_vllm.region_pinning`),
only chunks already pinned are handed out, the pool growing as the steps land. The
methods are written with vLLM 0.33's names; on a release that names the pool otherwise
(:mod:`kvcore_vllm.releases`) they are bound under its names as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import vllm.v1.kv_offload.cpu.policies.base as policies
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvcore.allocator import AllocatorStats, ContiguousSlotAllocator
from kvcore.metrics import Metrics
from kvcore.pin_progress import PinWatch
from kvcore_vllm.releases import installed_shape

_SHAPE = installed_shape()
# The chunk record the stock policies keep, its id field and the manager's count of ids
# handed out, as the installed release names them.
_STATUS: Any = getattr(policies, _SHAPE.name("ChunkStatus"))
_STATUS_ID = _SHAPE.name("chunk_id")
_ALLOCATED = _SHAPE.name("_num_allocated_chunks")
_POOL_SIZE = _SHAPE.name("_num_chunks")
# The chunk pool methods the stock manager calls, which the subclass overrides.
POOL_METHODS = ("_get_num_free_chunks", "_allocate_chunks", "_free_chunk")


class KVCoreCPUOffloadingManager(CPUOffloadingManager):
    """A :class:`CPUOffloadingManager` whose chunk pool is a ContiguousSlotAllocator."""

    def __init__(
        self,
        *args: Any,
        metrics: Metrics | None = None,
        pinned_keys: Sequence[str] = (),
        **kwargs: Any,
    ):
        """``pinned_keys``: the names of the workers' pinning progress where they may pin the
        tier in steps (one a worker); a chunk is ready once every worker has pinned it, and a
        worker with no such progress (it pinned its part whole) holds none back. Stock's own
        arguments go under the installed release's names (0.25's pool size is num_blocks),
        so the class stands wherever stock's is built."""
        super().__init__(*args, **kwargs)
        size = _pool_size(self)
        # vLLM's engine core builds the workers' KV caches, and with them the tier and its
        # progress file, before the scheduler that builds this manager: no file means the
        # worker pinned the tier whole.
        opened = [PinWatch.open(key) for key in pinned_keys]
        self._pinned = [watch for watch in opened if watch is not None]
        ready = min(self._pinned_ready(), size) if self._pinned else None
        self._allocator = ContiguousSlotAllocator(size, metrics=metrics, ready=ready)
        # Freed ids are handed back in one batch before the next allocation: evictions
        # arrive one chunk at a time, and one free call merges neighbouring runs once.
        self._released: list[int] = []

    @property
    def allocator_stats(self) -> AllocatorStats:
        """Contiguity of the allocations since construction or the last reset_cache()."""
        return self._allocator.stats

    def _get_num_free_chunks(self) -> int:
        self._take_pinned()
        self._take_stock_frees()
        return self._allocator.available_size() + len(self._released)

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[Any]:
        self._take_pinned()
        self._take_stock_frees()
        self._return_released()
        runs = self._allocator.alloc_runs(len(keys))
        # prepare_store evicts until enough chunks are free before it allocates.
        assert runs is not None, "chunk pool is short of what prepare_store freed"
        # Stock get_stats reads the chunks held as _num_allocated_chunks - len(_free_list);
        # what lands on _free_list is taken in before the pool is used, so
        # _num_allocated_chunks counts the chunks held and the difference stays right.
        self._count_allocated(len(keys))
        return [_STATUS(chunk_id) for start, n in runs for chunk_id in range(start, start + n)]

    def _free_chunk(self, chunk: Any) -> None:
        self._released.append(getattr(chunk, _STATUS_ID))
        self._count_allocated(-1)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._released.clear()
        self._allocator.clear()

    def _take_stock_frees(self) -> None:
        """Chunks freed onto stock's free list, as a subclass may free them (vLLM 0.34's
        tiering manager releases deferred writes that way): handed to kvcore's pool."""
        freed: list[int] = self._free_list
        if freed:
            self._released += freed
            self._count_allocated(-len(freed))
            freed.clear()

    def _pinned_ready(self) -> int:
        """Chunks every worker that pins in steps has pinned."""
        return min(watch.ready for watch in self._pinned)

    def _take_pinned(self) -> None:
        """Chunks the workers pinned since the last look, handed to the pool; once all are,
        the progress is no longer read."""
        if not self._pinned:
            return
        size = self._allocator.size
        ready = min(self._pinned_ready(), size)
        self._allocator.grow_ready(ready)
        if ready >= min(min(watch.total for watch in self._pinned), size):
            for watch in self._pinned:
                watch.close()
            self._pinned = []

    def _count_allocated(self, delta: int) -> None:
        setattr(self, _ALLOCATED, getattr(self, _ALLOCATED) + delta)

    def _return_released(self) -> None:
        if self._released:
            released = torch.tensor(self._released, dtype=torch.int64)
            self._released.clear()
            self._allocator.free(released)


for _method in POOL_METHODS:
    # The stock manager calls the pool methods by its release's names.
    setattr(
        KVCoreCPUOffloadingManager,
        _SHAPE.name(_method),
        getattr(KVCoreCPUOffloadingManager, _method),
    )


def _pool_size(manager: CPUOffloadingManager) -> int:
    """The pool size stock's constructor recorded."""
    size: int = getattr(manager, _POOL_SIZE)
    return size
