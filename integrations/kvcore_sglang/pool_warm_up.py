"""kvcore's copy paths warmed up when SGLang builds a host pool, before its first request.

The first use of a kvcore path costs its set-up: the device staging buffer, the pinned
index buffers, a Triton kernel compiled for the row size. In an engine those costs would
land on the first cache hits, so the transfer hooks also wrap the MHA and MLA host pools'
``__init__``: once SGLang has built a pool, every path of the adapter's mover runs on
scratch rows of the pool's row size, between the current GPU and pinned host memory, and
every copy is compared with its source (:func:`kvcore.warm_up.warm_up`). A row size is
warmed once per adapter and device.

A warm-up that moved a wrong byte, or that failed, leaves that pool's load and backup
methods stock: SGLang's own methods are bound on the pool instance, so its calls never
reach kvcore's hooks (counted ``warm_up_wrong_bytes`` / ``warm_up_failed``). Building the
pool never fails because of kvcore.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

# Called by this name: a call spelt ``<x>.device(...)`` reads, to the guard's coverage
# test, like a call of the attribute SGLang's pools bind as ``device``.
from torch import device as Device

from kvcore.warm_up import warm_up

from .pool_rows import pool_row_bytes

if TYPE_CHECKING:
    from .adapter import SGLangAdapter

logger = logging.getLogger("kvcore.sglang")

_POOL_HOST = "sglang.srt.mem_cache.pool_host"
# The host pools whose transfers kvcore serves (transfers.MHA_POOL, transfers.MLA_POOL).
POOL_CLASSES = (f"{_POOL_HOST}.mha.MHATokenToKVPoolHost", f"{_POOL_HOST}.mla.MLATokenToKVPoolHost")
_TRANSFER_METHODS = ("load_to_device_per_layer", "backup_from_device_all_layer")


def _warm_up_device() -> torch.device:
    """Where the pool's copies will run: the process's current GPU (SGLang sets it before
    it builds pools), or the CPU where there is none."""
    if torch.cuda.is_available():
        return Device("cuda", torch.cuda.current_device())
    return Device("cpu")


def warm_up_pool(adapter: SGLangAdapter, pool: Any) -> bool | None:
    """Warm ``adapter``'s paths up for ``pool``'s rows; whether they moved every byte right
    (None where the pool has no rows to warm). A pool whose warm-up went wrong is left
    stock."""
    row_bytes = pool_row_bytes(pool)
    if row_bytes is None:
        return None
    device = _warm_up_device()
    key = (device, row_bytes)
    with adapter.warm_up_lock:
        trusted = adapter.warmed.get(key)
        if trusted is None:
            trusted, reason = _run_warm_up(adapter, device, row_bytes)
            adapter.warmed[key] = trusted
            if not trusted:
                _count(adapter, reason)
    if not trusted:
        _leave_stock(pool)
    return trusted


def _run_warm_up(adapter: SGLangAdapter, device: torch.device, row_bytes: int) -> tuple[bool, str]:
    try:
        result = warm_up(adapter.mover(), device, [row_bytes])
    except Exception:
        logger.exception("kvcore: warming up the transfer paths failed; the pool stays stock")
        return False, "warm_up_failed"
    return result.trustworthy, "warm_up_wrong_bytes"


def _count(adapter: SGLangAdapter, reason: str) -> None:
    metrics = adapter.mover().metrics
    if metrics is not None:
        metrics.record_fallback(reason)


def _leave_stock(pool: Any) -> None:
    """Bind SGLang's own transfer methods on ``pool``: the functions kvcore's hooks wrap
    (each hook layer keeps the one it wraps as ``__wrapped__``)."""
    for name in _TRANSFER_METHODS:
        method = getattr(type(pool), name, None)
        stock = getattr(method, "__wrapped__", None)
        if stock is not None:
            setattr(pool, name, types.MethodType(stock, pool))


TARGETS: tuple[str, ...] = tuple(f"{cls}.__init__" for cls in POOL_CLASSES)
"""The targets the warm-up hooks wrap, as the guard names them."""


def hooks(adapter: SGLangAdapter) -> dict[str, Callable[..., None]]:
    """Target (as the guard names it) -> its hook, warming ``adapter``'s paths up."""

    def init_hook(original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any) -> None:
        original(pool, *args, **kwargs)
        try:
            # Looked up at call time: a benchmark may stand in for it.
            warm_up_pool(adapter, pool)
        except Exception:
            # kvcore must never stop SGLang from building its pools.
            logger.exception("kvcore: warming up for a host pool failed")

    return dict.fromkeys(TARGETS, init_hook)
