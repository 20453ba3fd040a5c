"""kvcore's offload handlers for one phase of the vLLM soak, built as vLLM's worker gets them.

:func:`make_handlers` builds kvcore's store and load handlers over vLLM's own, as
``install_handlers`` builds them, each on a :class:`CountingStreams` that counts the events
it records and releases; :func:`close_handlers` shuts a phase's pair down and reports what
their events and stock's queues still held.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.vllm.offload_handlers import env_policy, runnable_stock, stock_handler
from benchmarks.vllm.sweep_pools import Pools
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams
from kvcore_vllm.transfers import KVCoreOffloadingHandler


class CountingStreams:
    """A :class:`~kvcore.streams.NamedStreams` that counts the events its handler
    records and releases (outstanding = recorded - released), passing every call on."""

    def __init__(self, inner: NamedStreams) -> None:
        self.inner = inner
        self.recorded = 0
        self.released = 0

    def stream(self, name: Hashable) -> Any:
        return self.inner.stream(name)

    def record(self, stream: Any) -> Any:
        self.recorded += 1
        return self.inner.record(stream)

    def release(self, event: Any) -> None:
        self.released += 1
        self.inner.release(event)

    def query(self, event: Any) -> bool:
        return self.inner.query(event)

    def synchronize(self, event: Any) -> None:
        self.inner.synchronize(event)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.inner.wait_event(stream, event)

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        self.inner.run_on(stream, fn)

    @property
    def outstanding(self) -> int:
        return self.recorded - self.released


@dataclass
class Handlers:
    """One phase's pair of kvcore handlers, with what counts their events and passes."""

    store: KVCoreOffloadingHandler
    load: KVCoreOffloadingHandler
    stocks: dict[str, Any]
    streams: dict[str, CountingStreams]
    metrics: Metrics


def make_handlers(
    pools: Pools, device: torch.device, mover: Mover, rule: bool, compute: Any
) -> Handlers:
    """kvcore's store and load handlers over vLLM's own, as ``install_handlers`` builds
    them (one mover for both, streams of their own), their events counted."""
    metrics = Metrics()
    handlers: dict[str, KVCoreOffloadingHandler] = {}
    stocks: dict[str, Any] = {}
    counted: dict[str, CountingStreams] = {}
    for name, gpu_to_cpu in (("store", True), ("load", False)):
        stock = stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=gpu_to_cpu)
        runnable = runnable_stock(stock, device)
        inner: Any = CudaStreams(device) if device.type == "cuda" else CpuSyncStreams()
        streams = CountingStreams(inner)
        compute_stream = (
            (lambda s=compute: s)
            if compute is not None
            else (lambda s=streams: s.stream("compute"))
        )
        handlers[name] = KVCoreOffloadingHandler(
            runnable,
            mover=mover,
            gpu_tensors=pools.gpu,
            streams=streams,
            compute_stream=compute_stream,
            name=name,
            metrics=metrics,
            stock_rules=rule,
            plan_policy=env_policy(gpu_to_cpu=gpu_to_cpu),
        )
        stocks[name], counted[name] = runnable, streams
    return Handlers(handlers["store"], handlers["load"], stocks, counted, metrics)


def close_handlers(handlers: Handlers) -> dict[str, Any]:
    """Shut the phase's handlers down; what their events and stock's queues held."""
    out: dict[str, Any] = {}
    for name, handler in (("store", handlers.store), ("load", handlers.load)):
        stock = handlers.stocks[name]
        out[name] = {
            "kvcore_events_outstanding": handlers.streams[name].outstanding,
            "kvcore_jobs_queued": _length(handler, "_jobs"),
            "stock_transfers_queued": _length(stock, "_transfers"),
            "stock_transfer_events": _length(stock, "_transfer_events"),
        }
        handler.shutdown()
    return out


def _length(obj: Any, name: str) -> int | None:
    found = getattr(obj, name, None)
    return None if found is None else len(found)
