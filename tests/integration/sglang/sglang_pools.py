"""SGLang host pools built on CPU the way SGLang's hybrid pool assembler builds them.

The one set of pool builders for the SGLang lane. Small geometries (few heads, few
dims, two layers by default) keep the buffers tiny; the host pools get the assembler's
arguments except ``pin_memory=False`` (pinning needs CUDA). Each host pool holds its
device pool's buffers (``device_k_buffers``, ``device_kv_buffers``, ``device_pool``),
so the transfer tests reach both sides through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MHATokenToKOnlyPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_parallel

from benchmarks.sglang.host_pools import mha_host_pool, mla_host_pool

HOST_RATIO = 2.0
LAYERS = 2


def _host_args(page_size: int, layout: str) -> dict[str, Any]:
    return dict(
        host_to_device_ratio=HOST_RATIO,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
    )


def mha_device(
    tokens: int,
    page_size: int,
    v_head_dim: int | None = None,
    *,
    layers: int = LAYERS,
    heads: int = 1,
) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=v_head_dim,
    )


def mha_host(
    tokens: int,
    page_size: int,
    layout: str = "layer_first",
    *,
    layers: int = LAYERS,
    heads: int = 1,
) -> Any:
    device = mha_device(tokens, page_size, layers=layers, heads=heads)
    return _mha_host_for(device, page_size, layout)


def asymmetric_mha_host(tokens: int, page_size: int) -> Any:
    device = mha_device(tokens, page_size, v_head_dim=16)
    # SGLang accepts only page-major layouts when K and V widths differ.
    return _mha_host_for(device, page_size, "page_first")


def _mha_host_for(device: MHATokenToKVPool, page_size: int, layout: str) -> Any:
    return mha_host_pool(device, **_host_args(page_size, layout))


def _mla_host_for(
    device: MLATokenToKVPool, page_size: int, layout: str = "layer_first"
) -> MLATokenToKVPoolHost:
    return mla_host_pool(device, **_host_args(page_size, layout))


def mla_device(tokens: int, page_size: int, *, layers: int = LAYERS) -> MLATokenToKVPool:
    return MLATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def mla_host(
    tokens: int, page_size: int, layout: str = "layer_first", *, layers: int = LAYERS
) -> MLATokenToKVPoolHost:
    return _mla_host_for(mla_device(tokens, page_size, layers=layers), page_size, layout)


def k_only_host(tokens: int, page_size: int) -> MHATokenToKOnlyPoolHost:
    device = MHATokenToKOnlyPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return MHATokenToKOnlyPoolHost(
        device, mha_host(tokens, page_size), layout="layer_first", pin_memory=False
    )


def dsa_host(
    tokens: int, page_size: int, layout: str = "layer_first", *, layers: int = LAYERS
) -> DSAIndexerPoolHost:
    """The DSA indexer's host pool (its ``device_pool`` is the DSA device pool)."""
    with get_parallel().override(attn_dcp_size=1):
        device = DSATokenToKVPool(
            size=tokens,
            page_size=page_size,
            kv_lora_rank=16,
            dtype=torch.bfloat16,
            qk_rope_head_dim=8,
            layer_num=layers,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=24,
        )
    anchor = _mla_host_for(device, page_size, layout)
    return DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor, pin_memory=False)


# Pool kind -> builder(tokens, page_size); DSA's index pages need page_size 64.
BUILDERS: dict[str, Callable[[int, int], Any]] = {
    "mha": mha_host,
    "asymmetric_mha": asymmetric_mha_host,
    "mla": mla_host,
    "k_only": k_only_host,
    "dsa": dsa_host,
}
