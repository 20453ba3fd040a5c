"""HostKVCache's slot allocator served by kvcore's ContiguousSlotAllocator.

Four AROUND hooks on ``HostKVCache`` (clear, available_size, alloc, free). A pool
of a served class gets a ContiguousSlotAllocator in ``clear()``; every other pool,
and a served pool built before the hooks were applied, keeps SGLang's own code.

SGLang's contracts kept: the page-alignment AssertionError, None exactly when
``need_size > available_size()``, the double-alloc / double-free AssertionErrors
and the IndexError of a slot out of range, with SGLang's messages, an exact
``available_size()``, ``free()`` returning the number of slots it was given, and
the pool's lock held (an AROUND hook runs outside the ``@synchronized`` wrapper it
replaces, so it takes ``self.lock`` itself).

Stock's public slot state stays on the pool and true after every call: ``slot_used``
(one flag per slot), ``free_slots`` (every free slot, in no set order: a view of a
:class:`~kvcore.free_list.FreeSlotList`, so read it again after a call rather than
keep an earlier one), ``release_slots`` / ``num_release_slots`` (always empty: a
freed slot is in ``free_slots`` at once) and ``mem_state`` (zeros, which stock never
changes either). Frees stock takes and corrupts its free list with (a slot twice in
one call, part of a page, a negative slot) get the allocator's ValueError instead,
with nothing changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.allocator import ContiguousSlotAllocator, DoubleAllocationError, expand_runs
from kvcore.free_list import FreeSlotList
from kvcore.metrics import METRICS

# The per-pool ServedSlots live on the pool instance, created by the clear() hook:
# every host pool constructor (including the K-only and DSA pools, which skip
# HostKVCache.__init__) ends by calling clear(), and clear() is also SGLang's reset,
# so state is created and reset exactly where the stock code creates and resets it.
SLOTS_ATTR = "_kvcore_slots"
# A pool kvcore pins in steps keeps its kvcore.stepwise_pinning.StepwisePinning here
# (kvcore_sglang.pool_pinning): its allocator hands out only the slots pinned so far.
PINNING_ATTR = "_kvcore_pinning"

_POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"
# Pool classes kvcore serves: they use HostKVCache's allocator unchanged and are
# covered by the adapter's tests.
SERVED_POOLS: frozenset[str] = frozenset(
    {
        f"{_POOL_PACKAGE}.mha.MHATokenToKVPoolHost",
        f"{_POOL_PACKAGE}.mha.AsymmetricMHATokenToKVPoolHost",
        f"{_POOL_PACKAGE}.mha.MHATokenToKOnlyPoolHost",
        f"{_POOL_PACKAGE}.mla.MLATokenToKVPoolHost",
        f"{_POOL_PACKAGE}.dsa.DSAIndexerPoolHost",
    }
)
_OWN_ALLOCATOR = "has its own slot allocator; stays stock"
_UNTESTED = "inherits HostKVCache's allocator but is not covered by kvcore's tests; stays stock"
# Host pools that stay stock, with why; reported by the plugin.
STOCK_POOLS: dict[str, str] = {
    f"{_POOL_PACKAGE}.mamba.MambaPoolHost": _OWN_ALLOCATOR,
    "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool": _OWN_ALLOCATOR,
    "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool": _OWN_ALLOCATOR,
    "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4StateHostPool": _OWN_ALLOCATOR,
    f"{_POOL_PACKAGE}.qsa.QSAIndexerPoolHost": _OWN_ALLOCATOR,
    f"{_POOL_PACKAGE}.page_interleave.PageInterleaveHostPool": _OWN_ALLOCATOR,
    f"{_POOL_PACKAGE}.unified.UnifiedPageEnvelopeHostPool": _OWN_ALLOCATOR,
    f"{_POOL_PACKAGE}.mha.HiSparseMHATokenToKVPoolHost": _UNTESTED,
    f"{_POOL_PACKAGE}.mha_mxfp8.MHATokenToKVPoolMXFP8Host": _UNTESTED,
    f"{_POOL_PACKAGE}.minimax_m3_nvfp4.MiniMaxM3Nvfp4IndexKPoolHost": _UNTESTED,
    f"{_POOL_PACKAGE}.minimax_m3_nvfp4.MiniMaxM3Nvfp4MainKVPoolHost": _UNTESTED,
}
_SLOT_METHODS = ("clear", "available_size", "alloc", "free")

_served_by_type: dict[type, bool] = {}


def is_served(pool_type: type) -> bool:
    """Whether pools of ``pool_type`` get kvcore's allocator: a served class that still
    inherits all four slot methods from HostKVCache itself."""
    served = _served_by_type.get(pool_type)
    if served is None:
        name = f"{pool_type.__module__}.{pool_type.__qualname__}"
        served = name in SERVED_POOLS and all(
            _defining_class(pool_type, method).__qualname__ == "HostKVCache"
            for method in _SLOT_METHODS
        )
        _served_by_type[pool_type] = served
    return served


def _defining_class(pool_type: type, method: str) -> type:
    return next(klass for klass in pool_type.__mro__ if method in vars(klass))


@dataclass(frozen=True)
class ServedSlots:
    """What a served pool's slot methods work on."""

    allocator: ContiguousSlotAllocator
    # Behind the pool's ``free_slots``.
    free_list: FreeSlotList
    # The pool's ``slot_used``, seen through numpy: torch's indexing of a CPU tensor
    # costs far more per call, and turns parallel on large indices.
    used: np.ndarray


