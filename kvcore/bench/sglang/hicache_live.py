"""SGLang 0.5.23's own HiCache machinery driven by a request trace, stock or with kvcore's hooks.

    python -m kvcore.bench.sglang.hicache_live --mode stock|kvcore --json OUT.json
        [--layout layer_first|page_first] [--seconds N] [--scale N] ...

SGLang cannot be served on the GPU machine, so this plays the scheduler's part around the
real cache: a ``UnifiedRadixCache`` with HiCache (``init_hicache``: its
``HybridCacheController``, host pool and ``L2TransferEngine``), write-through, over a
model-shaped MHA device pool (default 32 layers, 8 KV heads x 128, bf16, page 64) small
enough that the trace (:mod:`.hicache_trace`) pushes conversations out to the host pool
between their turns. Per request, as the scheduler and the model runner do:

1. ``check_hicache_events()`` (the scheduler's per-step poll: write-through and load-back
   acks, their locks);
2. ``match_prefix``; a host-only part is loaded back with the cache's ``load_back`` and
   ``ready_to_load_host_cache`` (the per-layer H2D loads on the transfer engine's stream);
3. the forward pass: the consumer index is set on the layer-done counter
   (``tp_worker.set_hicache_consumer``), then every layer in order reads its KV through
   the device pool's ``get_kv_buffer``, which waits for that layer's load
   (``LayerDoneCounter.wait_until``); right after each wait the layer's loaded rows are
   copied on the forward stream, as attention would read them. A load-back is timed from
   the ``load_back`` call until the forward stream has passed the last layer's wait (an
   event after it, synchronised: host and device together);
4. every loaded token's K and V in every layer is checked byte for byte against the
   content that belongs there (:mod:`.kv_content`): as read after each layer's wait (a
   layer signalled before its copy landed fails here), and again from the pool once the
   device is idle, with the tokens that were already resident;
5. prefill: device slots for the new tokens (``evict_from_tree_cache`` first, the
   allocator's eviction as the scheduler calls it), content written, the whole sequence
   inserted, which starts its write-through backup.

Two differences from a live scheduler, both so that the two modes see one trace: a step's
backups are submitted at its end (``flush_pending_backups``; the scheduler does it at the
next step's poll) and the device is drained before the next step starts, so a load-back
never shares the link with a backup and every ack is reaped at the same point in both
modes (the same evictions, the same hits). Before the trace a short warm-up trace (its
own token ids) builds SGLang's JIT kernels and kvcore's, then the cache is reset as
``flush_cache`` resets it.

``--mode kvcore`` sets ``KVCORE_ENABLE=sglang`` and ``KVCORE_TRANSFERS=1`` and ``stock``
sets ``KVCORE_ENABLE=0``; both then load SGLang's plugins as its scheduler does
(:mod:`.engine_plugins`), before anything is built.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvcore.bench.sglang.hicache_trace import Request, TraceShape, last_token_id, make_trace
from kvcore.bench.sglang.kv_content import KVContent

MODES = ("stock", "kvcore")
LAYOUTS = ("layer_first", "page_first")
# A device pool of 40960 tokens (5 GiB at the default geometry) holds the largest request
# (32000 tokens and its turns) but not two conversations' worth: turns come back from host.
DEVICE_TOKENS = 40960
# The host pool holds the whole trace's working set (~205k tokens at the defaults).
HOST_RATIO = 6.0


@dataclass(frozen=True)
class LiveOptions:
    mode: str = "stock"
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

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer (bf16 K and V)."""
        return self.layers * 2 * self.heads * self.head_dim * 2


@dataclass
class RequestResult:
    index: int
    conversation: int
    turn: int
    first_turn_tokens: int
    prompt_tokens: int
    tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    loaded_tokens: int = 0
    loadback_ms: float | None = None
    issue_ms: float | None = None
    """Host time of ``load_back`` and ``ready_to_load_host_cache`` (every layer's copy issued)."""
    loadback_declined: bool = False
    mismatched_bytes: int = 0
    """Loaded tokens' bytes that differ from their content, every layer's K and V, as read
    right after the layer's wait."""
    settled_mismatched_bytes: int = 0
    """The same, read from the device pool once the device is idle."""
    resident_mismatched_bytes: int = 0
    """The prefix that was already on the device, read once the device is idle."""
    error: str | None = None

    @property
    def check_passed(self) -> bool:
        wrong = self.mismatched_bytes + self.settled_mismatched_bytes
        return self.error is None and wrong + self.resident_mismatched_bytes == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "check_passed": self.check_passed}


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the cache ----------------------------------------------------------------------------


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


# --- one request --------------------------------------------------------------------------


