"""What the SGLang transfer hooks remember between calls, beside the requests.

:class:`HostIndexMemo` keeps the CPU host indices of each index tensor
``HiCacheController.move_indices`` moved to the GPU, so that a ``kernel``-backend call can
be planned without reading the GPU; :class:`LayerPairsMemo` keeps each pool's checked
buffer pairs, so that a layer's buffers are checked once, not once per call. Both are
state with their own locking, kept apart from the hooks that consult them. :class:`ByTensor`
is what the moved indices and the device indices read back
(:class:`kvcore_sglang.device_reads.DeviceIndexReads`) are kept in.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Generic, TypeVar

import torch

from kvcore.planning.layers import LayerPairs, layer_pairs
from kvcore.runs import version_of

Kept = TypeVar("Kept")


class ByTensor(Generic[Kept]):
    """Something kept for each of some tensors, by the tensor's identity (tensors compare
    element-wise, so they cannot be dict keys), while the tensor lives."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref[torch.Tensor], Kept]] = {}
        self._lock = threading.Lock()

    def _keep(self, tensor: torch.Tensor, kept: Kept) -> None:
        key = id(tensor)
        alive = weakref.ref(tensor, lambda _: self._forget(key))
        with self._lock:
            self._kept[key] = (alive, kept)

    def _kept_for(self, tensor: torch.Tensor) -> Kept | None:
        with self._lock:
            entry = self._kept.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._kept.get(key)
            if entry is not None and entry[0]() is None:
                del self._kept[key]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


class HostIndexMemo(ByTensor[tuple[torch.Tensor, int, int]]):
    """The CPU host indices of each host-index tensor ``move_indices`` moved to the GPU.

    Held while the moved tensor lives (SGLang keeps it until the transfer is queued);
    an entry is valid only while neither tensor was written since (their version counters),
    so that the moved tensor still holds the CPU one's values.
    """

    def remember(self, moved: torch.Tensor, on_cpu: torch.Tensor) -> None:
        """Keep ``on_cpu`` for ``moved``; not where either has no version counter (an
        inference tensor), whose later writes could not be seen: such a call runs stock."""
        on_cpu_version, moved_version = version_of(on_cpu), version_of(moved)
        if on_cpu_version is None or moved_version is None:
            return
        self._keep(moved, (on_cpu, on_cpu_version, moved_version))

    def recall(self, moved: torch.Tensor) -> torch.Tensor | None:
        kept = self._kept_for(moved)
        if kept is None or kept[0]._version != kept[1] or moved._version != kept[2]:
            return None
        return kept[0]


class LayerPairsMemo:
    """The checked buffer pairs (:class:`kvcore.planning.layers.LayerPairs`) of a pool's calls.

    A backup copies every layer of the pool, a load one layer's K and V: the same buffers
    call after call, so each set is checked once and its launch table built once (the
    CUDA kernels keep it per LayerPairs). Entries are keyed by every view's device,
    address, dtype, shape and strides, and kept per pool, weakly: they hold views of the
    pool's buffers (so no address in a key can be reused while it is kept), never the pool,
    and go when SGLang drops the pool.
    """

    def __init__(self, per_pool: int = 1024) -> None:
        self._per_pool = per_pool
        self._by_pool: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], LayerPairs]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._by_pool.clear()

    def pairs(self, pool: Any, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> LayerPairs:
        key = tuple(
            (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in (*srcs, *dsts)
        )
        with self._lock:
            try:
                kept = self._by_pool.setdefault(pool, {})
            except TypeError:  # a pool without weak references: checked every call
                return layer_pairs(srcs, dsts)
            found = kept.get(key)
        if found is not None:
            return found
        found = layer_pairs(srcs, dsts)
        with self._lock:
            if len(kept) >= self._per_pool:
                kept.clear()
            kept[key] = found
        return found
