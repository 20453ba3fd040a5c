"""SGLang host pools built from a device pool the way SGLang's own assembler builds them.

The constructors changed between releases: 0.5.22's host pools take the device pool
itself, 0.5.23's take a description of its buffers (through the hybrid pool assembler's
``_mha_host_inputs`` for MHA). The benchmark and the test lane both build pools through
these two functions, so each release's call is written once. 0.5.22 sizes a host pool
by its ratio to the device pool, 0.5.23 by a token count as well: a ``host_token_capacity``
is given to 0.5.22 as that ratio (:func:`_as_ratio`).
"""

from __future__ import annotations

import inspect
from typing import Any


def mha_host_pool(device_pool: Any, **host_args: Any) -> Any:
    """The MHA host pool (asymmetric where K and V widths differ) for ``device_pool``."""
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    except ImportError:
        from sglang.srt.mem_cache.pool_host.mha import (
            AsymmetricMHATokenToKVPoolHost,
            MHATokenToKVPoolHost,
        )

        asymmetric = device_pool.v_head_dim != device_pool.head_dim
        host_cls = AsymmetricMHATokenToKVPoolHost if asymmetric else MHATokenToKVPoolHost
        return host_cls(device_pool, **_as_ratio(device_pool, host_args))
    host_cls, buffer_info, kwargs = _mha_host_inputs(device_pool)
    return host_cls(buffer_info, **kwargs, **host_args)


def mla_host_pool(device_pool: Any, **host_args: Any) -> Any:
    """The MLA host pool for ``device_pool`` (an MLA or DSA device pool)."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    takes_device_pool = "device_pool" in inspect.signature(MLATokenToKVPoolHost).parameters
    if takes_device_pool:
        return MLATokenToKVPoolHost(
            device_pool,
            override_kv_cache_dim=device_pool.kv_cache_dim,
            **_as_ratio(device_pool, host_args),
        )
    return MLATokenToKVPoolHost(
        device_pool.get_device_pool_infos()[0].buffer_info,
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        target_layer_num=device_pool.layer_num,
        override_kv_cache_dim=device_pool.kv_cache_dim,
        **host_args,
    )


def _as_ratio(device_pool: Any, host_args: dict[str, Any]) -> dict[str, Any]:
    """``host_args`` for a release that sizes host pools only by their ratio to the device
    pool: a token capacity asked for becomes that ratio."""
    args = dict(host_args)
    tokens = args.pop("host_token_capacity", None)
    if tokens is not None:
        args["host_to_device_ratio"] = tokens / device_pool.size
    return args
