"""Host memory of an exact size, every page faulted in by several threads, on a chosen node.

A host tier's memory is pinned once at engine start. Torch's pinned allocator rounds each
allocation up to a power of two and zeroes it on one thread; registering untouched memory
faults every page in on the registering thread. :func:`faulted_mapping` maps exactly the
bytes asked for (the kernel rounds to its page), places them on a NUMA node where asked
(:mod:`kvcore.numa`), and faults every page in from several threads
(:func:`kvcore.host_pinning.populate`), so that a registration that follows only pins.
An anonymous mapping reads as zeros, as a zeroed tensor does.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kvcore import numa
from kvcore.host_pinning import populate, usable_cpus


@dataclass
class FaultedMapping:
    """An anonymous mapping whose pages are all faulted in."""

    mapping: mmap.mmap
    address: int
    nbytes: int
    node: int | None
    """The NUMA node the pages were placed on (by policy, or by first touch from its CPUs);
    None where placement was off or there was nothing to place."""


def faulted_mapping(
    nbytes: int, *, placement: numa.Placement | None = None, threads: int | None = None
) -> FaultedMapping:
    """Exactly ``nbytes`` of anonymous memory (page-rounded by the kernel), faulted in by
    ``threads`` threads (default: every CPU the process may use), placed as ``placement``
    says. Raises OSError where the kernel refuses the mapping (too little memory)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    mapping = mmap.mmap(-1, nbytes)
    address = mapping_address(mapping)
    node = fault_in(address, nbytes, placement=placement, threads=threads)
    return FaultedMapping(mapping, address, nbytes, node)


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
