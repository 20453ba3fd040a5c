"""What a copy costs the model's SMs: a GEMM batch's time alone and beside the copy.

A copy engine's DMA leaves the SMs to the model; a copy kernel (stock's or kvcore's
gather) takes some. The engine-shaped sweeps of both engines time a batch of bf16 GEMMs on
a stream of their own, sized to last about as long as the request, once alone and once
while each side's request runs; the throughput the batch keeps is alone / beside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks.sweep_report import SweepRow
from kvcore.bench.measure import sync_device

GEMM_SIZE = 4096
"""The square bf16 GEMM the batch repeats."""

SIDES = ("stock", "kvcore", "own")
"""The sides a row may hold a ``gemm_with_<side>_ms`` for (``own``: kvcore, rule off)."""


class GemmBatch:
    """A batch of GEMMs on ``device``, sized to last about ``request_ms``."""

    def __init__(self, device: torch.device, request_ms: float) -> None:
        if device.type != "cuda":
            raise ValueError(f"a GEMM batch times CUDA work, not {device}")
        self.device = device
        self._a = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device, dtype=torch.bfloat16)
        self._b = torch.randn_like(self._a)
        self._c = torch.empty_like(self._a)
        self._stream = torch.cuda.Stream(device)
        self.count = 8
        each_ms = self._timed(self._queue()) / self.count
        self.count = max(8, round(request_ms / each_ms))

    def alone_ms(self) -> float:
        return self._timed(self._queue())

    def beside_ms(self, copy: Callable[[], object]) -> float:
        """The batch's time with ``copy`` issued right after it (on the copy's own streams)."""
        sync_device(self.device)
        events = self._queue()
        copy()
        return self._timed(events)

    def _queue(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            for _ in range(self.count):
                torch.mm(self._a, self._b, out=self._c)
            end.record()
        return start, end

    def _timed(self, events: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
        sync_device(self.device)
        return events[0].elapsed_time(events[1])


def gemm_summary(rows: Sequence[SweepRow]) -> list[str]:
    """A line per cell that timed GEMMs beside its request: their throughput kept."""
    lines = []
    for row in rows:
        alone = row.extra.get("gemm_alone_ms")
        if not alone:
            continue
        kept = {
            side: alone / row.extra[f"gemm_with_{side}_ms"]
            for side in SIDES
            if row.extra.get(f"gemm_with_{side}_ms")
        }
        shares = ", ".join(f"{side} {100 * share:.0f}%" for side, share in kept.items())
        lines.append(f"GEMM throughput kept during {row.case} {row.tokens}: {shares}")
    return lines
