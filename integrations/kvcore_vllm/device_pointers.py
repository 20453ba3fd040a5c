"""A vLLM 0.34 job's GPU blocks, read back from the device pointers its connector resolved.

From 0.34 the offload handler holds no GPU tensors: the connector turns a job's GPU block
ids into one address per (block, layer reference), group by group, and hands over those
(``DevicePointers``). kvcore plans copies as rows of tensors, so its handler takes the GPU
tensors from the worker's ``CanonicalKVCaches`` (:func:`gpu_rows`) and recovers the block
ids from the addresses (:class:`PointerReader`). Every address is checked against the
block it names, so a job whose addresses are not exactly rows of those tensors goes to
stock's copy (counted) rather than to a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def gpu_rows(kv_cache_tensor: Any) -> torch.Tensor:
    """One ``CanonicalKVCacheTensor`` as int8 rows ``[blocks, page_size_bytes]``, a block
    every row stride of the tensor: the bytes a copy of a block reads or writes."""
    tensor: torch.Tensor = kv_cache_tensor.tensor
    size = tensor.element_size()
    rows = torch.empty(0, dtype=torch.int8, device=tensor.device)
    rows.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * size,
        (tensor.shape[0], int(kv_cache_tensor.page_size_bytes)),
        (tensor.stride(0) * size, 1),
    )
    return rows


@dataclass(frozen=True)
class PointerJob:
    """The GPU side of one job, in the terms of a job with block ids."""

    gpu_ids: np.ndarray
    """The GPU block ids, group after group."""
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


class PointerReader:
    """Reads block ids back from the addresses of rows of ``tensors`` (int8 rows, one per
    block), for groups that reference ``tensors_per_group`` (tensor indices per group, in
    the order of the group's layer references)."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], tensors_per_group: Sequence[Sequence[int]]
    ) -> None:
        self._bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
        self._strides = np.array([t.stride(0) * t.element_size() for t in tensors], np.uint64)
        self._blocks = np.array([t.shape[0] for t in tensors], dtype=np.uint64)
        self._refs = tuple(np.asarray(group, dtype=np.intp) for group in tensors_per_group)
        self._ref_counts = tuple(len(group) for group in tensors_per_group)

    def read(self, pointers: Any) -> PointerJob | str:
        """The job ``pointers`` (a ``DevicePointers``) describes, or why its addresses are
        not exactly rows of this reader's tensors."""
        sizes = tuple(int(n) for n in pointers.group_block_counts)
        if tuple(pointers.group_data_ref_counts) != self._ref_counts:
            return "device_pointers_groups"
        addresses = np.asarray(pointers.ptrs, dtype=np.uint64)
        if len(addresses) != sum(n * refs for n, refs in zip(sizes, self._ref_counts, strict=True)):
            return "device_pointers_groups"
        ids: list[np.ndarray] = []
        at = 0
        for size, refs in zip(sizes, self._refs, strict=True):
            if size == 0:
                continue
            group = addresses[at : at + size * len(refs)].reshape(len(refs), size)
            at += size * len(refs)
            block_ids = self._block_ids(group, refs)
            if block_ids is None:
                return "device_pointers_unknown"
            ids.append(block_ids)
        gpu_ids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        return PointerJob(gpu_ids, sizes, tuple(int(i) for i in pointers.block_indices))

    def _block_ids(self, group: np.ndarray, refs: np.ndarray) -> np.ndarray | None:
        """The block of every column of ``group`` (one row of addresses per reference), or
        None where any address is not the start of that block's row in its tensor."""
        first = int(refs[0])
        base, stride = self._bases[first], self._strides[first]
        if (group[0] < base).any():
            return None
        offsets = group[0] - base
        block_ids = offsets // stride
        if (offsets % stride).any() or (block_ids >= self._blocks[refs].min()).any():
            return None
        expected = self._bases[refs][:, None] + block_ids[None, :] * self._strides[refs][:, None]
        if not np.array_equal(group, expected):
            return None
        return block_ids.astype(np.int64)
