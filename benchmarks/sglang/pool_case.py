"""SGLang's host and device pools for one bench case (kind, layout, page size), random-filled.

:func:`pool_case` builds a device pool and its host pool the way SGLang builds them, fills
both with random bytes and keeps each buffer's intended bytes on the device
(:class:`Component`), so that a copy can be checked and the buffers restored between timed
runs; :class:`Options` says how many tokens and layers, on which device. Apart from the A/B
(:mod:`benchmarks.sglang.ab`) because the sweep, the soak and the host-cost bench build
their pools the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.bench.measure import sync_device
from kvcore.bench.suite_options import PAGE_LEVELS as HOST_LEVELS

KINDS = ("mha", "mla")
LAYOUT_BACKENDS: dict[str, tuple[str, ...]] = {
    "layer_first": ("kernel", "direct"),
    "page_first": ("kernel",),
    "page_first_direct": ("direct",),
}
PAGE_SIZES = (64, 1)
# Geometry of the rows: MHA 8 KV heads x 128 (2 KiB of K and 2 KiB of V per token and
# layer), MLA DeepSeek's 512 + 64 latent (1152 B), both bf16.
MHA_HEADS, MHA_HEAD_DIM = 8, 128
MLA_RANK, MLA_ROPE = 512, 64


@dataclass(frozen=True)
class Options:
    tokens: int = 131072
    layers: int = 2
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    kinds: tuple[str, ...] = KINDS
    layouts: tuple[str, ...] = tuple(LAYOUT_BACKENDS)
    page_sizes: tuple[int, ...] = PAGE_SIZES
    host_levels: tuple[str, ...] = tuple(HOST_LEVELS)
    repeats: int = 5
    prefix: bool = True
    """Also run the evicted-prefix round trip (page_size 64, all layers)."""
    seed: int = 1234


@dataclass
class Component:
    """One host buffer (K, V or MLA's KV), its device-side mirror and its device layers."""

    host: torch.Tensor
    mirror: torch.Tensor
    """The host buffer's intended bytes, kept on the device for fast restores and checks."""
    devices: tuple[torch.Tensor, ...]
    poison: tuple[torch.Tensor, ...]
    """Each device layer's intended bytes."""


@dataclass
class PoolCase:
    kind: str
    layout: str
    page_size: int
    pool: Any
    device_pool: Any
    components: list[Component]
    opts: Options

    @property
    def row_bytes(self) -> int:
        layer = self.components[0].devices[0]
        return sum(c.devices[0][0].numel() for c in self.components) * layer.element_size()

    def restore_host(self) -> None:
        for c in self.components:
            c.host.copy_(c.mirror, non_blocking=True)
        sync_device(self.opts.device)

    def restore_device(self) -> None:
        for c in self.components:
            for layer, poison in zip(c.devices, c.poison, strict=True):
                layer.copy_(poison)
        sync_device(self.opts.device)


def _random_like(tensor: torch.Tensor, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN patterns included, never zeros) shaped like ``tensor``, on ``device``."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    return raw.view(tensor.dtype).view(tensor.shape)


def _device_pool(kind: str, opts: Options, page_size: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(
        size=2 * opts.tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        layer_num=opts.layers,
        device=str(opts.device),
        enable_memory_saver=False,
    )
    if kind == "mha":
        return MHATokenToKVPool(head_num=MHA_HEADS, head_dim=MHA_HEAD_DIM, **common)
    return MLATokenToKVPool(kv_lora_rank=MLA_RANK, qk_rope_head_dim=MLA_ROPE, **common)


def _host_pool(kind: str, device_pool: Any, layout: str, page_size: int, opts: Options) -> Any:
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from benchmarks.sglang.host_pools import mha_host_pool, mla_host_pool

    args = dict(
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=opts.device.type == "cuda",
        host_token_capacity=2 * opts.tokens,
    )
    # The budget check samples free memory, which a lent VM reports low until it is used.
    with host_memory_budget_scope(1 << 50):
        build = mha_host_pool if kind == "mha" else mla_host_pool
        return build(device_pool, **args)


@contextmanager
def pool_case(kind: str, layout: str, page_size: int, opts: Options) -> Iterator[PoolCase]:
    """Both pools filled with random bytes; the host pool is unregistered afterwards."""
    device_pool = _device_pool(kind, opts, page_size)
    pool = _host_pool(kind, device_pool, layout, page_size, opts)
    gen = torch.Generator(device=opts.device).manual_seed(opts.seed)
    if kind == "mha":
        pairs = [
            (pool.k_buffer, pool.device_k_buffers),
            (pool.v_buffer, pool.device_v_buffers),
        ]
    else:
        pairs = [(pool.kv_buffer, pool.device_kv_buffers)]
    components = []
    for host, devices in pairs:
        mirror = _random_like(host, opts.device, gen)
        poison = tuple(_random_like(layer, opts.device, gen) for layer in devices)
        components.append(Component(host, mirror, tuple(devices), poison))
    case = PoolCase(kind, layout, page_size, pool, device_pool, components, opts)
    case.restore_host()
    case.restore_device()
    try:
        yield case
    finally:
        # Copies still queued read the host buffer: finish them before unregistering.
        sync_device(opts.device)
        pool.destroy()
