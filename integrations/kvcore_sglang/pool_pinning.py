"""SGLang's MHA and MLA host pools pinned in steps: a first share before SGLang goes on, the
rest on a background thread (``KVCORE_HOST_POOL_PIN_FIRST``).

SGLang registers a whole ``layer_first`` host pool with CUDA in one call while it builds
the pool. AROUND hooks on the MHA and MLA pools' ``init_kv_buffer`` build the buffer with
``pin_memory`` off for that one call, so SGLang allocates it (through kvcore's faulting
hook, :mod:`kvcore_sglang.host_memory`) but registers nothing. kvcore then registers it in
steps of slots (:mod:`kvcore.stepwise_pinning`): the first holding at least the setting's
bytes, the rest from a thread. The ranges go where SGLang keeps its own
(``_sglang_cuda_host_registered_ranges`` on the buffer), so SGLang's ``destroy`` unregisters
them; an AROUND hook on ``HostKVCache.destroy`` stops the thread first.

What keeps every copy on pinned memory:

- kvcore's slot allocator (:mod:`kvcore_sglang.host_slots`) hands out only slots already
  pinned, and ``available_size()`` grows as the steps land;
- the pool stays one registration per step and part, and one DMA may not span two (the
  driver refuses it): a call whose host slots run across a step's end
  (:func:`step_ends`) runs SGLang's stock copy (:mod:`kvcore_sglang.call_plans`). SGLang's
  ``kernel`` io backend reads the rows slot by slot, by their device address, wherever
  they are registered. SGLang's ``direct`` backend copies with the copy engines and may
  merge neighbouring pages: use this setting with the ``kernel`` backend (SGLang's
  default; ``kvcore launch sglang`` warns of the pair).

The pool is pinned whole, as SGLang would, where: the setting is 0; the pool does not pin or
is not one kvcore's allocator serves; the allocator is a storage backend's. Where there is no
CUDA registrar, no dimension of the buffer is the pool's slots (``page_first_direct`` and
the other page layouts), its parts do not start on memory pages, or kvcore's first step
fails (taken back whole), SGLang's own registration pins it, counted
``host_pool_stock:<type>``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvcore.config import KVCoreConfig
from kvcore.host_mapping import fell_back
from kvcore.host_pinning import CudaHostRegistrar, HostRegistrar, format_bytes
from kvcore.stepwise_pinning import StepwisePinning, slot_layout, slot_steps

from . import host_slots
from .guard import HOST_KV_CACHE
from .host_memory import is_default_allocator
from .host_slots import PINNING_ATTR
from .served_pools import MHA_POOL, MLA_POOL

logger = logging.getLogger("kvcore.sglang")

_COMMON = "sglang.srt.mem_cache.pool_host.common"
STEP_BYTES = 2 << 30
"""About how much of the pool each background step pins."""

RegistrarFactory = Callable[[], HostRegistrar]


def pinning_of(pool: Any) -> StepwisePinning | None:
    """The pool's stepwise pinning, or None where it was pinned whole."""
    return pool.__dict__.get(PINNING_ATTR)


def step_ends(pool: Any) -> np.ndarray | None:
    """Where one of the pool's registrations ends and the next begins, in slots; None
    where the pool is one registration a part."""
    pinning = pinning_of(pool)
    if pinning is None or len(pinning.steps) < 2:
        return None
    ends: np.ndarray = pinning.step_ends
    return ends


def hooks(
    config: KVCoreConfig,
    registrar: RegistrarFactory = CudaHostRegistrar,
    step_bytes: int = STEP_BYTES,
) -> dict[str, Callable[..., Any]]:
    """Target (as the guard names it) -> its hook, pinning ``config``'s first share, then
    steps of about ``step_bytes``, through the registrars ``registrar`` makes."""

    def init_kv_buffer_hook(original: Callable[..., Any], pool: Any) -> Any:
        return _init_kv_buffer(
            original, pool, (config.host_pool_pin_first, step_bytes), registrar, config.metrics
        )

    return {
        f"{MHA_POOL}.init_kv_buffer": init_kv_buffer_hook,
        f"{MLA_POOL}.init_kv_buffer": init_kv_buffer_hook,
        f"{HOST_KV_CACHE}.destroy": destroy_hook,
    }


def destroy_hook(original: Callable[..., Any], pool: Any) -> Any:
    """AROUND ``HostKVCache.destroy``: no step lands after SGLang unregisters the pool."""
    pinning = pool.__dict__.get(PINNING_ATTR)
    if pinning is not None:
        pinning.stop()
    return original(pool)


