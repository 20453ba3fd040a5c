"""The live HiCache run's cache, built as SGLang's scheduler builds it.

For :mod:`benchmarks.sglang.hicache_live`, :func:`build_rig` builds a model-shaped MHA
device pool, its allocator and a ``UnifiedRadixCache`` with HiCache (write-through) as
:class:`LiveOptions` size them; :class:`Rig` holds them and plays the model runner's
forward pass, each layer's read waiting for its load (:class:`LayerReads`);
:class:`CacheCounters` counts what the cache did at its own methods; :func:`release`
unpins the host pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.sglang.hicache_trace import TraceShape
from benchmarks.sglang.kv_content import KVContent
from kvcore.bench.measure import sync_device as sync

# A device pool of 40960 tokens (5 GiB at the default geometry) holds the largest request
# (32000 tokens and its turns) but not two conversations' worth: turns come back from host.
DEVICE_TOKENS = 40960
# The host pool holds the whole trace's working set (~205k tokens at the defaults).
HOST_RATIO = 6.0


@dataclass(frozen=True)
class LiveOptions:
    mode: str = "stock"
    label: str = ""
    """The run's name in the combined summary; empty: the mode."""
    layout: str = "layer_first"
    io_backend: str = "kernel"
    device: str = "cuda"
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    device_tokens: int = DEVICE_TOKENS
    host_ratio: float = HOST_RATIO
    trace: TraceShape = field(default_factory=TraceShape)
    seconds: float = 60.0
    """No request starts after this much of the trace's time."""
    warmup: bool = True
    tree_core: str = "python"
    """SGLang's radix tree implementation: its pure-Python TreeCore, or its bundled Rust one
    (SGLang's own default), which on the GPU machine's torch 2.11 panics with "Unsupported
    TypeMeta" in stock and kvcore modes alike. The tree indexes prefixes; the transfers
    measured here do not pass through it."""

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer (bf16 K and V)."""
        return self.layers * 2 * self.heads * self.head_dim * 2


@dataclass
class CacheCounters:
    """What the cache did, counted at its own methods (wrapped on the instance, unchanged)."""

    evict_calls: int = 0
    evicted_tokens: int = 0
    dropped_tokens: int = 0
    """Evicted without a host copy (write-through not yet acked)."""
    host_evict_calls: int = 0
    host_evicted_tokens: int = 0
    write_through_ops: int = 0
    write_through_tokens: int = 0

    def attach(self, cache: Any) -> None:
        evict, evict_host, dropped = cache._evict, cache.evict_host, cache._record_dropped_tokens
        write = cache.cache_controller.write

        def counted_evict(*args: Any, **kwargs: Any) -> Any:
            result = evict(*args, **kwargs)
            self.evict_calls += 1
            self.evicted_tokens += result.num_tokens_evicted
            return result

        def counted_evict_host(*args: Any, **kwargs: Any) -> int:
            freed = evict_host(*args, **kwargs)
            self.host_evict_calls += 1
            self.host_evicted_tokens += freed
            return freed

        def counted_dropped(tokens: int, reason: str) -> None:
            self.dropped_tokens += max(tokens, 0)
            dropped(tokens, reason)

        def counted_write(device_indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            host_indices = write(device_indices, *args, **kwargs)
            if host_indices is not None:
                self.write_through_ops += 1
                self.write_through_tokens += len(device_indices)
            return host_indices

        cache._evict = counted_evict
        cache.evict_host = counted_evict_host
        cache._record_dropped_tokens = counted_dropped
        cache.cache_controller.write = counted_write

    def reset(self) -> None:
        for name in vars(self):
            setattr(self, name, 0)


@dataclass
class Rig:
    """The cache and what it was built from."""

    opts: LiveOptions
    device: torch.device
    cache: Any
    allocator: Any
    kv_pool: Any
    content: KVContent
    counters: CacheCounters
    settings: dict[str, Any]

    @property
    def controller(self) -> Any:
        return self.cache.cache_controller

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V buffers, read without waiting (the checker's view)."""
        return self.kv_pool._get_key_buffer(layer), self.kv_pool._get_value_buffer(layer)

    def forward_pass(self, consumer: int, loaded_slots: torch.Tensor | None) -> LayerReads:
        """What the model runner does with the batch's consumer index: set it on the layer-done
        counter, then read each layer's KV as attention does, each read waiting for its load.

        The rows of ``loaded_slots`` are copied on the forward stream right after each layer's
        wait: what attention would read there, checked later; a load that signalled its layer
        before its copy was done shows up in them.
        """
        counter = self.kv_pool.layer_transfer_counter
        counter.set_consumer(consumer)
        reads = LayerReads()
        for layer in range(self.kv_pool.layer_num):
            key, value = self.kv_pool.get_kv_buffer(self.kv_pool.start_layer + layer)
            if layer == self.kv_pool.layer_num - 1:
                reads.mark_last_wait(self.device)
            if loaded_slots is not None:
                reads.views.append((key[loaded_slots], value[loaded_slots]))
        return reads


