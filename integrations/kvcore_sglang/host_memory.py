"""SGLang's HiCache host pools in memory kvcore faults in: every usable CPU, the GPU's node.

SGLang 0.5.23's default host allocator (``HostTensorAllocator.allocate``, through
``alloc_mmap``) maps each pool buffer shared and anonymous, at its exact size, and faults
every page in on one thread (``MADV_POPULATE_WRITE``) before ``HostKVCache`` registers it
with CUDA in chunks. Faulting on one thread is most of a large pool's start-up. kvcore's
hook makes shared memory of the same size, reading as the same zeros, and changes how
its pages come in: from every CPU the process may use, placed on the NUMA node of the GPU
the process drives where the host has more than one
(:func:`kvcore.host_mapping.fault_in`), and, from 2 GiB, over several files side by side
(:mod:`kvcore.shared_segments`), since the kernel serialises faults into one shared file.
SGLang's registration and everything after it stay SGLang's own.

SGLang's own allocation runs instead where:

- the allocator is not SGLang's default one (a storage backend's allocator owns its
  memory, shared segments included);
- the device is not the CPU (SGLang refuses it itself);
- ``SGLANG_HUGEPAGE_SIZE`` or ``SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS`` is set: the
  operator chose SGLang's hugepage or private parallel mapping;
- kvcore's mapping fails (logged, counted ``host_pool_stock:<type>``).

SGLang checks the host's free memory against the pool before it allocates, so kvcore does
not check it again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore import numa
from kvcore.config import KVCoreConfig
from kvcore.host_mapping import faulted_memory, fell_back
from kvcore.host_pinning import format_bytes, usable_cpus

from .guard import HOST_MEMORY_TARGET
from .host_memory_choice import sglang_choice

logger = logging.getLogger("kvcore.sglang")

TARGET = HOST_MEMORY_TARGET
"""The allocation kvcore's hook wraps, as the guard names it."""
ALLOCATOR_CLASS = TARGET.rsplit(".", 1)[0]


def is_default_allocator(allocator: Any) -> bool:
    cls = type(allocator)
    return f"{cls.__module__}.{cls.__qualname__}" == ALLOCATOR_CLASS


def mapped_pool_tensor(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    *,
    placement: numa.Placement | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """A ``dims`` tensor of ``dtype`` on shared memory of exactly its bytes, every page
    faulted in by ``threads`` threads (every usable CPU by default), placed as ``placement``
    says (:func:`kvcore.host_mapping.faulted_memory`: from 2 GiB over several files, so
    that the threads do not queue on one file's lock). The tensor keeps the memory; it is
    unmapped when the tensor is freed.
    Raises OSError where the kernel refuses the mapping."""
    count = math.prod(dims)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    memory = faulted_memory(nbytes, placement=placement, threads=threads)
    return torch.frombuffer(memory.buffer, dtype=dtype, count=count).reshape(dims)


def allocate_hook(
    original: Callable[..., torch.Tensor],
    allocator: Any,
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
) -> torch.Tensor:
    """The AROUND hook of :data:`TARGET`: SGLang's default allocation, faulted in by kvcore."""
    if device != "cpu" or not is_default_allocator(allocator) or math.prod(dims) == 0:
        return original(allocator, dims, dtype, device)
    choice = sglang_choice()
    if choice is not None:
        logger.info("kvcore: %s is set; SGLang allocates its host pool itself", choice)
        return original(allocator, dims, dtype, device)
    started = time.perf_counter()
    placement = None
    try:
        placement = numa.current_gpu_placement()
        tensor = mapped_pool_tensor(tuple(dims), dtype, placement=placement)
    except Exception as exc:
        instead = "SGLang allocates its host pool itself"
        fell_back(logger, exc, instead, KVCoreConfig.from_env().metrics)
        return original(allocator, dims, dtype, device)
    # As SGLang's allocator does: its callers read them back.
    allocator.dtype, allocator.dims = dtype, dims
    logger.info(
        "kvcore: SGLang host pool buffer of %s faulted in by %d threads in %.1f s, NUMA node %s",
        format_bytes(tensor.numel() * tensor.element_size()),
        usable_cpus(),
        time.perf_counter() - started,
        "default" if placement is None else placement.node,
    )
    return tensor


HOOKS: dict[str, Callable[..., torch.Tensor]] = {TARGET: allocate_hook}
"""Target (as the guard names it) -> its hook."""
