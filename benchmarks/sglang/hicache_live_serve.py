"""One request of the live HiCache run, served and checked as the scheduler and model runner would.

:func:`serve` is one scheduler step holding one request (the steps 1 to 5 of
:mod:`benchmarks.sglang.hicache_live`): the cache's poll, the prefix match and load-back,
the forward pass, the byte check of every loaded token and the prefill; its
:class:`RequestResult` holds the times and the wrong bytes. :func:`run_trace` serves a
trace in order, and :func:`warm_up` a short one of its own before the cache is reset.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from benchmarks.sglang.hicache_live_rig import LayerReads, Rig, sync
from benchmarks.sglang.hicache_trace import Request, last_token_id, make_trace
from kvcore.stock_share import REASON as STOCK_SHARE


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
    start_loading_ms: float | None = None
    """Host time of ``ready_to_load_host_cache`` alone (moving the indices and every
    layer's load call)."""
    loadback_declined: bool = False
    copy: str | None = None
    """Whose copy loaded it back: ``kvcore`` (kvcore's transfers ran), ``stock_share``
    (drawn for stock's, ``KVCORE_STOCK_SHARE``) or ``stock``; None without a load-back."""
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


def _key(tokens: Sequence[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _span(request: Request, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, positions) of ``request``'s tokens ``start .. end - 1``."""
    ids = torch.tensor(request.tokens[start:end], dtype=torch.int64)
    return ids, torch.arange(start, end, dtype=torch.int64)


def serve(rig: Rig, request: Request) -> RequestResult:
    """One scheduler step holding one request (the run's steps 1 to 5)."""
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
    counted = _load_counts()
    started = time.perf_counter()
    loading = match.host_hit_length > 0 and cache.load_back(match.best_match_node)
    queued = time.perf_counter()
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
        result.start_loading_ms = (issued - queued) * 1e3
        result.copy = _copy_since(counted)
    result.loadback_declined = match.host_hit_length > 0 and not loading
    result.loaded_tokens = len(prefix) - resident
    lock = cache.inc_lock_ref(anchor).to_dec_params()
    try:
        _check(rig, request, result, prefix, reads if loading else None)
        result.error = _prefill(rig, request, prefix)
    finally:
        cache.dec_lock_ref(anchor, lock)
        # The scheduler submits these at its next poll; here before the drain (see the
        # run's differences from a live scheduler).
        cache.flush_pending_backups()
    return result


def _load_counts() -> tuple[int, int]:
    """kvcore's host-to-device transfers and its stock-share passes, counted so far."""
    from kvcore.metrics import METRICS

    snapshot = METRICS.snapshot()
    transfers = sum(row["count"] for row in snapshot["transfers"] if row["direction"] == "h2d")
    return transfers, snapshot["fallbacks"].get(STOCK_SHARE, 0)


def _copy_since(counted: tuple[int, int]) -> str:
    transfers, shared = _load_counts()
    if shared > counted[1]:
        return STOCK_SHARE
    return "kvcore" if transfers > counted[0] else "stock"


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
