"""Mover.execute over layer pairs on a real GPU: every pair of a transfer in one submission.

Host memory as vLLM lays it out (one pinned region whose chunk rows interleave the
layers) or one pinned tensor per layer; device memory one tensor per layer. Each case is
checked against a per-index copy of every pair: the copied rows, the untouched rows (random
bytes, never zeros) and the unchanged sources.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.direction import Direction
from kvcore.kernels.batch_copy import batch_copy_available
from kvcore.kernels.cudart import device_address
from kvcore.kernels.triton_kernels import triton_available
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, CHUNK_ROWS, CHUNKS = 8, 16, 64
VIEW_ROWS = (CHUNKS - 1) * LAYERS * CHUNK_ROWS + CHUNK_ROWS
POLICY = PathPolicy(staging_bytes=8 << 20, long_run_bytes=64 << 10)


def _random(rows: int, row_bytes: int, dtype: torch.dtype, *, host: bool) -> torch.Tensor:
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda").view(dtype)
    return raw.cpu().pin_memory() if host else raw


def _views(memory: torch.Tensor, shared: bool) -> list[torch.Tensor]:
    """Shared: layer views interleaved chunk by chunk (vLLM's shared host region as
    kvcore_vllm's page rows see it); otherwise rows of their own per layer."""
    step = CHUNK_ROWS if shared else VIEW_ROWS
    return [memory[layer * step : layer * step + VIEW_ROWS] for layer in range(LAYERS)]


def _side(row_bytes: int, dtype: torch.dtype, *, host: bool, shared: bool):
    rows = CHUNKS * LAYERS * CHUNK_ROWS if shared else LAYERS * VIEW_ROWS
    memory = _random(rows, row_bytes, dtype, host=host)
    return memory, _views(memory, shared)


def _slots() -> torch.Tensor:
    """The rows of a view that no other view of a shared region reaches."""
    return torch.tensor(
        [c * LAYERS * CHUNK_ROWS + j for c in range(CHUNKS) for j in range(CHUNK_ROWS)]
    )


def _indices(path: TransferPath, direction: Direction, seed: int):
    slots = _slots()
    gen = torch.Generator().manual_seed(seed)
    shuffled = slots[torch.randperm(len(slots), generator=gen)]
    if path is TransferPath.SINGLE_COPY:
        return slots[:CHUNK_ROWS], slots[5 * CHUNK_ROWS : 6 * CHUNK_ROWS]
    if path is TransferPath.STAGED:
        # Eight host runs of one chunk each; scattered rows on the device.
        host, device = slots[: 8 * CHUNK_ROWS], shuffled[: 8 * CHUNK_ROWS]
        return (host, device) if direction is Direction.H2D else (device, host)
    return shuffled[:700], slots[torch.randperm(len(slots), generator=gen)][:700]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def _expected(srcs, dst_memory, shared, src_idx, dst_idx) -> torch.Tensor:
    """The destination memory after a per-index copy of each pair, as bytes."""
    expected = _bytes(dst_memory).clone()
    for src, dst in zip(srcs, _views(expected, shared), strict=True):
        dst[dst_idx] = _bytes(src)[src_idx]
    return expected


def _batch_fallbacks(path: TransferPath) -> dict[str, int]:
    runs_path = path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS)
    return {} if batch_copy_available() or not runs_path else {"batch_copy_refused:unavailable": 1}


