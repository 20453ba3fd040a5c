"""HostKVCache's slot allocator served by kvcore's ContiguousSlotAllocator.

Four AROUND hooks on ``HostKVCache`` (clear, available_size, alloc, free). A pool
of a served class gets a ContiguousSlotAllocator in ``clear()``; every other pool,
and a served pool built before the hooks were applied, keeps SGLang's own code.

SGLang's contracts kept: the page-alignment AssertionError, None exactly when
``need_size > available_size()``, the double-alloc / double-free AssertionErrors
with SGLang's messages, an exact ``available_size()``, ``free()`` returning the
number of slots it was given, and the pool's lock held (an AROUND hook runs outside
the ``@synchronized`` wrapper it replaces, so it takes ``self.lock`` itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore.allocator import ContiguousSlotAllocator
from kvcore.metrics import METRICS

# The per-pool allocator lives on the pool instance, created by the clear() hook:
# every host pool constructor (including the K-only and DSA pools, which skip
# HostKVCache.__init__) ends by calling clear(), and clear() is also SGLang's reset,
# so state is created and reset exactly where the stock code creates and resets it.
SLOTS_ATTR = "_kvcore_slots"

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


def slots_of(pool: Any) -> ContiguousSlotAllocator | None:
    """The pool's kvcore allocator, or None when the pool runs SGLang's own."""
    return pool.__dict__.get(SLOTS_ATTR)


def clear_hook(original: Callable[..., Any], pool: Any) -> None:
    if not is_served(type(pool)):
        original(pool)
        return
    with pool.lock:
        pool.__dict__[SLOTS_ATTR] = ContiguousSlotAllocator(
            pool.logical_size, pool.logical_page_size, metrics=METRICS
        )


def available_size_hook(original: Callable[..., Any], pool: Any) -> int:
    slots = slots_of(pool)
    if slots is None:
        return original(pool)
    return slots.available_size()


def alloc_hook(original: Callable[..., Any], pool: Any, need_size: int) -> torch.Tensor | None:
    slots = slots_of(pool)
    if slots is None:
        return original(pool, need_size)
    with pool.lock:
        assert need_size % pool.logical_page_size == 0, (
            "The requested size should be a multiple of the page size."
        )
        if need_size > slots.available_size():
            return None
        # The allocator refuses to hand out a used page (RuntimeError), so SGLang's
        # double-alloc assertion cannot fire here.
        return slots.alloc(need_size)


def free_hook(original: Callable[..., Any], pool: Any, indices: torch.Tensor) -> int:
    slots = slots_of(pool)
    if slots is None:
        return original(pool, indices)
    with pool.lock:
        indices_cpu = indices.cpu()
        if indices_cpu.numel() == 0:
            return 0
        used = slots.page_used[indices_cpu // slots.page_size]
        assert used.all(), (
            f"Double-free detected: slots not currently allocated: {indices_cpu[~used].tolist()}."
        )
        slots.free(indices_cpu)
        return len(indices)


HOOKS: dict[str, Callable[..., Any]] = {
    "clear": clear_hook,
    "available_size": available_size_hook,
    "alloc": alloc_hook,
    "free": free_hook,
}
