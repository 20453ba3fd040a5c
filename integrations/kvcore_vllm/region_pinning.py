"""vLLM's shared CPU tier (0.33 and later) pinned in steps by each worker: a first share
before the engine goes on, the rest on a background thread (``KVCORE_HOST_POOL_PIN_FIRST``).

vLLM's worker registers its region with CUDA (``pin_mmap_region``: row-aligned calls of up
to 64 GiB, or, a worker of several, its own slot of each row) before the engine can serve,
and registration runs at one rate on one thread. While kvcore's spec builds the stock
worker, :func:`pinned_in_steps` stands in for ``pin_mmap_region``: it registers the same
ranges in steps of rows (:mod:`kvcore.stepwise_pinning`), the first before it returns
(setting ``is_pinned``, as vLLM's own does), the rest from a thread, each step's rows
faulted in just before they are registered (the region is built unfaulted, so the engine
waits for the first step's pages alone). Each worker's pinned prefix goes to a
:class:`~kvcore.pin_progress.PinProgress` named by the engine's id and its rank, which
kvcore's manager (:mod:`kvcore_vllm.manager`, the scheduler's side) reads, every worker's,
to hand out only chunks pinned everywhere.

A copy never touches an unpinned row: every chunk the manager hands out is below each
prefix, and no copy spans two chunk rows (a row holds one chunk of every KV tensor, so a
tensor's neighbouring chunks lie a row apart), hence none spans two steps. The region's
``cleanup`` stops the thread first, then hands vLLM the addresses to unregister
(``pinned_addresses``) and removes the progress file. Where whole rows cannot end on
memory pages or the first step fails, vLLM's own registration pins the region (counted).
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
from kvcore.stepwise_pinning import (
    PinStep,
    SlotLayout,
    StepwisePinning,
    range_steps,
    round_up,
    slot_steps,
)
from kvcore_vllm.region_faulting import FaultRange

logger = logging.getLogger("kvcore.vllm")

PIN_FN = "pin_mmap_region"
STEP_BYTES = 2 << 30
"""About how much of the tier each background step pins."""
MOST_BYTES_A_CALL = 64 << 30
"""vLLM registers no more than this in one call; kvcore's first step neither."""
FAULTED_AHEAD = 8
"""How many steps the thread faults at once, ahead of the one it registers: vLLM splits the
region into files (32 at most, of 1 GiB or more), one step's rows lie in one or two, and one
file's pages fault in at a capped rate however many threads fault them (docs/operations.md:
16 threads over one file 4.2 GiB/s, over eight 14.2)."""


MIN_SAVED = "MIN_HOST_REGISTER_SAVED_BYTES"
"""vLLM's worker module's least saving per row for which a worker registers its own slot of
each row rather than whole rows (0.33 on)."""


def progress_key(spec: Any, rank: int | None = None) -> str | None:
    """The name a worker (``rank``, default the spec's own) and the scheduler give that
    worker's pinning progress of the engine's tier (the engine's id and the rank), or None
    where the spec has no engine id."""
    config = getattr(spec, "config", None)
    engine_id = getattr(config, "engine_id", None)
    if not engine_id:
        return None
    if rank is None:
        rank = int(getattr(getattr(config, "parallel", None), "rank", 0) or 0)
    return f"{engine_id}-r{rank}"


def progress_keys(spec: Any, workers: int) -> tuple[str, ...]:
    """Every worker's :func:`progress_key` (the scheduler reads them all), or none where
    the spec has no engine id."""
    keys = (progress_key(spec, rank) for rank in range(workers))
    return tuple(key for key in keys if key is not None)


