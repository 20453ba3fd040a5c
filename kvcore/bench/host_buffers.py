"""Host memory of an exact size for the benchmarks and scripts, pinned where a GPU is.

:func:`allocate_host_buffer` gets the memory: pageable on machines without a GPU,
otherwise an anonymous mmap pre-faulted by several threads and registered with
cudaHostRegister chunk by chunk. Nothing is rounded up to a power of two (torch's
``pin_memory=True`` would turn 100 GB into 128 GB). Given a NUMA node, the mapping
is bound to it and pre-faulted from its CPUs (:mod:`kvcore.numa`).

The mapping and its faulting are :mod:`kvcore.host_mapping`'s, which also maps vLLM
0.25.1's CPU tier (vLLM registers that one itself); the registered buffers here are the
measuring code's.
"""

from __future__ import annotations

import logging
import mmap
import operator
import weakref
from typing import Literal

import numpy as np
import torch

from kvcore import numa
from kvcore.host_mapping import HostMemory, faulted_memory
from kvcore.host_pinning import (
    CudaHostRegistrar,
    HostRegistrar,
    PinnedMemoryError,
    check_memlock,
)

logger = logging.getLogger(__name__)

HostBufferKind = Literal["pageable", "registered"]


class HostBuffer:
    """``nbytes`` of host memory as one uint8 tensor; :meth:`close` gives it back."""

    kind: HostBufferKind
    pinned: bool
    numa_node: int | None = None
    """The NUMA node the memory was placed on (by policy, or by first touch from the node's
    CPUs); None where placement was off or impossible."""
    segment_bytes: int | None = None
    """Size of each separately registered segment, None when the buffer is one segment.

    A DMA copy must not cross a segment boundary: the driver rejects a range that
    spans two registrations (cudaErrorInvalidValue).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.nbytes = tensor.numel()

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"{self.kind} host buffer is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        self._tensor = None


class PageableBuffer(HostBuffer):
    kind: HostBufferKind = "pageable"
    pinned = False


class RegisteredBuffer(HostBuffer):
    """An anonymous mmap registered chunk by chunk; unregistered before it is unmapped.

    The tensor is a numpy view of the mapping, which holds a buffer export: views
    that outlive :meth:`close` keep the memory mapped (no longer pinned) instead of
    dangling.
    """

    kind: HostBufferKind = "registered"
    pinned = True

    def __init__(
        self,
        nbytes: int,
        registrar: HostRegistrar,
        *,
        prefault_threads: int,
        register_chunk_bytes: int,
        placement: numa.Placement | None = None,
    ) -> None:
        if nbytes > register_chunk_bytes:
            self.segment_bytes = register_chunk_bytes
        if register_chunk_bytes <= 0 or register_chunk_bytes % mmap.PAGESIZE:
            raise ValueError(
                f"register_chunk_bytes {register_chunk_bytes} is not a positive multiple "
                f"of the page size {mmap.PAGESIZE}"
            )
        # One mapping: the registrations below are cut to the benchmark's own chunks.
        self._memory: HostMemory | None = faulted_memory(
            nbytes, placement=placement, threads=prefault_threads, segments=1
        )
        self.numa_node = self._memory.node
        array = np.frombuffer(self._memory.buffer, dtype=np.uint8)
        super().__init__(torch.from_numpy(array))
        self._registrar = registrar
        self._registered: list[int] = []
        # A buffer dropped without close(): numpy clears weak references before it lets go of
        # the mapping, so the registration ends before the range is unmapped. Otherwise a later
        # mapping at the same address could not be registered ("already mapped").
        weakref.finalize(array, _unregister_all, registrar, self._registered)
        # Only the tensor may hold the mapping's export, so close() can unmap it.
        del array
        base = self.tensor.data_ptr()
        try:
            for offset in range(0, nbytes, register_chunk_bytes):
                size = min(register_chunk_bytes, nbytes - offset)
                registrar.register(base + offset, size)
                self._registered.append(base + offset)
        except Exception as exc:
            self.close()
            if isinstance(exc, PinnedMemoryError):
                raise
            raise PinnedMemoryError(f"registering {nbytes} bytes of host memory failed") from exc

    def close(self) -> None:
        _unregister_all(self._registrar, self._registered)
        super().close()
        if self._memory is not None:
            memory, self._memory = self._memory, None
            memory.close()


def _unregister_all(registrar: HostRegistrar, registered: list[int]) -> None:
    # A chunk whose unregistration raises stays listed and mapped: freeing
    # registered memory breaks a later registration of the same range.
    while registered:
        registrar.unregister(registered[-1])
        registered.pop()


def allocate_host_buffer(
    nbytes: int,
    *,
    pin: bool | None = None,
    prefault_threads: int = 8,
    register_chunk_bytes: int = 16 << 30,
    registrar: HostRegistrar | None = None,
    numa_node: int | None = None,
) -> HostBuffer:
    """Exactly ``nbytes`` of host memory; pinned iff ``pin`` (default: iff CUDA is present).

    ``numa_node`` places pinned memory on that node (``buffer.numa_node`` says whether
    it was); pageable memory, for hosts without a GPU, is never placed.
    ``registrar`` replaces cudaHostRegister (tests pass a fake one).
    """
    nbytes = operator.index(nbytes)
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if pin is None:
        pin = torch.cuda.is_available()
    if not pin:
        if numa_node is not None:
            logger.info("NUMA node %d ignored: pageable host memory is not placed", numa_node)
        return PageableBuffer(torch.empty(nbytes, dtype=torch.uint8))
    check_memlock(nbytes)
    return RegisteredBuffer(
        nbytes,
        registrar if registrar is not None else CudaHostRegistrar(),
        prefault_threads=prefault_threads,
        register_chunk_bytes=register_chunk_bytes,
        placement=numa.placement_for(numa_node),
    )
