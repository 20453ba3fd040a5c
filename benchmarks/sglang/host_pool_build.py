"""SGLang's HiCache host pool buffer built stock's way and kvcore's (``kvcore bench --host-pool``).

Both sides go through SGLang's own ``alloc_with_host_register``, as an MHA host pool's
``init_kv_buffer`` calls it for the ``layer_first`` layout: SGLang's default allocator maps
the buffer and faults it in on one thread (stock), or kvcore's hook in front of it faults it
in from every usable CPU on the GPU's node (kvcore, :mod:`kvcore_sglang.host_memory`, put in
place as the plugin's AROUND hook wraps it); then SGLang registers it with CUDA where it
pins. The shape is a Llama-3-8B-shaped pool: K and V of 32 layers, 8 KV heads of 128 dims in
bf16, as many tokens as the size asks for.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.host_pool import Built

ENGINE = "sglang"
LAYERS = 32
HEADS = 8
HEAD_DIM = 128
DTYPE = torch.bfloat16
TOKEN_ROW_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2
"""Bytes one token takes in the pool: K and V of every layer."""
PAGE_SIZE = 64
PIN_FIRST_BYTES = 2 << 30
"""What the ``sglang-pin-first`` rows pin before the pool is usable."""


@dataclass
class PoolShape:
    """What kvcore's pinning reads of a host pool (and keeps on it)."""

    size: int
    page_size: int
    layout: str = "layer_first"


def pool_dims(gib: float) -> tuple[int, ...]:
    """The ``layer_first`` buffer's dims for a pool of ``gib``: whole pages of tokens, as
    SGLang sizes its pools."""
    tokens = int(gib * (1 << 30)) // TOKEN_ROW_BYTES // PAGE_SIZE * PAGE_SIZE
    return (2, LAYERS, max(PAGE_SIZE, tokens), HEADS, HEAD_DIM)


def _with_kvcores_hook(allocator_class: Any) -> None:
    from kvcore_sglang import host_memory

    stock = allocator_class.allocate

    @functools.wraps(stock)
    def hooked(allocator: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return host_memory.allocate_hook(stock, allocator, *args, **kwargs)

    allocator_class.allocate = hooked


def load() -> None:
    """Import SGLang's pool code and kvcore's hook, before any build is timed (SGLang's
    imports take seconds); ModuleNotFoundError where SGLang is not installed."""
    from benchmarks.sglang.import_stubs import install_torchvision_stub
    from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub

    install_torchvision_stub()
    # On CUDA SGLang's pool modules import sgl_kernel, which the GPU machine lacks.
    install_sgl_kernel_stub()
    importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    importlib.import_module("kvcore_sglang.host_memory")


def build(side: str, gib: float, pin: bool) -> Built:
    """The pool buffer as ``side`` builds it (in this process, which it changes for good),
    its bytes, and what gives it back; :func:`load` first."""
    from sglang.srt.mem_cache.pool_host.common import (
        HostTensorAllocator,
        _cuda_host_unregister,
        alloc_with_host_register,
    )

    if side == "kvcore":
        _with_kvcores_hook(HostTensorAllocator)
    buffer = alloc_with_host_register(
        pool_dims(gib), dtype=DTYPE, device="cpu", pin_memory=pin, allocator=HostTensorAllocator()
    )

    def release() -> None:
        if pin:
            _cuda_host_unregister(buffer)

    return buffer, buffer.numel() * buffer.element_size(), release, None


def build_pin_first(side: str, gib: float, pin: bool) -> Built:
    """:func:`build`, but kvcore's side pins the buffer as kvcore's pinning hook does under
    ``KVCORE_HOST_POOL_PIN_FIRST`` of :data:`PIN_FIRST_BYTES` (:func:`~kvcore_sglang.
    pool_pinning.pin_in_steps`, the rest on a thread) where SGLang would pin it whole;
    what it hands back waits for the rest."""
    if side != "kvcore" or not pin:
        return build(side, gib, pin)
    from kvcore.host_pinning import CudaHostRegistrar
    from kvcore_sglang import pool_pinning

    buffer, nbytes, _, _ = build(side, gib, False)
    dims = pool_dims(gib)
    pool = PoolShape(dims[2], PAGE_SIZE)
    sizes = (PIN_FIRST_BYTES, pool_pinning.STEP_BYTES)
    pinning = pool_pinning.pin_in_steps(pool, buffer, sizes, CudaHostRegistrar())

    def pinned_whole() -> None:
        pinning.wait()

    return buffer, nbytes, pinning.unpin, pinned_whole


def first_layer_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """The first layer's K rows as bytes: a contiguous part of the pool to read back."""
    return buffer[0, 0].view(torch.int8)


def first_step_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """The first layer's K rows of the first :data:`PIN_FIRST_BYTES` worth of slots, as
    bytes: all inside the first step, which pins at least that much, since one copy may not
    cross two of a pool's registrations once it is pinned in steps."""
    return buffer[0, 0, : PIN_FIRST_BYTES // TOKEN_ROW_BYTES].view(torch.int8)
