"""kvcore's copy paths warmed up when SGLang builds a host pool, before its first request.

The first use of a kvcore path costs its set-up: the device staging buffer, the pinned
index buffers, a Triton kernel compiled for the row size. In an engine those costs would
land on the first cache hits, so the transfer hooks also wrap the MHA and MLA host pools'
``__init__``: once SGLang has built a pool, every path of the process's mover runs on
scratch rows of the pool's row size, between the current GPU and pinned host memory, and
every copy is compared with its source (:func:`kvcore.warm_up.warm_up`). A row size is
warmed once per process and device.

A warm-up that moved a wrong byte, or that failed, leaves that pool's load and backup
methods stock: SGLang's own methods are bound on the pool instance, so its calls never
reach kvcore's hooks (counted ``warm_up_wrong_bytes`` / ``warm_up_failed``). Building the
pool never fails because of kvcore.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

# Called by this name: a call spelt ``<x>.device(...)`` reads, to the guard's coverage
# test, like a call of the attribute SGLang's pools bind as ``device``.
from torch import device as Device

from kvcore.warm_up import warm_up

from . import hook_mover

logger = logging.getLogger("kvcore.sglang")

_POOL_HOST = "sglang.srt.mem_cache.pool_host"
# The host pools whose transfers kvcore serves (transfers.MHA_POOL, transfers.MLA_POOL).
POOL_CLASSES = (f"{_POOL_HOST}.mha.MHATokenToKVPoolHost", f"{_POOL_HOST}.mla.MLATokenToKVPoolHost")
# Host layouts whose buffer's last two dimensions are one token's row of one layer (heads x
# head dim, or 1 x the MLA row), the rows kvcore's jobs copy.
_TOKEN_ROW_LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct"})
_TRANSFER_METHODS = ("load_to_device_per_layer", "backup_from_device_all_layer")

_lock = threading.Lock()
# (device, row bytes) -> whether its warm-up moved every byte right.
_WARMED: dict[tuple[torch.device, int], bool] = {}


def _warm_up_device() -> torch.device:
    """Where the pool's copies will run: the process's current GPU (SGLang sets it before
    it builds pools), or the CPU where there is none."""
    if torch.cuda.is_available():
        return Device("cuda", torch.cuda.current_device())
    return Device("cpu")


def pool_row_bytes(pool: Any) -> int | None:
    """Bytes of one token's row of one layer in ``pool``'s host buffer; None where its
    layout has no such row (or the buffer is not built yet)."""
    buffer = getattr(pool, "kv_buffer", None)
    if getattr(pool, "layout", None) not in _TOKEN_ROW_LAYOUTS:
        return None
    if not isinstance(buffer, torch.Tensor) or buffer.dim() < 3:
        return None
    return int(buffer.shape[-2] * buffer.shape[-1] * buffer.element_size())


def warm_up_pool(pool: Any) -> bool | None:
    """Warm kvcore's paths up for ``pool``'s rows; whether they moved every byte right (None
    where the pool has no rows to warm). A pool whose warm-up went wrong is left stock."""
    row_bytes = pool_row_bytes(pool)
    if row_bytes is None:
        return None
    device = _warm_up_device()
    key = (device, row_bytes)
    with _lock:
        trusted = _WARMED.get(key)
        if trusted is None:
            trusted, reason = _run_warm_up(device, row_bytes)
            _WARMED[key] = trusted
            if not trusted:
                _count(reason)
    if not trusted:
        _leave_stock(pool)
    return trusted


def _run_warm_up(device: torch.device, row_bytes: int) -> tuple[bool, str]:
    try:
        result = warm_up(hook_mover.mover(), device, [row_bytes])
    except Exception:
        logger.exception("kvcore: warming up the transfer paths failed; the pool stays stock")
        return False, "warm_up_failed"
    return result.trustworthy, "warm_up_wrong_bytes"


def _count(reason: str) -> None:
    metrics = hook_mover.mover().metrics
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


def forget() -> None:
    """Warm every row size up again (a test, or a new mover)."""
    with _lock:
        _WARMED.clear()


def _init_hook(original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any) -> None:
    original(pool, *args, **kwargs)
    try:
        warm_up_pool(pool)
    except Exception:
        # kvcore must never stop SGLang from building its pools.
        logger.exception("kvcore: warming up for a host pool failed")


# Target (as the guard names it) -> hook.
HOOKS: dict[str, Callable[..., None]] = {f"{cls}.__init__": _init_hook for cls in POOL_CLASSES}
