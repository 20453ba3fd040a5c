"""vLLM's shared CPU-tier region (0.32 and later) built stock's way and kvcore's
(``kvcore bench --host-pool``).

Both sides build one worker's ``SharedOffloadRegion`` through vLLM's own class: vLLM maps it
in ``/dev/shm`` and faults it in with ``MADV_POPULATE_WRITE`` on one thread (stock), or,
inside :func:`kvcore_vllm.region_faulting.faulted_by_every_cpu` as kvcore's spec builds a
one-worker engine's, kvcore faults it in from every usable CPU first (kvcore); then vLLM's
``pin_mmap_region`` registers it with CUDA where it pins, as vLLM's worker does. The shape is
the vLLM 0.25.1 rows' Llama-3-8B-shaped tier laid out in chunks: each chunk holds
:data:`BLOCKS_PER_CHUNK` 64 KiB blocks of each of the 32 layers, as many chunks as the size
asks for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmarks.host_pool import BLOCK_BYTES, LAYERS, Built

BLOCKS_PER_CHUNK = 16
CHUNK_BYTES = LAYERS * BLOCK_BYTES * BLOCKS_PER_CHUNK
"""Bytes of one chunk: its blocks of every layer, one worker's whole row (page-aligned)."""


def region_shape(gib: float) -> tuple[int, int]:
    """(chunks, chunk bytes) of one worker's region for a tier of ``gib``."""
    return max(1, int(gib * (1 << 30)) // CHUNK_BYTES), CHUNK_BYTES


def load(pin: bool) -> None:
    """Import what :func:`build` uses and read this release's segment count, so that
    neither is the tier's cost; ModuleNotFoundError where vLLM is not installed, or is
    older than 0.32 (no shared region module: the row is skipped, not failed)."""
    from kvcore_vllm.region_faulting import REGION_MODULE
    from kvcore_vllm.releases import installed_shape

    importlib.import_module(REGION_MODULE)
    if installed_shape().worker_pins_each_tensor:
        # 0.25's region module is another class, for a region that kvcore maps itself.
        raise ModuleNotFoundError("vLLM before 0.32 maps no shared region", name="vllm")
    _segment_options()
    if pin:
        importlib.import_module("vllm.v1.kv_offload.cpu.gpu_worker")


@functools.cache
def _segment_options() -> dict[str, int]:
    """``num_segments`` as this release's spec passes it (0.33 keeps the count in the spec
    module, 0.34 in the region's); nothing where the region takes no segments (0.32)."""
    from vllm.v1.kv_offload.cpu import shared_offload_region

    parameters = inspect.signature(shared_offload_region.SharedOffloadRegion).parameters
    if "num_segments" not in parameters:
        return {}
    segments = getattr(shared_offload_region, "REGION_SEGMENTS", None)
    if segments is None:
        from vllm.v1.kv_offload.cpu import spec

        segments = getattr(spec, "_REGION_SEGMENTS", None)
    return {} if segments is None else {"num_segments": segments}


def _raise(exc: Exception) -> None:
    # The product falls back to vLLM's own faulting here; the bench would then time stock
    # twice and call it kvcore's.
    raise exc


def _remove_region_files(engine_id: str) -> None:
    """Unlink what is left of the region of ``engine_id`` in ``/dev/shm``: vLLM keeps its
    files until cleanup() (no barrier), and a region whose faulting fails is never handed
    back to clean up. The id is this build's own, so no other region's files match."""
    for path in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _region(side: str, gib: float, steps: bool = False) -> Any:
    """One worker's region of ``gib``, faulted in as ``side`` does it: kvcore's left
    unfaulted where its pinning ``steps`` fault it."""
    from vllm.v1.kv_offload.cpu import shared_offload_region

    from kvcore_vllm.region_faulting import faulted_by_every_cpu, faulting_left_to_pinning

    chunks, chunk_bytes = region_shape(gib)
    engine_id = f"kvcore-bench-{uuid.uuid4().hex}"

    def construct() -> Any:
        return shared_offload_region.SharedOffloadRegion(
            engine_id=engine_id,
            num_chunks=chunks,
            rank=0,
            kv_bytes_per_chunk=chunk_bytes,
            cpu_page_size=chunk_bytes,
            barrier=None,
            **_segment_options(),
        )

    try:
        if side == "stock":
            return construct()
        faulting = (
            faulting_left_to_pinning(shared_offload_region)
            if steps
            else faulted_by_every_cpu(shared_offload_region, placement=None, on_failure=_raise)
        )
        with faulting:
            return construct()
    except BaseException:
        _remove_region_files(engine_id)
        raise


def register_as_worker_does(region: Any) -> None:
    """vLLM's worker's ``pin_mmap_region`` of a one-worker region (whose slots are its
    rows: the whole region, in registrations of up to 64 GiB); RuntimeError where vLLM
    left it pageable, which it only logs."""
    from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

    # From 0.33 the worker asks for its slots alone unless the layout is canonical.
    takes_slots = "worker_slot_only" in inspect.signature(pin_mmap_region).parameters
    pin_mmap_region(region, **({"worker_slot_only": True} if takes_slots else {}))
    if not region.is_pinned:
        raise RuntimeError(
            f"vLLM's pin_mmap_region left the {region.total_size_bytes}-byte region pageable"
        )


def build(side: str, gib: float, pin: bool) -> Built:
    """The region's bytes as ``side`` builds them, their count, and what gives the region
    back (the bytes must be dropped first, or vLLM keeps the mapping). ModuleNotFoundError
    where vLLM is not installed."""
    region = _region(side, gib)
    try:
        if pin:
            register_as_worker_does(region)
    except BaseException:
        region.cleanup()
        raise
    return region.base_tensor, region.total_size_bytes, region.cleanup, None


PIN_FIRST_BYTES = 2 << 30
"""kvcore's first step under ``KVCORE_HOST_POOL_PIN_FIRST`` in the pin-first rows."""


def build_pin_first(side: str, gib: float, pin: bool) -> Built:
    """:func:`build`, but kvcore's side faults and registers the region as kvcore's spec has
    vLLM's worker do under ``KVCORE_HOST_POOL_PIN_FIRST`` of :data:`PIN_FIRST_BYTES`
    (:func:`kvcore_vllm.region_pinning.pinned_in_steps`: each step's rows faulted in just
    before they are registered, the rest on a thread); what it hands back waits for the
    rest."""
    if side != "kvcore" or not pin:
        return build(side, gib, pin)
    from vllm.v1.kv_offload.cpu import gpu_worker

    from kvcore.pin_progress import PinWatch
    from kvcore_vllm.region_faulting import fault_range
    from kvcore_vllm.region_pinning import pinned_in_steps

    region = _region(side, gib, steps=True)
    key = f"kvcore-bench-{uuid.uuid4().hex}-r0"
    try:
        with pinned_in_steps(gpu_worker, key, PIN_FIRST_BYTES, _raise, fault=fault_range(None)):
            register_as_worker_does(region)
        watch = PinWatch.open(key)
        if watch is None:
            raise RuntimeError("kvcore's steps were not taken: vLLM pinned the region whole")
    except BaseException:
        region.cleanup()
        raise

    def pinned_whole() -> None:
        try:
            while watch.ready < watch.total:
                time.sleep(0.001)
        finally:
            watch.close()

    return region.base_tensor, region.total_size_bytes, region.cleanup, pinned_whole


def first_step_chunks(base: torch.Tensor) -> torch.Tensor:
    """:func:`first_chunks`, within the first :data:`PIN_FIRST_BYTES`: one copy may not
    cross two of the region's registrations once it is pinned in steps."""
    part = first_chunks(base)
    return part[: max(1, PIN_FIRST_BYTES // CHUNK_BYTES) * CHUNK_BYTES]


def first_chunks(base: torch.Tensor) -> torch.Tensor:
    """The region's first chunks, as many bytes as one layer of the vLLM 0.25.1 tier of
    its size (at least a chunk): a contiguous part to read back."""
    chunks = base.numel() // CHUNK_BYTES
    return base[: max(1, chunks // LAYERS) * CHUNK_BYTES]
