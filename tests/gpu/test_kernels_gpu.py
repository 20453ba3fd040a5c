"""The UVA gather kernel and the batched run copies on a real GPU, against per-index references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcore.kernels.batch_copy import (
    BatchCopyError,
    batch_copy_available,
    copy_runs_batched,
    copy_runs_each,
)
from kvcore.kernels.triton_kernels import triton_available
from kvcore.kernels.triton_rows import gather_rows_uva
from kvcore.kernels.triton_tile import gather_sm_count
from kvcore.runs import find_paired_runs

pytestmark = pytest.mark.gpu

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")
needs_batch = pytest.mark.skipif(
    not batch_copy_available(), reason="needs cuda-bindings with cudaMemcpyBatchAsync"
)

ROW_BYTES = (1152, 4096, 16384)
WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _random_rows(rows: int, row_bytes: int, dtype: torch.dtype, *, device: str) -> torch.Tensor:
    """Random bytes (never zeros) as a [rows, words] view; host tensors are pinned."""
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda")
    out = raw.view(dtype)
    if device == "cpu":
        out = out.cpu().pin_memory()
    return out


def _pair(direction: str, src_rows: int, dst_rows: int, row_bytes: int, dtype: torch.dtype):
    src_dev, dst_dev = ("cpu", "cuda") if direction == "h2d" else ("cuda", "cpu")
    src = _random_rows(src_rows, row_bytes, dtype, device=src_dev)
    dst = _random_rows(dst_rows, row_bytes, dtype, device=dst_dev)
    return src, dst


def _gather_reference(src, src_idx, dst, dst_idx) -> torch.Tensor:
    expected = dst.cpu().clone()
    expected[dst_idx.cpu()] = src.cpu()[src_idx.cpu()]
    return expected


@needs_triton
@pytest.mark.parametrize("ctas", (4, 8))
@pytest.mark.parametrize("dtype", WORD_DTYPES)
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("direction", ("h2d", "d2h"))
def test_gather_scattered_rows(direction: str, row_bytes: int, dtype: torch.dtype, ctas: int):
    src, dst = _pair(direction, 3000, 2500, row_bytes, dtype)
    n = 1777
    src_idx = torch.randint(0, 3000, (n,), device="cuda")
    dst_idx = torch.randperm(2500, device="cuda")[:n]
    src_before, expected = src.cpu().clone(), _gather_reference(src, src_idx, dst, dst_idx)

    gather_rows_uva(src, src_idx, dst, dst_idx, ctas=ctas)
    torch.cuda.synchronize()

    assert torch.equal(dst.cpu(), expected)
    assert torch.equal(src.cpu(), src_before)


@needs_triton
@pytest.mark.parametrize(
    ("row_bytes", "pitch_extra", "rows_per_iter", "num_warps"),
    [(999, 0, None, None), (1000, 24, None, None), (40 * 1024, 0, 2, 8), (64, 0, 1, 1)],
)
@pytest.mark.parametrize("direction", ("h2d", "d2h"))
def test_gather_odd_shapes(direction, row_bytes, pitch_extra, rows_per_iter, num_warps):
    src_full, dst_full = _pair(direction, 700, 600, row_bytes + pitch_extra, torch.uint8)
    src, dst = src_full[:, :row_bytes], dst_full[:, :row_bytes]
    src_idx = torch.randint(0, 700, (333,), device="cuda")
    dst_idx = torch.randperm(600, device="cuda")[:333]
    full_before = dst_full.cpu().clone()
    expected = _gather_reference(src, src_idx, dst, dst_idx)

    gather_rows_uva(
        src, src_idx, dst, dst_idx, ctas=3, rows_per_iter=rows_per_iter, num_warps=num_warps
    )
    torch.cuda.synchronize()

    assert torch.equal(dst.cpu(), expected)
    # The pitch padding between rows is never written.
    assert torch.equal(dst_full.cpu()[:, row_bytes:], full_before[:, row_bytes:])


@needs_triton
def test_gather_runs_on_the_current_stream():
    src, dst = _pair("h2d", 4096, 4096, 4096, torch.int64)
    src_idx = torch.randperm(4096, device="cuda")
    dst_idx = torch.randperm(4096, device="cuda")
    expected = _gather_reference(src, src_idx, dst, dst_idx)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather_rows_uva(src, src_idx, dst, dst_idx, ctas=2)
        done = torch.cuda.Event()
        done.record(side)
    # A stream-ordered read after the event sees every row written.
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(dst.cpu(), expected)


@needs_triton
def test_gather_rejects_pageable_host_memory_and_host_indices():
    dst = _random_rows(8, 64, torch.int64, device="cuda")
    pageable = torch.randint(0, 100, (8, 8), dtype=torch.int64)
    idx = torch.arange(8, device="cuda")
    with pytest.raises(ValueError, match="not pinned"):
        gather_rows_uva(pageable, idx, dst, idx)
    with pytest.raises(ValueError, match="kernel runs on"):
        gather_rows_uva(pageable.pin_memory(), idx.cpu(), dst, idx)


def test_gather_sm_count_is_capped_by_the_device():
    sms = torch.cuda.get_device_properties().multi_processor_count
    assert gather_sm_count(8) == min(8, sms)
    assert gather_sm_count(10_000) == sms


def _random_runs(src_rows: int, dst_rows: int, n_runs: int, max_len: int):
    """Non-overlapping destination runs and arbitrary source runs, as PairedRuns."""
    gen = torch.Generator().manual_seed(n_runs * 7919 + max_len)
    lengths = torch.randint(1, max_len + 1, (n_runs,), generator=gen)
    gaps = torch.randint(0, 4, (n_runs,), generator=gen)
    dst_starts = torch.cumsum(gaps + lengths, 0) - lengths
    assert int(dst_starts[-1] + lengths[-1]) <= dst_rows
    src_starts = (torch.rand(n_runs, generator=gen) * (src_rows - lengths)).long()
    src_index = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(src_starts, lengths, strict=True)]
    )
    dst_index = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(dst_starts, lengths, strict=True)]
    )
    return find_paired_runs(src_index, dst_index), src_index, dst_index


def _runs_reference(src, dst, src_index, dst_index) -> torch.Tensor:
    expected = dst.cpu().clone()
    expected[dst_index] = src.cpu()[src_index]
    return expected


COPIERS = {
    "batched": pytest.param(copy_runs_batched, marks=needs_batch),
    "each": pytest.param(copy_runs_each),
}


@pytest.mark.parametrize("copier", COPIERS.values(), ids=COPIERS.keys())
@pytest.mark.parametrize("row_bytes", (1152, 4096))
@pytest.mark.parametrize("direction", ("h2d", "d2h"))
def test_copy_runs(direction: str, row_bytes: int, copier):
    src, dst = _pair(direction, 9000, 9000, row_bytes, torch.int16)
    runs, src_index, dst_index = _random_runs(9000, 9000, n_runs=300, max_len=20)
    expected = _runs_reference(src, dst, src_index, dst_index)
    src_before = src.cpu().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copier(src, dst, runs.src_starts, runs.dst_starts, runs.lengths)
    stream.synchronize()
    assert torch.equal(dst.cpu(), expected)
    assert torch.equal(src.cpu(), src_before)


@needs_batch
@pytest.mark.parametrize("binding", ("ctypes", "cuda-bindings"))
@pytest.mark.parametrize("direction", ("h2d", "d2h"))
def test_batched_copies_are_exact_through_either_binding(
    direction: str, binding: str, monkeypatch: pytest.MonkeyPatch
):
    from kvcore.kernels import batch_copy

    if binding == "ctypes" and batch_copy._direct_batch_call() is None:
        pytest.skip("no dynamically loaded CUDA runtime in this process")
    if binding == "cuda-bindings":
        monkeypatch.setattr(batch_copy, "_direct_batch_call", lambda: None)
    src, dst = _pair(direction, 4000, 4000, 4096, torch.int64)
    runs, src_index, dst_index = _random_runs(4000, 4000, n_runs=700, max_len=5)
    expected = _runs_reference(src, dst, src_index, dst_index)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copy_runs_batched(src, dst, runs.src_starts, runs.dst_starts, runs.lengths)
    stream.synchronize()
    assert torch.equal(dst.cpu(), expected)


def test_the_runtime_torch_loaded_is_called_directly_when_it_is_shared():
    from kvcore.kernels import batch_copy

    maps = Path("/proc/self/maps").read_text()
    if "libcudart.so" not in maps or not batch_copy_available():
        pytest.skip("torch links the CUDA runtime statically here")
    assert batch_copy._direct_batch_call() is not None


@needs_batch
def test_batched_run_beyond_the_buffer_is_caught_before_the_driver():
    src, dst = _pair("h2d", 100, 100, 4096, torch.int64)
    dst_before = dst.cpu().clone()
    starts = torch.tensor([0, 90])
    with pytest.raises(ValueError, match="outside the source buffer"):
        copy_runs_batched(src, dst, starts, torch.tensor([0, 10]), torch.tensor([5, 11]))
    with pytest.raises(ValueError, match="outside the destination buffer"):
        copy_runs_batched(src, dst, torch.tensor([0, 10]), starts, torch.tensor([5, 11]))
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), dst_before)


@needs_batch
def test_batched_rejects_the_legacy_default_stream_and_pageable_memory():
    src, dst = _pair("h2d", 16, 16, 4096, torch.int64)
    runs = (torch.tensor([0]), torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(BatchCopyError, match="legacy default stream"):
        copy_runs_batched(src, dst, *runs, stream=torch.cuda.default_stream())
    with pytest.raises(BatchCopyError, match="pageable"):
        copy_runs_batched(src.clone(), dst, *runs, stream=torch.cuda.Stream())