def _init_kv_buffer(
    original: Callable[..., Any],
    pool: Any,
    sizes: tuple[int, int],
    registrar: RegistrarFactory,
    counted: bool,
) -> Any:
    if _pinned_whole(pool, sizes[0]) is not None:
        return original(pool)
    try:
        chosen = registrar()
    except Exception as exc:
        fell_back(logger, exc, "SGLang pins its host pool itself", counted)
        return original(pool)
    pool.pin_memory = False
    try:
        buffer = original(pool)
    finally:
        pool.pin_memory = True
    try:
        pin_in_steps(pool, buffer, sizes, chosen)
    except Exception as exc:
        fell_back(logger, exc, "SGLang pins its host pool itself", counted)
        register = importlib.import_module(_COMMON)._cuda_host_register
        for each in buffer if isinstance(buffer, list | tuple) else (buffer,):
            register(each)
    return buffer


def _sglang_ranges_attr() -> str:
    """The buffer attribute where SGLang keeps the ranges it registered, for ``destroy()``
    to unregister, read from SGLang itself; AttributeError where the release keeps them
    elsewhere (SGLang then pins the pool itself)."""
    name: str = importlib.import_module(_COMMON)._CUDA_HOST_REGISTERED_RANGES_ATTR
    return name


def _pinned_whole(pool: Any, first_bytes: int) -> str | None:
    """Why the pool is pinned whole, as SGLang pins it; None where it may go in steps."""
    if first_bytes <= 0:
        return "KVCORE_HOST_POOL_PIN_FIRST is 0"
    if not getattr(pool, "pin_memory", False):
        return "the pool does not pin"
    if not host_slots.is_served(type(pool)):
        return "kvcore's slot allocator does not serve the pool"
    if not is_default_allocator(getattr(pool, "allocator", None)):
        return "a storage backend allocates the pool"
    if torch.version.hip is not None:
        return "on ROCm SGLang's default pools come from hipHostMalloc"
    if getattr(pool, "dcp_size", 1) != 1:
        # Slots the allocator hands out are then not the buffer's rows.
        return "decode context parallel shares a row among several slots"
    return None


def pin_in_steps(
    pool: Any, buffer: Any, sizes: tuple[int, int], registrar: HostRegistrar
) -> StepwisePinning:
    """Pin ``buffer``, the buffer of ``pool`` (its ``size``, ``page_size`` and ``layout``
    are read), its first step (``sizes[0]`` bytes or more) now and the rest, steps of about
    ``sizes[1]``, from a thread; the pinning, kept on the pool. ValueError where the
    buffer's layout has no steps; a failure of the first step is raised, nothing left
    registered."""
    ranges_attr = _sglang_ranges_attr()
    layout = slot_layout(buffer, pool.size) if isinstance(buffer, torch.Tensor) else None
    steps = None if layout is None else slot_steps(layout, pool.page_size, *sizes)
    if layout is None or steps is None:
        raise ValueError(f"the {pool.layout} buffer cannot be pinned in steps of slots")
    pool_ref = weakref.ref(pool)
    pinning = StepwisePinning(
        steps,
        registrar,
        on_ready=lambda: _grow(pool_ref, pinning),
        name=f"{type(pool).__name__} host pool",
        memory=buffer,
    )
    started = time.perf_counter()
    pinning.pin_first()
    setattr(buffer, ranges_attr, pinning.registered)
    pool.__dict__[PINNING_ATTR] = pinning
    logger.info(
        "kvcore: %s of the %s host pool pinned in %.1f s (%d of %d slots); the rest pins in "
        "%d steps on a background thread",
        format_bytes(steps[0].nbytes),
        format_bytes(layout.nbytes),
        time.perf_counter() - started,
        pinning.ready_slots,
        layout.slots,
        len(steps) - 1,
    )
    pinning.start()
    return pinning


def _grow(pool_ref: weakref.ref[Any], pinning: StepwisePinning) -> None:
    """Hand the slots of a step that landed to the pool's allocator, under the pool's lock
    (SGLang makes it after the buffer, so a step may land before it exists)."""
    pool = pool_ref()
    if pool is None:
        return
    while True:
        lock = pool.__dict__.get("lock")
        with lock if lock is not None else contextlib.nullcontext(), pinning.lock:
            served = host_slots.served_slots(pool)
            if served is None:
                return  # clear() has not run: it reads ready_slots itself
            if lock is None:
                continue  # the pool made its lock meanwhile: take it
            host_slots.grow_ready(pool, served, pinning.ready_slots)
            if pinning.done:
                logger.info("kvcore: the %s host pool is pinned whole", type(pool).__name__)
            return
