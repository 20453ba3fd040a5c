"""vLLM's shared CPU tier (0.32 and later) faulted in by every usable CPU, not one thread.

From 0.32 vLLM maps its CPU tier as one shared region in ``/dev/shm``
(``SharedOffloadRegion``; from 0.33 split into several files, so that page-cache inserts,
serialised per file, can go on in parallel) and each worker faults its own part in with
``MADV_POPULATE_WRITE``, on its own thread: with one worker (one GPU), which owns every
slot, one thread faults all of it, and that is most of the tier's start-up; with several,
one thread a worker.

While kvcore's spec builds the stock worker, it stands in for the region module's
``_get_populate_write_fn``, which the region asks for once before it faults its part in:
- one worker (:func:`faulted_by_every_cpu`): kvcore first faults the whole mapping in from
  every usable CPU, then hands back vLLM's own function, whose calls find every page present;
- several (:func:`faulted_by_a_share_of_cpus`): each range the worker asks for (its slot of
  each row, or its share of a replicated region) is faulted by its share of the CPUs;
- one worker pinning in steps (:func:`faulting_left_to_pinning`): nothing now, each step
  faults its own rows.

Pages go to the GPU's NUMA node where the host has several
(:func:`kvcore.host_mapping.fault_in`). The mapping, its size, its files and everything vLLM
does with it afterwards stay vLLM's. Where kvcore's faulting fails, vLLM's own function does
the work (the failure is passed to ``on_failure``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvcore import numa
from kvcore.host_mapping import fault_in, mapping_address
from kvcore.host_pinning import format_bytes, usable_cpus

logger = logging.getLogger("kvcore.vllm")

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
POPULATE_FN = "_get_populate_write_fn"


def fault_region(mapping: mmap.mmap, placement: numa.Placement | None) -> None:
    """Fault every page of ``mapping`` in from every usable CPU, placed as ``placement``
    says, and say so in one line."""
    started = time.perf_counter()
    nbytes = len(mapping)
    node = fault_in(mapping_address(mapping), nbytes, placement=placement)
    logger.info(
        "kvcore: vLLM's CPU tier (%s) faulted in by %d threads in %.1f s, NUMA node %s",
        format_bytes(nbytes),
        usable_cpus(),
        time.perf_counter() - started,
        "default" if node is None else node,
    )


def _threads_of(workers: int) -> int:
    """One worker's share of the usable CPUs, where ``workers`` fault their parts at once."""
    return max(1, usable_cpus() // max(1, workers))


FaultRange = Callable[[int, int, int], None]
"""``(address, bytes, at_once)``: that range of a region faulted in, one of ``at_once``
ranges faulted at the same time."""


def fault_range(placement: numa.Placement | None, workers: int = 1) -> FaultRange:
    """A range of a region faulted in by its share of this worker's share of the usable
    CPUs (all of them for one of ``workers`` faulting one range), placed as ``placement``
    says (what each step of :mod:`kvcore_vllm.region_pinning` does before it registers)."""

    def fault(address: int, nbytes: int, at_once: int) -> None:
        fault_in(address, nbytes, placement=placement, threads=_threads_of(workers * at_once))

    return fault


PopulateWrite = Callable[[mmap.mmap, int, int], None]
"""vLLM's populate call: ``(mapping, offset, length)`` faulted in."""
GetPopulateWrite = Callable[[mmap.mmap], PopulateWrite]
"""The region module's ``_get_populate_write_fn``: a mapping's populate call."""


@contextlib.contextmanager
def _populate_replaced(
    region_module: Any, replacement: Callable[[GetPopulateWrite], GetPopulateWrite]
) -> Iterator[None]:
    """Within the block, ``region_module``'s ``_get_populate_write_fn`` is
    ``replacement(stock's)``; stock's again after it."""
    stock = getattr(region_module, POPULATE_FN)
    setattr(region_module, POPULATE_FN, replacement(stock))
    try:
        yield
    finally:
        setattr(region_module, POPULATE_FN, stock)


def _left_unfaulted(mapping: mmap.mmap, offset: int, length: int) -> None:
    """vLLM's populate call, answered with nothing: the pinning steps fault these pages."""


def faulting_left_to_pinning(region_module: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block, each region ``region_module`` builds is left unfaulted: where the
    worker pins it in steps (``KVCORE_HOST_POOL_PIN_FIRST``), each step faults its own rows
    by every usable CPU just before registering them, so that the engine waits for the
    first step's pages alone (:func:`kvcore_vllm.region_pinning.pinned_in_steps`, which
    faults the whole region first where vLLM's own registration takes over)."""
    return _populate_replaced(region_module, lambda stock: lambda mapping: _left_unfaulted)


def faulted_by_a_share_of_cpus(
    region_module: Any,
    placement: numa.Placement | None,
    workers: int,
    on_failure: Callable[[Exception], None],
) -> contextlib.AbstractContextManager[None]:
    """Within the block, each range a region ``region_module`` builds asks to fault in (one
    worker's slot of each row, or its share of a replicated region) is faulted in by this
    worker's share of the usable CPUs (the engine's ``workers`` fault their parts at the
    same time), placed as ``placement`` says. Where kvcore's faulting fails, it is passed to
    ``on_failure`` once and vLLM's own faulting does that range and every later one."""
    threads = _threads_of(workers)

    def replacement(stock: GetPopulateWrite) -> GetPopulateWrite:
        def populate_write_fn(mapping: mmap.mmap) -> PopulateWrite:
            own = stock(mapping)
            base = mapping_address(mapping)
            failed = False
            first = True

            def populate(target: mmap.mmap, offset: int, length: int) -> None:
                nonlocal failed, first
                if failed:
                    own(target, offset, length)
                    return
                try:
                    node = fault_in(base + offset, length, placement=placement, threads=threads)
                except Exception as exc:
                    failed = True
                    on_failure(exc)
                    own(target, offset, length)
                    return
                if first:
                    first = False
                    logger.info(
                        "kvcore: this worker's part of vLLM's CPU tier faulted in by %d "
                        "threads (one worker of %d), NUMA node %s",
                        threads,
                        workers,
                        "default" if node is None else node,
                    )

            return populate

        return populate_write_fn

    return _populate_replaced(region_module, replacement)


def faulted_by_every_cpu(
    region_module: Any,
    placement: numa.Placement | None,
    on_failure: Callable[[Exception], None],
) -> contextlib.AbstractContextManager[None]:
    """Within the block, each region ``region_module`` (vLLM's shared region module) builds
    is faulted in by every usable CPU before vLLM's own faulting runs over it."""

    def replacement(stock: GetPopulateWrite) -> GetPopulateWrite:
        def populate_write_fn(mapping: mmap.mmap) -> PopulateWrite:
            try:
                fault_region(mapping, placement)
            except Exception as exc:
                on_failure(exc)
            return stock(mapping)

        return populate_write_fn

    return _populate_replaced(region_module, replacement)
