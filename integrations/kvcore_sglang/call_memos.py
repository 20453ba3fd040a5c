"""What the SGLang transfer hooks remember between calls, beside the requests.

:class:`HostIndexMemo` keeps the CPU host indices of each index tensor
``HiCacheController.move_indices`` moved to the GPU, so that a ``kernel``-backend call can
be planned without reading the GPU; :class:`LayerPairsMemo` keeps each pool's checked
buffer pairs, so that a layer's buffers are checked once, not once per call. Both are
state with their own locking, kept apart from the hooks that consult them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from kvcore.planning.layers import LayerPairs, layer_pairs
from kvcore.runs import version_of


class HostIndexMemo:
    """The CPU host indices of each host-index tensor ``move_indices`` moved to the GPU.

    Held while the moved tensor lives (SGLang keeps it until the transfer is queued);
    an entry is valid only while neither tensor was written since (their version counters),
    so that the moved tensor still holds the CPU one's values.
    Keyed by identity: tensors compare element-wise, so they cannot be dict keys.
    """

    def __init__(self) -> None:
        self._moved: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int, int]] = {}
        self._lock = threading.Lock()

    def remember(self, moved: torch.Tensor, on_cpu: torch.Tensor) -> None:
        """Keep ``on_cpu`` for ``moved``; not where either has no version counter (an
        inference tensor), whose later writes could not be seen: such a call runs stock."""
        on_cpu_version, moved_version = version_of(on_cpu), version_of(moved)
        if on_cpu_version is None or moved_version is None:
            return
        key = id(moved)
        alive = weakref.ref(moved, lambda _: self._forget(key))
        with self._lock:
            self._moved[key] = (alive, on_cpu, on_cpu_version, moved_version)

    def recall(self, moved: torch.Tensor) -> torch.Tensor | None:
        with self._lock:
            entry = self._moved.get(id(moved))
        if (
            entry is None
            or entry[0]() is not moved
            or entry[1]._version != entry[2]
            or moved._version != entry[3]
        ):
            return None
        return entry[1]

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._moved.get(key)
            if entry is not None and entry[0]() is None:
                del self._moved[key]

    def clear(self) -> None:
        with self._lock:
            self._moved.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._moved)


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