@dataclass
class LayerReads:
    """Each layer's loaded rows as read right after its wait, and the point the forward
    stream passed the last layer's wait."""

    views: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    last_wait: Any = None

    def mark_last_wait(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.last_wait = torch.cuda.Event()
            self.last_wait.record()

    def wait(self) -> None:
        """Return once the forward stream has passed the last layer's wait."""
        if self.last_wait is not None:
            self.last_wait.synchronize()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[layer]


def build_rig(opts: LiveOptions) -> Rig:
    """The device pool, its allocator and the cache with HiCache, as the scheduler builds them."""
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    device = torch.device(opts.device)
    server_args = ServerArgs(
        model_path="dummy",
        device=device.type,
        page_size=opts.page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=opts.host_ratio,
        hicache_io_backend=opts.io_backend,
        hicache_mem_layout=opts.layout,
        hicache_write_policy="write_through",
    )
    set_global_server_args_for_scheduler(server_args)
    kv_pool = MHATokenToKVPool(
        size=opts.device_tokens,
        page_size=opts.page_size,
        dtype=torch.bfloat16,
        head_num=opts.heads,
        head_dim=opts.head_dim,
        layer_num=opts.layers,
        device=str(device),
        enable_memory_saver=False,
    )
    allocator_args = dict(
        dtype=torch.bfloat16, device=str(device), kvcache=kv_pool, need_sort=False
    )
    if opts.page_size > 1:
        allocator = PagedTokenToKVPoolAllocator(
            size=opts.device_tokens, page_size=opts.page_size, **allocator_args
        )
    else:
        allocator = TokenToKVPoolAllocator(size=opts.device_tokens, **allocator_args)
    params = CacheInitParams(
        req_to_token_pool=ReqToTokenPool(
            size=8,
            max_context_len=opts.device_tokens,
            device=str(device),
            enable_memory_saver=False,
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=opts.page_size,
        disable=False,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=opts.tree_core,
    )
    cache = UnifiedRadixCache(params=params)
    # The budget check samples free host memory, which a lent VM reports low until used.
    with host_memory_budget_scope(1 << 50):
        cache.init_hicache(server_args, params)
    controller = cache.cache_controller
    if controller is None or kv_pool.layer_transfer_counter is None:
        raise RuntimeError("init_hicache attached no cache controller")
    host_pool = controller.mem_pool_host.anchor_entry.host_pool
    settings = {
        "host_pool": type(host_pool).__name__,
        "host_tokens": host_pool.size,
        "host_layout": host_pool.layout,
        "io_backend": controller.io_backend,
        "write_policy": controller.write_policy,
        "device_tokens": opts.device_tokens,
        "allocator": type(allocator).__name__,
        "write_through_threshold": cache.write_through_threshold,
        "load_back_threshold": cache.load_back_threshold,
        "tree_core": opts.tree_core,
    }
    if host_pool.layout != opts.layout or controller.io_backend != opts.io_backend:
        raise RuntimeError(f"SGLang resolved another layout or backend than asked: {settings}")
    counters = CacheCounters()
    counters.attach(cache)
    content = KVContent(opts.layers, opts.heads, opts.head_dim, device, seed=opts.trace.seed)
    return Rig(opts, device, cache, allocator, kv_pool, content, counters, settings)


def release(rig: Rig) -> None:
    """Unpin the host pool now rather than at exit."""
    import atexit

    sync(rig.device)
    atexit.unregister(rig.cache.shutdown)
    rig.cache.release_host_resources()
