"""vLLM's CPU offloading manager with host chunk ids from kvcore's contiguous allocator.

Stock vLLM hands out chunk ids from a bump counter, then from a LIFO free list, so
under churn a request's chunks scatter (often in descending order) and every chunk
becomes its own copy descriptor. Here the ids of one ``prepare_store`` come from
:class:`~kvcore.allocator.ContiguousSlotAllocator`: one ascending run whenever a free
run is long enough. Only which ids are picked changes; capacity, eviction, events and
statistics are the stock manager's, and the version guard checks the methods this
relies on.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvcore.allocator import AllocatorStats, ContiguousSlotAllocator
from kvcore.metrics import Metrics


class KVCoreCPUOffloadingManager(CPUOffloadingManager):
    """A :class:`CPUOffloadingManager` whose chunk pool is a ContiguousSlotAllocator."""

    def __init__(self, num_chunks: int, *args: Any, metrics: Metrics | None = None, **kwargs: Any):
        super().__init__(num_chunks, *args, **kwargs)
        self._allocator = ContiguousSlotAllocator(num_chunks, metrics=metrics)
        # Freed ids are handed back in one batch before the next allocation: evictions
        # arrive one chunk at a time, and one free call merges neighbouring runs once.
        self._released: list[int] = []

    @property
    def allocator_stats(self) -> AllocatorStats:
        """Contiguity of the allocations since construction or the last reset_cache()."""
        return self._allocator.stats

    def _get_num_free_chunks(self) -> int:
        return self._allocator.available_size() + len(self._released)

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
        self._return_released()
        runs = self._allocator.alloc_runs(len(keys))
        # prepare_store evicts until enough chunks are free before it allocates.
        assert runs is not None, "chunk pool is short of what prepare_store freed"
        # Stock get_stats reads the chunks held as _num_allocated_chunks - len(_free_list);
        # _free_list stays empty here, so _num_allocated_chunks counts the chunks held.
        self._num_allocated_chunks += len(keys)
        return [ChunkStatus(chunk_id) for start, n in runs for chunk_id in range(start, start + n)]

    def _free_chunk(self, chunk: ChunkStatus) -> None:
        self._released.append(chunk.chunk_id)
        self._num_allocated_chunks -= 1

    def reset_cache(self) -> None:
        super().reset_cache()
        self._released.clear()
        self._allocator.clear()

    def _return_released(self) -> None:
        if self._released:
            released = torch.tensor(self._released, dtype=torch.int64)
            self._released.clear()
            self._allocator.free(released)
