"""Host memory of an exact size, every page faulted in by several threads, on a chosen node.

A host tier's memory is pinned once at engine start. Torch's pinned allocator rounds each
allocation up to a power of two and zeroes it on one thread; registering untouched memory
faults every page in on the registering thread. :func:`faulted_memory` maps exactly the
bytes asked for (the kernel rounds to its page) as shared memory, from 2 GiB over several
files (:mod:`kvcore.shared_segments`: the kernel serialises faults into one shared file),
places them on a NUMA node where asked (:mod:`kvcore.numa`), and faults every page in from
several threads (:func:`kvcore.host_pinning.populate`), so that a registration that follows
only pins. Fresh anonymous memory reads as zeros, as a zeroed tensor does.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore import numa
from kvcore.host_pinning import populate, usable_cpus
from kvcore.metrics import METRICS
from kvcore.shared_segments import segment_count, segmented_shared


@dataclass
class HostMemory:
    """Shared anonymous memory at one address, exactly ``nbytes`` (page-rounded by the
    kernel), reading as zeros: one mapping, or from 2 GiB several memfd files side by side
    (:mod:`kvcore.shared_segments`), so that threads fault it in without queueing on one
    file's lock. A forked child sees it either way."""

    buffer: Any
    """The memory as a writable buffer (``torch.frombuffer`` keeps it, and so the memory,
    alive); None once closed."""
    address: int
    nbytes: int
    segments: int
    node: int | None = None
    """The NUMA node its pages were placed on, once faulted in (:func:`faulted_memory`)."""
    mapping: mmap.mmap | None = None
    """The one mapping, where there is one; :attr:`buffer` is then a view of it, which
    stops :meth:`close` from unmapping it while anything holds that view."""

    def close(self) -> None:
        """Give the memory back: now where nothing views it any more, else once the last
        view is freed (a range over several files is unmapped when its buffer is
        collected)."""
        mapping, self.mapping, self.buffer = self.mapping, None, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


def fell_back(logger: logging.Logger, exc: Exception, instead: str, counted: bool) -> None:
    """Say in one line that kvcore could not obtain an engine's host tier (``exc``) and what
    the engine does ``instead``; where ``counted`` (KVCORE_METRICS), count it
    ``host_pool_stock:<type>``."""
    reason = f"host_pool_stock:{type(exc).__name__}"
    logger.warning("kvcore: %s (%s); %s", reason, exc, instead)
    if counted:
        METRICS.record_fallback(reason)


def host_memory(nbytes: int, segments: int | None = None) -> HostMemory:
    """Fresh shared memory of ``nbytes`` over ``segments`` files (by default
    :func:`~kvcore.shared_segments.segment_count`'s), none of it faulted in yet. Raises
    OSError where the kernel refuses it."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    segments = segment_count(nbytes) if segments is None else segments
    if segments <= 1:
        mapping = mmap.mmap(-1, nbytes)
        return HostMemory(memoryview(mapping), mapping_address(mapping), nbytes, 1, None, mapping)
    shared = segmented_shared(nbytes, segments)
    return HostMemory(shared.buffer, shared.address, nbytes, shared.segments)


def faulted_memory(
    nbytes: int,
    *,
    placement: numa.Placement | None = None,
    threads: int | None = None,
    segments: int | None = None,
) -> HostMemory:
    """:func:`host_memory` of ``nbytes`` over ``segments`` files, every page faulted in by
    ``threads`` threads (default: every CPU the process may use) and placed as
    ``placement`` says. Raises OSError where the kernel refuses the memory."""
    memory = host_memory(nbytes, segments)
    try:
        memory.node = fault_in(memory.address, nbytes, placement=placement, threads=threads)
    except BaseException:
        memory.close()
        raise
    return memory


def mapping_address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts, read without keeping an export of it (which would stop it
    from being closed)."""
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = int(array.__array_interface__["data"][0])
    del array
    return address


def fault_in(
    address: int,
    nbytes: int,
    *,
    placement: numa.Placement | None = None,
    threads: int | None = None,
) -> int | None:
    """Fault in every page of a fresh mapped range from ``threads`` threads (default: every
    CPU the process may use), placed as ``placement`` says, changing no byte; the node the
    pages went to, or None where placement was off or refused everywhere."""
    node = None
    cpus: tuple[int, ...] | None = None
    if placement is not None:
        bound = numa.bind_memory(address, nbytes, placement.node)
        # Where the policy was refused, first touch from the node's CPUs still puts the
        # pages there under the default (local) policy.
        cpus = placement.cpus
        if bound or cpus:
            node = placement.node
    populate(address, nbytes, usable_cpus() if threads is None else threads, cpus=cpus)
    return node


def torch_pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator reserves for a tensor of ``nbytes``: the next power of
    two, the rounding an exact mapping avoids."""
    return 1 << max(nbytes - 1, 0).bit_length()