@contextlib.contextmanager
def pinned_in_steps(
    worker_module: Any,
    key: str,
    first_bytes: int,
    on_failure: Callable[[Exception], None],
    registrar_factory: Callable[[], HostRegistrar] = CudaHostRegistrar,
    fault: FaultRange | None = None,
) -> Iterator[None]:
    """Within the block, ``worker_module``'s (vLLM's ``gpu_worker``) ``pin_mmap_region``
    pins each region in steps, the first holding at least ``first_bytes``; where kvcore's
    steps cannot be made or the first fails (passed to ``on_failure``), vLLM's own runs.
    ``fault(address, bytes)``, for a region built unfaulted
    (:func:`kvcore_vllm.region_faulting.faulting_left_to_pinning`), faults each step's rows
    in just before they are registered, and what vLLM's own registration would take before
    it runs (which would fault it on one thread). A worker of several registers only its
    slot of each row where vLLM would (``worker_slot_only``, when the rest of a row saves
    enough), in steps of rows all the same."""
    stock = getattr(worker_module, PIN_FN)

    def pin(region: Any, *args: Any, **kwargs: Any) -> None:
        slot_only = bool(kwargs.get("worker_slot_only", args[0] if args else False))
        ranges: list[tuple[int, int]] | None = None
        try:
            ranges = _worker_slot_ranges(region, worker_module, slot_only)
            if _pin_rows(region, key, first_bytes, registrar_factory(), fault, ranges):
                return
        except Exception as exc:
            on_failure(exc)
        if fault is not None:
            whole = [(region._base.data_ptr(), int(region.total_size_bytes))]
            try:
                for address, nbytes in ranges or whole:
                    fault(address, nbytes, 1)
            except Exception as exc:  # vLLM's registration faults what is left
                on_failure(exc)
        stock(region, *args, **kwargs)

    setattr(worker_module, PIN_FN, pin)
    try:
        yield
    finally:
        setattr(worker_module, PIN_FN, stock)


def _worker_slot_ranges(
    region: Any, worker_module: Any, slot_only: bool
) -> list[tuple[int, int]] | None:
    """This worker's slot of each row, ``(address, bytes)`` rounded out to memory pages, in
    row order, where vLLM's registration would take those alone (a worker of several, when
    the rest of a row saves enough); None where it registers whole rows."""
    least = getattr(worker_module, MIN_SAVED, None)
    if not slot_only or region.rank is None or least is None:
        return None
    stride, slot, page = int(region._row_stride), int(region.cpu_page_size), int(region.page_size)
    if stride - slot < max(page, int(least)):
        return None
    base = region._base.data_ptr() + int(region.rank) * slot
    ranges = []
    for row in range(int(region.num_chunks)):
        start = base + row * stride
        aligned = start - start % page
        ranges.append((aligned, round_up(start + slot, page) - aligned))
    return ranges


def _pin_rows(
    region: Any,
    key: str,
    first_bytes: int,
    registrar: HostRegistrar,
    fault: FaultRange | None,
    slot_ranges: list[tuple[int, int]] | None,
) -> bool:
    """Pin ``region``'s first rows now (``slot_ranges``: this worker's slot of each, else the
    rows whole) and start a thread for the rest; False where whole rows cannot end on
    memory pages (nothing was pinned). Raises where the first step fails, with nothing left
    registered and no progress file."""
    rows, row_bytes = int(region.num_chunks), int(region._row_stride)
    if slot_ranges is not None:
        steps = range_steps(slot_ranges, first_bytes, STEP_BYTES)
    else:
        layout = SlotLayout(region._base.data_ptr(), 1, rows * row_bytes, rows, row_bytes)
        found = slot_steps(layout, 1, min(first_bytes, MOST_BYTES_A_CALL), STEP_BYTES)
        if found is None or found[0].nbytes > MOST_BYTES_A_CALL:
            return False
        steps = found
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
            prepare_ahead=FAULTED_AHEAD,
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
        format_bytes(sum(step.nbytes for step in steps)),
        time.perf_counter() - started,
    )
    pinning.start()
    return True


def _fault_step(fault: FaultRange, step: PinStep, at_once: int) -> None:
    for address, nbytes in step.ranges:
        fault(address, nbytes, at_once)


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
