"""vLLM's shared CPU tier (0.32 and later) faulted in by every usable CPU, for one worker.

From 0.32 vLLM maps its CPU tier as one shared region in ``/dev/shm``
(``SharedOffloadRegion``; from 0.33 split into several files, so that page-cache inserts,
serialised per file, can go on in parallel) and each worker faults its own part in with
``MADV_POPULATE_WRITE``, on its own thread. With several workers the region is faulted by
as many threads. With one worker (one GPU), which owns every slot, one thread faults all of
it, and that is most of the tier's start-up.

While kvcore's spec builds the stock worker of a one-worker engine, :func:`faulted_by_every_cpu`
stands in for the region module's ``_get_populate_write_fn``, which the region asks for once
before it faults its part in: kvcore first faults the whole mapping in from every usable CPU
(placed on the GPU's NUMA node where the host has several,
:func:`kvcore.host_mapping.fault_in`), then hands back vLLM's own function, whose calls then
find every page present. The mapping, its size, its files and everything vLLM does with it
afterwards stay vLLM's. Where kvcore's faulting fails, vLLM's own function does the work
(the failure is passed to ``on_failure``).
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


@contextlib.contextmanager
def faulted_by_every_cpu(
    region_module: Any,
    placement: numa.Placement | None,
    on_failure: Callable[[Exception], None],
) -> Iterator[None]:
    """Within the block, each region ``region_module`` (vLLM's shared region module) builds
    is faulted in by every usable CPU before vLLM's own faulting runs over it."""
    stock = getattr(region_module, POPULATE_FN)

    def populate_write_fn(mapping: mmap.mmap) -> Callable[[mmap.mmap, int, int], None]:
        try:
            fault_region(mapping, placement)
        except Exception as exc:
            on_failure(exc)
        return stock(mapping)

    setattr(region_module, POPULATE_FN, populate_write_fn)
    try:
        yield
    finally:
        setattr(region_module, POPULATE_FN, stock)
