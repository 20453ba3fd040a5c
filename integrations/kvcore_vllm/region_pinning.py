"""vLLM's shared CPU tier (0.33 and later) pinned in steps for one worker: a first share
before the engine goes on, the rest on a background thread (``KVCORE_HOST_POOL_PIN_FIRST``).

vLLM's worker registers its whole region with CUDA (``pin_mmap_region``, row-aligned
calls of up to 64 GiB) before the engine can serve, and registration runs at one rate on
one thread. While kvcore's spec builds the stock worker of a one-worker engine,
:func:`pinned_in_steps` stands in for ``pin_mmap_region``: it registers the region's chunk
rows in steps (:mod:`kvcore.stepwise_pinning`), the first before it returns (setting
``is_pinned``, as vLLM's own does), the rest from a thread, each step's rows faulted in by
every usable CPU just before they are registered (the region is built unfaulted, so the
engine waits for the first step's pages alone). The pinned prefix goes to a
:class:`~kvcore.pin_progress.PinProgress` named by the engine's id, which kvcore's manager
(:mod:`kvcore_vllm.manager`, the scheduler's side) reads to hand out only pinned chunks.

A copy never touches an unpinned row: every chunk the manager hands out is below the
prefix, and no copy spans two chunk rows (a row holds one chunk of every KV tensor, so a
tensor's neighbouring chunks lie a row apart), hence none spans two steps. The region's
``cleanup`` stops the thread first, then hands vLLM the addresses to unregister
(``pinned_addresses``) and removes the progress file. Where the rows cannot end on memory
pages or the first step fails, vLLM's own registration pins the region whole (counted).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvcore.host_pinning import CudaHostRegistrar, HostRegistrar, format_bytes
from kvcore.pin_progress import PinProgress
from kvcore.stepwise_pinning import PinStep, SlotLayout, StepwisePinning, slot_steps

logger = logging.getLogger("kvcore.vllm")

PIN_FN = "pin_mmap_region"
STEP_BYTES = 2 << 30
"""About how much of the tier each background step pins."""
MOST_BYTES_A_CALL = 64 << 30
"""vLLM registers no more than this in one call; kvcore's first step neither."""


def progress_key(spec: Any) -> str | None:
    """The name both sides of one engine give its tier's pinning progress (the engine's id,
    rank 0), or None where the spec has no engine id."""
    engine_id = getattr(getattr(spec, "config", None), "engine_id", None)
    return f"{engine_id}-r0" if engine_id else None


@contextlib.contextmanager
def pinned_in_steps(
    worker_module: Any,
    key: str,
    first_bytes: int,
    on_failure: Callable[[Exception], None],
    registrar_factory: Callable[[], HostRegistrar] = CudaHostRegistrar,
    fault: Callable[[int, int], None] | None = None,
) -> Iterator[None]:
    """Within the block, ``worker_module``'s (vLLM's ``gpu_worker``) ``pin_mmap_region``
    pins each region in steps, the first holding at least ``first_bytes``; where kvcore's
    steps cannot be made or the first fails (passed to ``on_failure``), vLLM's own runs.
    ``fault(address, bytes)``, for a region built unfaulted
    (:func:`kvcore_vllm.region_faulting.faulting_left_to_pinning`), faults each step's rows
    in just before they are registered, and the whole region before vLLM's own
    registration (which would fault it on one thread)."""
    stock = getattr(worker_module, PIN_FN)

    def pin(region: Any, *args: Any, **kwargs: Any) -> None:
        try:
            if _pin_rows(region, key, first_bytes, registrar_factory(), fault):
                return
        except Exception as exc:
            on_failure(exc)
        if fault is not None:
            try:
                fault(region._base.data_ptr(), int(region.total_size_bytes))
            except Exception as exc:  # vLLM's registration faults what is left
                on_failure(exc)
        stock(region, *args, **kwargs)

    setattr(worker_module, PIN_FN, pin)
    try:
        yield
    finally:
        setattr(worker_module, PIN_FN, stock)


def _pin_rows(
    region: Any,
    key: str,
    first_bytes: int,
    registrar: HostRegistrar,
    fault: Callable[[int, int], None] | None,
) -> bool:
    """Pin ``region``'s first rows now and start a thread for the rest; False where its rows
    cannot end on memory pages (nothing was pinned). Raises where the first step fails,
    with nothing left registered and no progress file."""
    rows, row_bytes = int(region.num_chunks), int(region._row_stride)
    layout = SlotLayout(region._base.data_ptr(), 1, rows * row_bytes, rows, row_bytes)
    steps = slot_steps(layout, 1, min(first_bytes, MOST_BYTES_A_CALL), STEP_BYTES)
    if steps is None or steps[0].nbytes > MOST_BYTES_A_CALL:
        return False
    started = time.perf_counter()
    progress = PinProgress(key, rows)

    def publish() -> None:
        progress.publish(pinning.ready_slots)

    try:
        pinning = StepwisePinning(
            steps,
            registrar,
            on_ready=publish,
            name="vLLM CPU tier",
            memory=region,
            prepare=None if fault is None else functools.partial(_fault_step, fault),
        )
        pinning.pin_first()
    except Exception:
        progress.close()
        raise
    publish()
    region.is_pinned = True
    _stop_before_cleanup(region, pinning, progress)
    logger.info(
        "kvcore: vLLM's CPU tier pinned in %d steps: %s of %s before the engine goes on "
        "(%.1f s), the rest on a background thread",
        len(steps),
        format_bytes(steps[0].nbytes),
        format_bytes(layout.nbytes),
        time.perf_counter() - started,
    )
    pinning.start()
    return True


def _fault_step(fault: Callable[[int, int], None], step: PinStep) -> None:
    for address, nbytes in step.ranges:
        fault(address, nbytes)


def _stop_before_cleanup(region: Any, pinning: StepwisePinning, progress: PinProgress) -> None:
    """``region.cleanup`` (vLLM unregisters ``pinned_addresses`` there) once the thread has
    stopped and with every range it registered; the progress file goes with it."""
    cleanup = region.cleanup

    def stopped_then_cleaned_up() -> None:
        pinning.stop()
        region.pinned_addresses[:] = [address for address, _ in pinning.registered]
        progress.close()
        cleanup()

    region.cleanup = stopped_then_cleaned_up
