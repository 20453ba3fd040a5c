"""How the core suite lays out, times and checks a copy: scattered slot ids, device and host
seconds behind a spin kernel, random rows, pinned host rows, one result row per path, and
what pinning host memory costs."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.row_words import as_row_words


def device_named(name: str) -> torch.device | str:
    """The device a ``--device`` option names (``auto``: CUDA where there is one), or why
    there is none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but CUDA is not available"
    return torch.device(name)


def sync_device(device: torch.device) -> None:
    """Wait for everything queued on ``device`` (every stream); nothing to wait for on a
    CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scattered_layout(
    rows: int, fragmentation: float, unit: int, generator: torch.Generator
) -> torch.Tensor:
    """Slot ids for ``rows`` rows in a pool twice that size.

    ``fragmentation`` of the ``unit``-row chunks are moved to random places beyond
    the first run; the rest stay where a fresh pool would put them.
    """
    chunks = rows // unit
    moved = round(chunks * fragmentation)
    chunk_slots = torch.arange(chunks, dtype=torch.int64)
    if moved:
        which = torch.randperm(chunks, generator=generator)[:moved]
        elsewhere = torch.randperm(chunks, generator=generator)[:moved] + chunks
        chunk_slots[which] = elsewhere
    return (chunk_slots[:, None] * unit + torch.arange(unit)).flatten()


# About 10 ms of a spin kernel on an H200 (~2 GHz), longer than any submission measured.
SUBMIT_COVER_CYCLES = 20_000_000


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median device seconds and median host seconds to issue ``fn``."""
    device_times, host_times = timed_repeats(fn, device, repeats)
    return statistics.median(device_times), statistics.median(host_times)


def timed_repeats(
    fn: Callable[[], object], device: torch.device, repeats: int
) -> tuple[list[float], list[float]]:
    """Device seconds and host seconds to issue ``fn``, one of each per repeat."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    device_times: list[float] = []
    host_times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the host submits, as an engine queuing layer after
            # layer does: device time is then the copy's own, host time is reported apart.
            torch.cuda._sleep(SUBMIT_COVER_CYCLES)
            start.record()
            t0 = time.perf_counter()
            fn()
            host_times.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            device_times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            host_times.append(elapsed)
            device_times.append(elapsed)
    return device_times, host_times


def queued_host_seconds(
    fn: Callable[[], object],
    device: torch.device,
    calls: int = 16,
    spin_cycles: int = SUBMIT_COVER_CYCLES,
) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn`` issued one after another behind a
    spin kernel of ``spin_cycles``, as an engine issues layer after layer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda._sleep(spin_cycles)
    host_times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host_times


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random bytes (NaN patterns included), never zeros."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def host_rows(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, Any]:
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    buffer = allocate_host_buffer(nbytes, pin=pin)
    return buffer.tensor.view(dtype).view(shape), buffer


def bytes_identical(dst: torch.Tensor, expected: torch.Tensor) -> bool:
    a, b = as_row_words(dst), as_row_words(expected)
    if a is None or b is None:
        return False
    return bool(torch.equal(a, b))


def result_row(
    scenario: str,
    path: str,
    nbytes: int,
    seconds: float,
    host_seconds: float,
    identical: bool,
    ceiling: float,
    kind: str,
) -> dict[str, Any]:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return {
        "scenario": scenario,
        "path": path,
        "bytes": nbytes,
        "gbps": gbps,
        "identical": identical,
        "kind": kind,
        "share_of_ceiling": gbps / ceiling if ceiling else 0.0,
        "submit_us": host_seconds * 1e6,
    }


def count_host_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """Synchronising CUDA calls that a warm ``fn`` makes, by torch's sync debugger (None on CPU).

    The first call is left out: it may allocate the staging buffer and the index ring once.
    """
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    # The debugger also warns that it is a prototype; only its per-call warnings count.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def measure_pinning(nbytes: int) -> dict[str, float] | None:
    """Seconds per GiB to make (pre-fault and register) and to release pinned host memory."""
    if not torch.cuda.is_available():
        return None
    started = time.perf_counter()
    buffer = allocate_host_buffer(nbytes, pin=True)
    pinned = time.perf_counter()
    buffer.close()
    released = time.perf_counter()
    gib = nbytes / 2**30
    return {
        "gib": gib,
        "pin_s_per_gib": (pinned - started) / gib,
        "release_s_per_gib": (released - pinned) / gib,
    }
