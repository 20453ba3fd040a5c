"""The two sides of the vLLM sweep's requests (:mod:`benchmarks.vllm.sweep`): stock, kvcore.

A :class:`Side` is one handler a request runs through, timed wall-clock and host-side,
with, for kvcore's, the metrics its handler and its mover count into (the jobs it left to
stock, the paths it took). :func:`stock_side` is vLLM's handler as it can run here, named
by its copy op, or why it cannot; :func:`kvcore_side` is kvcore's handler over it. Apart
from the sweep's cells and passes, which only order the sides and read their samples.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.vllm.offload_handlers import (
    compiled_ops_loaded,
    env_policy,
    kvcore_handler,
    runnable_stock,
    submit_and_collect,
    submit_and_step,
)
from kvcore.kernels.batch_copy import batch_copy_available
from kvcore.metrics import Metrics
from kvcore.mover import Mover


@dataclass
class Samples:
    """One side's requests of one cell."""

    wall: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def median_ms(self, values: list[float]) -> float:
        return statistics.median(values) * 1e3 if values else math.nan


class Side:
    """One handler and, for kvcore's, the metrics its handler and its mover count into."""

    def __init__(
        self,
        name: str,
        handler: Any,
        device: torch.device,
        handler_metrics: Metrics | None = None,
        mover_metrics: Metrics | None = None,
    ) -> None:
        self.name = name
        self.handler = handler
        self.device = device
        self.handler_metrics = handler_metrics
        self.mover_metrics = mover_metrics

    def run(
        self,
        specs: list[tuple[int, tuple[Any, Any]]],
        between: Callable[[], object] | None = None,
    ) -> tuple[float, float, list[Any]]:
        """Wall-clock and host seconds of one request's jobs, and the results reported;
        ``between`` runs once they are submitted, before they are waited for."""
        _synchronize(self.device)
        submit: list[float] = []
        started = time.perf_counter()
        results = submit_and_collect(self.handler, specs, submit, between)
        return time.perf_counter() - started, sum(submit), results

    def run_steps(
        self, specs: list[tuple[int, tuple[Any, Any]]], step: Callable[[], object], max_steps: int
    ) -> tuple[float, float, list[Any], list[float]]:
        """One request's jobs through the engine's step loop
        (:func:`~benchmarks.vllm.offload_handlers.submit_and_step`): its start, the host
        seconds its submissions took, the results reported and each step's end, on the
        ``time.perf_counter`` clock."""
        _synchronize(self.device)
        submit: list[float] = []
        started = time.perf_counter()
        results, ends = submit_and_step(self.handler, specs, submit, step, max_steps)
        return started, sum(submit), results, ends

    def fallbacks(self) -> Counter[str]:
        """Jobs the handler left to stock so far, per reason."""
        return _fallbacks(self.handler_metrics)

    def degraded(self) -> Counter[str]:
        """Submissions kvcore's mover issued a slower way of its own than planned, per reason."""
        return _fallbacks(self.mover_metrics)

    def mover_paths(self) -> Counter[str]:
        """Submissions kvcore's mover made so far, per path."""
        counts: Counter[str] = Counter()
        if self.mover_metrics is not None:
            for transfer in self.mover_metrics.snapshot()["transfers"]:
                counts[transfer["path"]] += transfer["count"]
        return counts


def stock_side(stock: Any, device: torch.device) -> tuple[str, Side | None]:
    """vLLM's handler as it can run here, named by its copy op; or why it cannot."""
    if device.type != "cuda":
        return "not runnable on cpu (vLLM's handler pins descriptors, records device events)", None
    if isinstance(stock._swap_blocks_batch, functools.partial):
        label = "handler/triton-kernel"
    elif compiled_ops_loaded():
        label = "handler/compiled-op"
    elif batch_copy_available():
        label = "handler/copy-op-emulated(cudaMemcpyBatchAsync)"
    else:
        return "not runnable (no compiled copy op, no cudaMemcpyBatchAsync)", None
    return label, Side("stock", runnable_stock(stock, device), device)


def _fallbacks(metrics: Metrics | None) -> Counter[str]:
    return Counter() if metrics is None else Counter(metrics.snapshot()["fallbacks"])


def kvcore_side(stock: Any, device: torch.device, *, rule: bool = True) -> Side:
    """kvcore's handler over ``stock``; without its serve-or-pass ``rule`` it is the ``own``
    side: kvcore's own paths wherever it can copy."""
    handler_metrics, mover_metrics = Metrics(), Metrics()
    handler = kvcore_handler(
        runnable_stock(stock, device),
        metrics=handler_metrics,
        mover=Mover(env_policy(), metrics=mover_metrics),
        stock_rules=rule,
        plan_policy=env_policy(gpu_to_cpu=stock.gpu_to_cpu),
    )
    name = "kvcore" if rule else "own"
    return Side(name, handler, device, handler_metrics, mover_metrics)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