def served_slots(pool: Any) -> ServedSlots | None:
    """The pool's kvcore state, or None when the pool runs SGLang's own allocator."""
    return pool.__dict__.get(SLOTS_ATTR)


def slots_of(pool: Any) -> ContiguousSlotAllocator | None:
    """The pool's kvcore allocator, or None when the pool runs SGLang's own."""
    served = served_slots(pool)
    return None if served is None else served.allocator


def clear_hook(original: Callable[..., Any], pool: Any) -> None:
    if not is_served(type(pool)):
        original(pool)
        return
    pinning = pool.__dict__.get(PINNING_ATTR)
    with pool.lock, pinning.lock if pinning is not None else contextlib.nullcontext():
        size, page_size = pool.logical_size, pool.logical_page_size
        ready = None if pinning is None else pinning.ready_slots
        served = ServedSlots(
            ContiguousSlotAllocator(size, page_size, metrics=METRICS, ready=ready),
            FreeSlotList(size, page_size),
            np.zeros(size, dtype=np.bool_),
        )
        if ready is not None:
            served.free_list.take(np.arange(ready // page_size, size // page_size))
        pool.__dict__[SLOTS_ATTR] = served
        pool.mem_state = torch.zeros((size,), dtype=torch.uint8, device=pool.device)
        pool.free_slots = served.free_list.slots
        pool.release_slots = []
        pool.num_release_slots = 0
        pool.slot_used = torch.from_numpy(served.used)


def grow_ready(pool: Any, served: ServedSlots, ready: int) -> None:
    """Slots ``[0, ready)`` of the pool may be handed out from now on (its memory is
    pinned that far); the caller holds the pool's lock."""
    allocator = served.allocator
    page_size = allocator.page_size
    before = allocator.ready_size
    allocator.grow_ready(ready)
    after = allocator.ready_size
    if after > before:
        served.free_list.give_back(np.arange(before // page_size, after // page_size))
        pool.free_slots = served.free_list.slots


def available_size_hook(original: Callable[..., Any], pool: Any) -> int:
    served = served_slots(pool)
    if served is None:
        return original(pool)
    return served.allocator.available_size()


def alloc_hook(original: Callable[..., Any], pool: Any, need_size: int) -> torch.Tensor | None:
    served = served_slots(pool)
    if served is None:
        return original(pool, need_size)
    with pool.lock:
        assert need_size % pool.logical_page_size == 0, (
            "The requested size should be a multiple of the page size."
        )
        allocator = served.allocator
        if need_size > allocator.available_size():
            return None
        # When either double-alloc assertion fires, the picked slots have left the free
        # list and slot_used is unchanged, as stock leaves them.
        try:
            selected = allocator.alloc(need_size)
        except DoubleAllocationError as error:
            _take(pool, served, expand_runs(error.runs).numpy())
            raise AssertionError(_double_alloc(error.slots)) from None
        assert selected is not None
        ids = selected.numpy()
        _take(pool, served, ids)
        taken = served.used[ids]
        assert not taken.any(), _double_alloc(ids[taken].tolist())
        served.used[ids] = True
        return selected


def free_hook(original: Callable[..., Any], pool: Any, indices: torch.Tensor) -> int:
    served = served_slots(pool)
    if served is None:
        return original(pool, indices)
    with pool.lock:
        indices_cpu = indices.cpu()
        if indices_cpu.numel() == 0:
            return 0
        # Stock's check before the allocator's, so that its errors come out as they are.
        used = _used_at(pool, served, indices_cpu)
        assert used.numpy().all(), (
            f"Double-free detected: slots not currently allocated: {indices_cpu[~used].tolist()}."
        )
        allocator = served.allocator
        allocator.free(indices_cpu)
        ids = indices_cpu.to(torch.int64).numpy()
        served.used[ids] = False
        served.free_list.give_back(_freed_pages(ids, allocator.page_size))
        pool.free_slots = served.free_list.slots
        return len(indices)


def _take(pool: Any, served: ServedSlots, ids: np.ndarray) -> None:
    """Drop ``ids`` (whole pages, as the allocator hands them out) from ``free_slots``."""
    page_size = served.allocator.page_size
    served.free_list.take(ids[::page_size] // page_size)
    pool.free_slots = served.free_list.slots


def _used_at(pool: Any, served: ServedSlots, indices: torch.Tensor) -> torch.Tensor:
    """``pool.slot_used[indices]``, read through numpy where that reads the same."""
    size = len(served.used)
    if indices.dtype in _NUMPY_INDEX_DTYPES and indices.dim() == 1:
        ids = indices.numpy()
        if -size <= ids.min() and ids.max() < size:
            return torch.from_numpy(served.used[ids])
    # Anything else gets torch's own indexing, and so stock's result or error.
    return pool.slot_used[indices]


def _freed_pages(ids: np.ndarray, page_size: int) -> np.ndarray:
    """Page ids of ``ids``, which the allocator has checked are whole, distinct pages
    (a page's slots in any order)."""
    if page_size == 1:
        return ids
    return ids[ids % page_size == 0] // page_size


def _double_alloc(slots: list[int]) -> str:
    return f"Double-alloc detected: slots already allocated: {slots}."


_NUMPY_INDEX_DTYPES = frozenset({torch.int64, torch.int32})


HOOKS: dict[str, Callable[..., Any]] = {
    "clear": clear_hook,
    "available_size": available_size_hook,
    "alloc": alloc_hook,
    "free": free_hook,
}
