"""What in a benchmark's process could slow every Python call in it, read at one moment.

The live HiCache driver records this per mode, so that a difference between modes that no
profile of kvcore's own calls explains (a whole path 1.3x slower with two kvcore frames
in it) can be told apart: a tracer or profiler, a ``sys.monitoring`` tool, threads that
compete for the GIL, a cyclic collector with more to walk, CPUs taken away, a CUDA stream
other than the default made current, or simply slower Python calls (``python_call_us``).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

_CALLS = 10_000
_ROUNDS = 5


def _nothing() -> None:
    return None


def python_call_us(calls: int = _CALLS, rounds: int = _ROUNDS) -> float:
    """Median over ``rounds`` of the microseconds that 1000 calls of an empty function
    take here: the same loop in two processes on one machine compares their Python."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            _nothing()
        times.append((time.perf_counter() - started) * 1e6 * 1000 / calls)
    return round(statistics.median(times), 3)


def _monitoring_tools() -> list[str]:
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return []
    return [name for tool in range(6) if (name := monitoring.get_tool(tool)) is not None]


def _cpus() -> int | None:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else None


def _current_stream_is_default(device: torch.device) -> bool | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


def process_state(device: torch.device) -> dict[str, Any]:
    """This process's state for ``device``, as JSON-ready values."""
    return {
        "python_call_us": python_call_us(),
        "tracer": sys.gettrace() is not None,
        "profiler": sys.getprofile() is not None,
        "monitoring_tools": _monitoring_tools(),
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "gc_tracked_objects": len(gc.get_objects()),
        "gc_counts": list(gc.get_count()),
        "torch_threads": torch.get_num_threads(),
        "cpus": _cpus(),
        "current_stream_is_default": _current_stream_is_default(device),
    }
