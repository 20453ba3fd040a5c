"""What ``kvcore doctor`` says about host memory for the engines' pinned host pools.

The machine's side of pinning a large pool: the memory free to take, the NUMA nodes and
which one each GPU hangs off, and, for a pool size asked about, how long its pages take
to fault in and register here, measured on a sample of this machine's memory: once the
engines' way (one thread, the faults taken during registration) and once kvcore's
(:func:`kvcore.host_pinning.populate` from every usable CPU, then registration).
"""

from __future__ import annotations

import mmap
import time
from pathlib import Path
from typing import Any

from kvcore import host_mapping, host_pinning, numa
from kvcore.shared_segments import segment_count

MEMINFO = Path("/proc/meminfo")
"""Where the kernel's memory counters are read from (tests point it elsewhere)."""

SAMPLE_BYTES = 2 << 30
"""The most memory an estimate samples: on 256 MiB the threads' start-up and the driver's
first registration outweighed the work, and the estimate came out 2-4x too slow."""
MIN_SAMPLE_BYTES = 64 << 20
GIB = 1 << 30


def available_bytes() -> int | None:
    """MemAvailable: what can be allocated without swapping; None where the kernel does
    not say."""
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def topology() -> dict[str, Any]:
    """The NUMA nodes with their CPU counts, and each CUDA device's node (None: unknown)."""
    nodes = []
    for node in numa.online_nodes():
        try:
            cpus = len(numa.node_cpus(node))
        except numa.NumaError:
            cpus = 0
        nodes.append({"node": node, "cpus": cpus})
    gpu_nodes: list[int | None] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpu_nodes = [numa.cuda_numa_node(i) for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError):
        gpu_nodes = []
    return {"nodes": nodes, "gpu_nodes": gpu_nodes}


def cuda_registrar() -> host_pinning.HostRegistrar | None:
    """cudaHostRegister through torch's runtime bindings; None without CUDA."""
    try:
        return host_pinning.CudaHostRegistrar()
    except (host_pinning.PinnedMemoryError, RuntimeError):
        return None


def _timed_sample(
    sample_bytes: int,
    threads: int | None,
    registrar: host_pinning.HostRegistrar | None,
    segments: int = 1,
) -> tuple[float, float]:
    """Seconds to fault in a fresh sample of shared memory over ``segments`` files
    (``threads``; None: leave it to registration) and to register it (0 without a
    registrar)."""
    sample = host_mapping.host_memory(sample_bytes, segments)
    address = sample.address
    try:
        started = time.perf_counter()
        if threads is not None:
            host_pinning.populate(address, sample_bytes, threads)
        faulted = time.perf_counter()
        if registrar is not None:
            registrar.register(address, sample_bytes)
        registered = time.perf_counter()
        if registrar is not None:
            registrar.unregister(address)
        return faulted - started, registered - faulted
    finally:
        sample.close()


def sample_size(pool_bytes: int, available: int | None) -> int:
    """The sample an estimate of ``pool_bytes`` measures: the whole pool up to
    :data:`SAMPLE_BYTES`, and no more than a quarter of the ``available`` memory (the
    sample is taken three times, one after the other), in whole pages."""
    size = min(pool_bytes, SAMPLE_BYTES)
    if available is not None:
        size = min(size, available // 4)
    size = max(size, MIN_SAMPLE_BYTES)
    return size - size % mmap.PAGESIZE


def _warm_up(registrar: host_pinning.HostRegistrar) -> None:
    """One small registration, so that the driver's one-time set-up is not timed."""
    buffer = host_mapping.host_memory(mmap.PAGESIZE, segments=1)
    try:
        registrar.register(buffer.address, mmap.PAGESIZE)
        registrar.unregister(buffer.address)
    finally:
        buffer.close()


def pin_estimate(
    pool_bytes: int,
    *,
    sample_bytes: int | None = None,
    threads: int | None = None,
    registrar: host_pinning.HostRegistrar | None = None,
    first_bytes: int = 0,
) -> dict[str, Any]:
    """How long ``pool_bytes`` take to pin here, scaled from a sample: the engines' way
    (registration faults every page in, on one thread; measured only with a registrar)
    and kvcore's (``threads`` fault the pages in, then registration); with ``first_bytes``
    (``KVCORE_HOST_POOL_PIN_FIRST``), also until that first share is pinned: SGLang's
    pool usable (every page faulted in, then the first share registered,
    :mod:`kvcore_sglang.pool_pinning`) and vLLM's shared tier usable (the first share alone
    faulted in and registered, :mod:`kvcore_vllm.region_pinning`)."""
    if sample_bytes is None:
        sample_bytes = sample_size(pool_bytes, available_bytes())
    threads = host_pinning.usable_cpus() if threads is None else threads
    scale = pool_bytes / sample_bytes
    if registrar is not None:
        _warm_up(registrar)
    # kvcore's way spreads a pool over as many files as the pool would take
    # (kvcore.host_mapping.faulted_memory), the engines' way faults one.
    segments = min(segment_count(pool_bytes), sample_bytes // mmap.PAGESIZE)
    fault_s, register_s = _timed_sample(sample_bytes, threads, registrar, segments)
    one_thread_s, _ = _timed_sample(sample_bytes, 1, None)
    # The first share, in samples.
    first_share = min(first_bytes, pool_bytes) / sample_bytes
    stock_s = None
    if registrar is not None:
        _, stock_register_s = _timed_sample(sample_bytes, None, registrar)
        stock_s = stock_register_s * scale
    return {
        "pool_bytes": pool_bytes,
        "sample_bytes": sample_bytes,
        "threads": threads,
        "fault_gib_per_s": _rate(sample_bytes, fault_s),
        "fault_one_thread_gib_per_s": _rate(sample_bytes, one_thread_s),
        "register_gib_per_s": _rate(sample_bytes, register_s) if registrar else None,
        "kvcore_seconds": (fault_s + register_s) * scale if registrar else fault_s * scale,
        "stock_seconds": stock_s,
        "first_bytes": first_bytes,
        "kvcore_usable_seconds": (
            fault_s * scale + register_s * first_share if first_bytes and registrar else None
        ),
        "vllm_region_usable_seconds": (
            (fault_s + register_s) * first_share if first_bytes and registrar else None
        ),
    }


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / GIB / max(seconds, 1e-9)


def host_report(pool_gib: float | None = None, first_bytes: int = 0) -> dict[str, Any]:
    """Doctor's host-memory section; with ``pool_gib``, the pin estimate for that size
    (and, with ``first_bytes``, until that first share is pinned)."""
    report: dict[str, Any] = {
        "available_bytes": available_bytes(),
        "usable_cpus": host_pinning.usable_cpus(),
        **topology(),
        "pin_estimate": None,
    }
    if pool_gib is not None:
        report["pin_estimate"] = pin_estimate(
            int(pool_gib * GIB), registrar=cuda_registrar(), first_bytes=first_bytes
        )
    return report