def _run_layers(path, direction, srcs, dsts, src_idx, dst_idx) -> dict[str, int]:
    """execute over the pairs on a stream of its own, forced onto ``path``; the fallbacks."""
    chosen = plan(
        srcs[0], dsts[0], src_idx, dst_idx, direction=direction, policy=POLICY, force=path
    )
    metrics = Metrics()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        Mover(POLICY, metrics=metrics).execute(chosen, layer_pairs(srcs, dsts))
    stream.synchronize()
    return metrics.snapshot()["fallbacks"]


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(
    "path",
    [TransferPath.SINGLE_COPY, TransferPath.STAGED, TransferPath.GATHER],
    ids=lambda p: p.value,
)
@pytest.mark.parametrize("shared_host", [False, True], ids=["own_tensors", "shared_host"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("row_bytes", [1152, 4096, 16384])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_every_layer_is_byte_identical(direction, row_bytes, dtype, shared_host, path):
    host_memory, host = _side(row_bytes, dtype, host=True, shared=shared_host)
    device_memory, device = _side(row_bytes, dtype, host=False, shared=False)
    page_in = direction is Direction.H2D
    srcs, dsts = (host, device) if page_in else (device, host)
    src_memory, dst_memory = (
        (host_memory, device_memory) if page_in else (device_memory, host_memory)
    )
    src_idx, dst_idx = _indices(path, direction, row_bytes)
    src_before = _bytes(src_memory).clone()
    expected = _expected(srcs, dst_memory, shared_host and not page_in, src_idx, dst_idx)
    fallbacks = _run_layers(path, direction, srcs, dsts, src_idx, dst_idx)
    # Untouched rows keep their random bytes; copied rows hold their source rows.
    assert torch.equal(_bytes(dst_memory), expected)
    assert torch.equal(_bytes(src_memory), src_before)
    assert fallbacks == _batch_fallbacks(path)


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_batched_runs_of_every_layer_in_one_submission_are_exact(direction):
    host_memory, host = _side(4096, torch.uint8, host=True, shared=True)
    device_memory, device = _side(4096, torch.uint8, host=False, shared=False)
    page_in = direction is Direction.H2D
    srcs, dsts = (host, device) if page_in else (device, host)
    src_memory, dst_memory = (
        (host_memory, device_memory) if page_in else (device_memory, host_memory)
    )
    # 40 runs of a chunk a layer, 320 copies in all: more than one call of 256 copies.
    slots = _slots()
    src_idx = slots[: 40 * CHUNK_ROWS]
    dst_idx = slots[20 * CHUNK_ROWS : 60 * CHUNK_ROWS].view(40, CHUNK_ROWS).flip(0).flatten()
    src_before = _bytes(src_memory).clone()
    expected = _expected(srcs, dst_memory, not page_in, src_idx, dst_idx)
    path = TransferPath.BATCHED_RUNS
    fallbacks = _run_layers(path, direction, srcs, dsts, src_idx, dst_idx)
    assert torch.equal(_bytes(dst_memory), expected)
    assert torch.equal(_bytes(src_memory), src_before)
    assert fallbacks == _batch_fallbacks(path)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_layered_gather_from_pageable_host_memory_goes_pair_by_pair():
    device_memory, device = _side(1152, torch.uint8, host=False, shared=False)
    pageable = torch.randint(0, 256, (LAYERS * VIEW_ROWS, 1152), dtype=torch.uint8)
    host = _views(pageable, False)
    src_idx, dst_idx = _indices(TransferPath.GATHER, Direction.H2D, 1)
    expected = _expected(host, device_memory, False, src_idx, dst_idx)
    fallbacks = _run_layers(TransferPath.GATHER, Direction.H2D, host, device, src_idx, dst_idx)
    assert torch.equal(_bytes(device_memory), expected)
    assert fallbacks == {"gather_kernel_unavailable:pageable_host": 1}


def test_pinned_and_registered_host_memory_have_gpu_addresses():
    pinned = torch.empty(4096, dtype=torch.uint8).pin_memory()
    registered = allocate_host_buffer(1 << 20, pin=True)
    try:
        for pointer in (pinned.data_ptr(), registered.tensor.data_ptr() + 4096):
            assert device_address(pointer) is not None
        assert device_address(torch.empty(4096, dtype=torch.uint8).data_ptr()) is None
        device = torch.empty(4096, dtype=torch.uint8, device="cuda")
        assert device_address(device.data_ptr()) == device.data_ptr()
    finally:
        registered.close()