def _key(tokens: Sequence[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _span(request: Request, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, positions) of ``request``'s tokens ``start .. end - 1``."""
    ids = torch.tensor(request.tokens[start:end], dtype=torch.int64)
    return ids, torch.arange(start, end, dtype=torch.int64)


def serve(rig: Rig, request: Request) -> RequestResult:
    """One scheduler step holding one request (see the module's steps 1 to 5)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    cache = rig.cache
    sync(rig.device)
    cache.check_hicache_events()
    match = cache.match_prefix(MatchPrefixParams(key=_key(request.tokens)))
    result = RequestResult(
        index=request.index,
        conversation=request.conversation,
        turn=request.turn,
        first_turn_tokens=request.first_turn_tokens,
        prompt_tokens=request.prompt_tokens,
        tokens=len(request.tokens),
        device_hit_tokens=match.device_prefix_len,
        host_hit_tokens=match.host_hit_length,
    )
    anchor = match.last_device_node
    resident = match.device_prefix_len
    started = time.perf_counter()
    loading = match.host_hit_length > 0 and cache.load_back(match.best_match_node)
    consumer = cache.ready_to_load_host_cache()
    issued = time.perf_counter()
    if loading:
        anchor = match.best_match_node
    # The batch's prefix slots, as prepare_for_extend takes them after the load is started.
    prefix = cache.path_device_indices(anchor)
    reads = rig.forward_pass(consumer, prefix[resident:] if loading else None)
    reads.wait()
    finished = time.perf_counter()
    sync(rig.device)
    if loading:
        result.loadback_ms = (finished - started) * 1e3
        result.issue_ms = (issued - started) * 1e3
    result.loadback_declined = match.host_hit_length > 0 and not loading
    result.loaded_tokens = len(prefix) - resident
    lock = cache.inc_lock_ref(anchor).to_dec_params()
    try:
        _check(rig, request, result, prefix, reads if loading else None)
        result.error = _prefill(rig, request, prefix)
    finally:
        cache.dec_lock_ref(anchor, lock)
        # The scheduler submits these at its next poll; here before the drain (see above).
        cache.flush_pending_backups()
    return result


def _check(
    rig: Rig,
    request: Request,
    result: RequestResult,
    prefix: torch.Tensor,
    reads: LayerReads | None,
) -> None:
    """Count the prefix's wrong bytes: the loaded rows as each layer read them, then the
    loaded and the resident rows in the idle pool."""
    resident = result.device_hit_tokens
    loaded = _span(request, resident, len(prefix))
    if reads is not None:
        every_row = torch.arange(result.loaded_tokens, device=rig.device)
        result.mismatched_bytes = rig.content.mismatched_bytes(reads.layer, every_row, *loaded)
        # Before the prefill needs the memory.
        reads.views.clear()
    result.settled_mismatched_bytes = rig.content.mismatched_bytes(
        rig.layer_buffers, prefix[resident:], *loaded
    )
    result.resident_mismatched_bytes = rig.content.mismatched_bytes(
        rig.layer_buffers, prefix[:resident], *_span(request, 0, resident)
    )


def _prefill(rig: Rig, request: Request, prefix: torch.Tensor) -> str | None:
    """Slots and content for the tokens past ``prefix``, the sequence inserted (which queues
    its write-through); why not, if the device has no room."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    new_tokens = len(request.tokens) - len(prefix)
    if new_tokens <= 0:
        return None
    evict_from_tree_cache(rig.cache, new_tokens)
    slots = rig.allocator.alloc(new_tokens)
    if slots is None:
        return f"no device room for {new_tokens} new tokens"
    rig.content.fill(rig.layer_buffers, slots, *_span(request, len(prefix), len(request.tokens)))
    # prev_prefix_len: the prefix's slots are the tree's own, not duplicates to free
    # (as checkpoint_into_tree passes the request's protected length).
    rig.cache.insert(
        InsertParams(
            key=_key(request.tokens),
            value=torch.cat([prefix, slots]),
            prev_prefix_len=len(prefix),
        )
    )
    return None


def run_trace(
    rig: Rig,
    requests: Sequence[Request],
    seconds: float = math.inf,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[list[RequestResult], bool]:
    """Serve ``requests`` in order; the results and whether the time ran out first."""
    results: list[RequestResult] = []
    started = time.perf_counter()
    for request in requests:
        if time.perf_counter() - started > seconds:
            return results, True
        try:
            result = serve(rig, request)
        except Exception as exc:
            # The cache's state is unknown after a failure inside it: stop, keep what ran.
            results.append(_failed(request, exc))
            progress(_line(results[-1]))
            return results, False
        results.append(result)
        if result.loadback_ms is not None or not result.check_passed:
            progress(_line(result))
    sync(rig.device)
    rig.cache.check_hicache_events()
    return results, False


def _failed(request: Request, exc: Exception) -> RequestResult:
    return RequestResult(
        index=request.index,
        conversation=request.conversation,
        turn=request.turn,
        first_turn_tokens=request.first_turn_tokens,
        prompt_tokens=request.prompt_tokens,
        tokens=len(request.tokens),
        device_hit_tokens=0,
        host_hit_tokens=0,
        error=f"{type(exc).__name__}: {exc}"[:500],
    )


def _line(r: RequestResult) -> str:
    took = f"{r.loadback_ms:.2f} ms" if r.loadback_ms is not None else "no load"
    verdict = "ok" if r.check_passed else f"MISMATCH {r.mismatched_bytes} B {r.error or ''}"
    where = f"#{r.index} conv {r.conversation} turn {r.turn}"
    return f"{where}: {r.loaded_tokens} loaded, {took}, {verdict}"


def warm_up(rig: Rig, requests: Sequence[Request]) -> dict[str, Any]:
    """A short trace of its own token ids (JIT kernels built, kvcore's paths planned once),
    then everything reset as the scheduler's ``flush_cache`` resets it."""
    shape = replace(
        rig.opts.trace,
        conversations=min(rig.opts.trace.conversations, len(rig.opts.trace.first_turn_tokens)),
        turns=2,
        first_token_id=last_token_id(requests) + 1,
    )
    started = time.perf_counter()
    results, _ = run_trace(rig, make_trace(shape))
    rig.cache.reset()
    rig.allocator.clear()
    rig.counters.reset()
    from kvcore.metrics import METRICS

    METRICS.reset()
    return {
        "requests": len(results),
        "loadbacks": sum(r.loadback_ms is not None for r in results),
        "failed_checks": sum(not r.check_passed for r in results),
        "seconds": round(time.perf_counter() - started, 3),
    }


# --- the report ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest rank; None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked), max(1, math.ceil(q * len(ranked)))) - 1]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def by_size(results: Sequence[RequestResult], token_bytes: int) -> list[dict[str, Any]]:
    """Per first-turn size bucket: its load-backs' tokens and times, medians."""
    rows = []
    for size in sorted({r.first_turn_tokens for r in results}):
        loads = [r for r in results if r.first_turn_tokens == size and r.loadback_ms is not None]
        if not loads:
            continue
        ms = statistics.median(r.loadback_ms for r in loads if r.loadback_ms is not None)
        tokens = statistics.median(r.loaded_tokens for r in loads)
        rows.append(
            {
                "first_turn_tokens": size,
                "loadbacks": len(loads),
                "loaded_tokens_p50": tokens,
                "loadback_ms_p50": _round(ms),
                "gb_per_s": _round(tokens * token_bytes / ms / 1e6) if ms else None,
            }
        )
    return rows


def summarize(
    results: Sequence[RequestResult], counters: CacheCounters, token_bytes: int
) -> dict[str, Any]:
    loads = [r for r in results if r.loadback_ms is not None]
    ms = [r.loadback_ms for r in loads if r.loadback_ms is not None]
    issue = [r.issue_ms for r in loads if r.issue_ms is not None]
    return {
        "requests": len(results),
        "loadbacks": len(loads),
        "loadbacks_declined": sum(r.loadback_declined for r in results),
        "loadback_ms_p50": _round(statistics.median(ms)) if ms else None,
        "loadback_ms_p99": _round(percentile(ms, 0.99)),
        "issue_ms_p50": _round(statistics.median(issue)) if issue else None,
        "loaded_tokens": sum(r.loaded_tokens for r in results),
        "device_hit_tokens": sum(r.device_hit_tokens for r in results),
        "host_hit_tokens": sum(r.host_hit_tokens for r in results),
        "mismatched_bytes": sum(r.mismatched_bytes + r.resident_mismatched_bytes for r in results),
        "settled_mismatched_bytes": sum(r.settled_mismatched_bytes for r in results),
        "checks_failed": sum(not r.check_passed for r in results),
        "errors": sum(r.error is not None for r in results),
        "evictions": {
            "calls": counters.evict_calls,
            "device_tokens": counters.evicted_tokens,
            "dropped_tokens": counters.dropped_tokens,
            "host_calls": counters.host_evict_calls,
            "host_tokens": counters.host_evicted_tokens,
        },
        "write_throughs": {
            "ops": counters.write_through_ops,
            "tokens": counters.write_through_tokens,
        },
        "by_size": by_size(results, token_bytes),
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _kvcore_counters() -> dict[str, Any]:
    from kvcore.metrics import METRICS

    return METRICS.snapshot()


def prepare(opts: LiveOptions) -> dict[str, Any]:
    """What must happen before SGLang builds anything: import stand-ins, plugins, JIT."""
    from kvcore.bench.sglang.protocol_stubs import install_protocol_stubs

    done: dict[str, Any] = {"stubbed_imports": install_protocol_stubs()}
    if opts.device.startswith("cuda"):
        from kvcore.bench.sglang.jit_kernels import warm_jit
        from kvcore.bench.sglang.pool_case import Options
        from kvcore.bench.sglang.sgl_kernel_stub import install_sgl_kernel_stub

        done["sgl_kernel"] = "stub (not installed)" if install_sgl_kernel_stub() else "installed"
        done["jit"] = warm_jit(Options(device=torch.device(opts.device)))
    from kvcore.bench.sglang.engine_plugins import load_sglang_plugins

    done["plugins"] = load_sglang_plugins(opts.mode)
    return done


def run(opts: LiveOptions, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Prepare, build, warm up, serve the trace; the report (JSON-ready)."""
    prepared = prepare(opts)
    import sglang

    rig = build_rig(opts)
    requests = make_trace(opts.trace)
    try:
        warm = warm_up(rig, requests) if opts.warmup else None
        started = time.perf_counter()
        results, cut_short = run_trace(rig, requests, opts.seconds, progress)
        wall = time.perf_counter() - started
        summary = summarize(results, rig.counters, opts.token_bytes)
        summary.update(wall_s=round(wall, 3), cut_short=cut_short, trace_requests=len(requests))
    finally:
        release(rig)
    return {
        "mode": opts.mode,
        "layout": opts.layout,
        "io_backend": opts.io_backend,
        "device": _device_name(rig.device),
        "engine": "sglang",
        "version": getattr(sglang, "__version__", "unknown"),
        "torch": torch.__version__,
        "geometry": {
            "layers": opts.layers,
            "kv_heads": opts.heads,
            "head_dim": opts.head_dim,
            "dtype": "bfloat16",
            "page_size": opts.page_size,
            "token_bytes": opts.token_bytes,
        },
        "trace": asdict(opts.trace),
        "cache": rig.settings,
        "prepared": prepared,
        "warmup": warm,
        "summary": summary,
        "requests": [r.to_dict() for r in results],
        "kvcore_counters": _kvcore_counters() if opts.mode == "kvcore" else None,
    }


# --- command line -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--json", type=Path, required=True, help="where the report goes")
    parser.add_argument("--layout", choices=LAYOUTS, default="layer_first")
    parser.add_argument("--seconds", type=float, default=60.0, help="the trace's time budget")
    parser.add_argument("--io-backend", choices=("kernel", "direct"), default="kernel")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda; cpu only inside the test stand-ins (tests/integration/sglang/hicache_cpu.py)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--device-tokens", type=int, default=None, help="default 40960 / scale")
    parser.add_argument("--host-ratio", type=float, default=HOST_RATIO)
    parser.add_argument("--conversations", type=int, default=TraceShape.conversations)
    parser.add_argument("--turns", type=int, default=TraceShape.turns)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=1, help="divide every trace length by this")
    parser.add_argument("--no-warmup", action="store_true")
    return parser.parse_args(argv)


def options_for(args: argparse.Namespace) -> LiveOptions:
    trace = TraceShape(
        conversations=args.conversations,
        turns=args.turns,
        seed=args.seed,
        page_size=args.page_size,
        scale=args.scale,
    )
    device_tokens = args.device_tokens or trace.length(DEVICE_TOKENS)
    return LiveOptions(
        mode=args.mode,
        layout=args.layout,
        io_backend=args.io_backend,
        device=args.device,
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        device_tokens=device_tokens,
        host_ratio=args.host_ratio,
        trace=trace,
        seconds=args.seconds,
        warmup=not args.no_warmup,
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = options_for(args)

    def progress(line: str) -> None:
        print(f"[{opts.mode}] {line}", file=sys.stderr, flush=True)

    report = run(opts, progress)
    write_report(report, args.json)
    s = report["summary"]
    print(
        f"[{opts.mode}] {report['device']} {opts.layout}/{opts.io_backend}: "
        f"{s['requests']} requests, {s['loadbacks']} load-backs, "
        f"p50 {s['loadback_ms_p50']} ms, p99 {s['loadback_ms_p99']} ms, "
        f"mismatched bytes {s['mismatched_bytes']}, evicted {s['evictions']['device_tokens']}, "
        f"written through {s['write_throughs']['tokens']} tokens"
    )
    return 1 if s["checks_failed"] or s["loadbacks"] == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
