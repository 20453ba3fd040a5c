"""vLLM 0.25's CPU tier in host memory kvcore maps: the exact size, faulted in by every
usable CPU, on the GPU's NUMA node.

Given no region, vLLM 0.25.1's ``CPUOffloadingWorker`` allocates each KV tensor's host copy
with ``torch.zeros(..., pin_memory=True)``. Torch's pinned allocator rounds each size up
to a power of two, and the zeroing faults every page in on one thread. kvcore hands the
worker an :class:`ExactHostRegion` through the worker's own ``mmap_region`` argument
instead, the path 0.25.1 takes for its shared region:

- the worker registers it with cudaHostRegister as it would its own region
  (``pin_mmap_region``, which sets :attr:`ExactHostRegion.is_pinned`);
- it takes one view per KV tensor (:meth:`ExactHostRegion.create_next_view`);
- its store handler gives the region back at shutdown (:meth:`ExactHostRegion.cleanup`).

Each view is ``[blocks, page]`` and contiguous, as the tensor it replaces; each starts on
a page boundary. The memory reads as zeros, as the zeroed tensors do. A tier of 2 GiB or
more lies over several memfd files side by side (:func:`kvcore.host_mapping.faulted_memory`),
so that the faulting threads do not queue on one file's lock.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

import torch

from kvcore import numa
from kvcore.host_mapping import HostMemory, faulted_memory
from kvcore.host_pinning import PinnedMemoryError, format_bytes
from kvcore.host_report import available_bytes
from kvcore.kernels.cudart import clear_pending_error

logger = logging.getLogger("kvcore.vllm")


def _page_rounded(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class ExactHostRegion:
    """One mapping for every KV tensor's host copy, in the form vLLM 0.25.1's worker takes a
    region (its ``SharedOffloadRegion``'s attributes and methods that the worker uses)."""

    rank = 0
    """Read by vLLM's registration log lines; the region is this worker's alone."""

    def __init__(
        self,
        num_blocks: int,
        page_sizes: Sequence[int],
        *,
        placement: numa.Placement | None = None,
        threads: int | None = None,
    ) -> None:
        if num_blocks <= 0 or not page_sizes or min(page_sizes) <= 0:
            raise ValueError(
                f"a host region needs blocks and positive page sizes, got {num_blocks} "
                f"blocks of {list(page_sizes)} bytes"
            )
        self.num_blocks = num_blocks
        self._pages = tuple(page_sizes)
        self._offsets: list[int] = []
        total = 0
        for page in self._pages:
            self._offsets.append(total)
            total += _page_rounded(num_blocks * page)
        self.total_size_bytes = total
        available = available_bytes()
        if available is not None and total > available:
            # Faulting it in would bring the kernel's OOM killer, not an error.
            raise PinnedMemoryError(
                f"vLLM's CPU tier needs {format_bytes(total)} of host memory and "
                f"{format_bytes(available)} is available (MemAvailable); ask for less with "
                "--kv-offloading-size, or free memory"
            )
        self.memory: HostMemory | None = faulted_memory(total, placement=placement, threads=threads)
        self.address = self.memory.address
        """Where the mapping starts: what vLLM registers (its ``_base.data_ptr()``)."""
        self.numa_node = self.memory.node
        self._base: torch.Tensor | None = torch.frombuffer(
            self.memory.buffer, dtype=torch.int8, count=total
        )
        self._views: list[torch.Tensor] = []
        self.is_pinned = False

    @property
    def tensor_bytes(self) -> int:
        """The bytes the KV tensors' host copies take, without page rounding."""
        return sum(self.num_blocks * page for page in self._pages)

    def create_next_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next KV tensor's host copy, ``[blocks, tensor_page_size]`` int8; the page
        sizes come in the order the region was built with."""
        index = len(self._views)
        if self._base is None:
            raise RuntimeError("the host region was cleaned up")
        if index >= len(self._pages) or self._pages[index] != tensor_page_size:
            expected = self._pages[index] if index < len(self._pages) else "none"
            raise ValueError(
                f"KV tensor {index} asks for pages of {tensor_page_size} bytes; the region "
                f"was built for {expected}"
            )
        start = self._offsets[index]
        view = self._base[start : start + self.num_blocks * tensor_page_size].view(
            self.num_blocks, tensor_page_size
        )
        self._views.append(view)
        return view

    def cleanup(self) -> None:
        """Unregister the memory where the worker registered it, then unmap it (once the
        views are gone: a view kept elsewhere keeps it mapped, no longer pinned)."""
        if self.is_pinned and self._base is not None:
            result = torch.cuda.cudart().cudaHostUnregister(self.address)
            if int(getattr(result, "value", result)) != 0:
                # Read off, or torch's next launch check would report it as its own.
                clear_pending_error()
                logger.warning("kvcore: cudaHostUnregister of the host tier failed (%s)", result)
            self.is_pinned = False
        self._views.clear()
        self._base = None
        if self.memory is not None:
            memory, self.memory = self.memory, None
            memory.close()
