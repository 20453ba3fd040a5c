"""Row runs copied with one cudaMemcpyBatchAsync submission, or one copy per run.

A run ``i`` is ``lengths[i]`` rows from source row ``src_starts[i]`` to destination row
``dst_starts[i]`` of two dense ``[rows, words]`` views; one side is usually pinned host memory.
``copy_runs_batched`` raises ``BatchCopyError`` whenever the driver path cannot take the batch,
so the caller can fall back to ``copy_runs_each`` and count the reason.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvcore.kernels.cudart import clear_pending_error, loaded_cudart
from kvcore.row_words import check_word_views

_MIN_CUDA_VERSION = 12080  # cudaMemcpyBatchAsync first shipped in CUDA 12.8
_LEGACY_STREAM_HANDLES = (0, 1)  # NULL and cudaStreamLegacy: rejected by the batch API
# Most copies handed to one cudaMemcpyBatchAsync call. On the H200 (driver 580.159.04, CUDA
# 13.0) a host-to-device batch of 700 copies submitted to an idle stream wrote wrong rows,
# left the context in "unspecified launch failure" or crashed the process inside the call;
# batches of up to 256 copies were exact in every case tried, busy stream or idle.
MAX_COPIES_PER_CALL = 256


class BatchCopyError(RuntimeError):
    """The batched submission failed; ``reason`` is a CUDA error name or a short cause."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@functools.cache
def _runtime() -> Any | None:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime if hasattr(runtime, "cudaMemcpyBatchAsync") else None


@functools.cache
def batch_copy_available() -> bool:
    """True when a CUDA device is visible and the runtime and driver have cudaMemcpyBatchAsync."""
    rt = _runtime()
    if rt is None or not torch.cuda.is_available():
        return False
    success = rt.cudaError_t.cudaSuccess
    runtime_err, runtime_version = rt.cudaRuntimeGetVersion()
    driver_err, driver_version = rt.cudaDriverGetVersion()
    return (
        runtime_err == success
        and driver_err == success
        and runtime_version >= _MIN_CUDA_VERSION
        and driver_version >= _MIN_CUDA_VERSION
    )


_CUDA_13 = 13000


@functools.cache
def _direct_batch_call() -> Callable[..., int] | None:
    """cudaMemcpyBatchAsync of the CUDA runtime torch loaded, called through ctypes.

    cuda-bindings takes the pointer and size arrays as Python lists, converting every
    element: ~1 ms of host time for a few thousand runs. Through ctypes the driver reads
    the numpy arrays in place. None when no such runtime is loaded (cuda-bindings is then
    used as it is).
    """
    lib = loaded_cudart()
    if lib is None:
        return None
    version = ctypes.c_int()
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < _MIN_CUDA_VERSION:
        return None
    call = lib.cudaMemcpyBatchAsync
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    arrays: list[Any] = [pointer, pointer, pointer, size, pointer, pointer, size]
    # CUDA 12.8 and 12.9 report the failing copy through an extra out-parameter.
    call.argtypes = [*arrays, pointer] if version.value >= _CUDA_13 else [*arrays, pointer, pointer]
    call.restype = ctypes.c_int
    if version.value >= _CUDA_13:
        return call
    return lambda *args: call(*args[:-1], None, args[-1])


@functools.cache
def _copy_attrs(rt: Any, source_in_stream_order: bool) -> Any:
    attrs = rt.cudaMemcpyAttributes()
    # The engine's producer may still be writing the source when we submit: read it in stream
    # order unless the caller knows no stream writes it. An attribute left at its zero value
    # (cudaMemcpySrcAccessOrderInvalid) is rejected.
    order = rt.cudaMemcpySrcAccessOrder
    attrs.srcAccessOrder = (
        order.cudaMemcpySrcAccessOrderStream
        if source_in_stream_order
        else order.cudaMemcpySrcAccessOrderAny
    )
    attrs.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    return attrs


def _check_contiguous(tensor: torch.Tensor, name: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a run spans whole rows back to back)")


def _check_runs(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate both views and the runs; return the runs as int64 numpy arrays."""
    check_word_views(src_words, dst_words)
    _check_contiguous(src_words, "src_words")
    _check_contiguous(dst_words, "dst_words")
    arrays = []
    for tensor, name in (
        (src_starts, "src_starts"),
        (dst_starts, "dst_starts"),
        (lengths, "lengths"),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU tensor")
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise TypeError(
                f"{name} must be a 1-D int64 tensor, got {tensor.dtype} {tensor.dim()}-D"
            )
        arrays.append(tensor.numpy())
    src, dst, n = arrays
    if not len(src) == len(dst) == len(n):
        raise ValueError(f"run arrays differ in length: {len(src)}, {len(dst)}, {len(n)}")
    if len(n) == 0:
        return src, dst, n
    if n.min() < 1:
        raise ValueError("every run must have a length >= 1")
    for starts, rows, name in (
        (src, src_words.shape[0], "source"),
        (dst, dst_words.shape[0], "destination"),
    ):
        if starts.min() < 0 or (starts + n).max() > rows:
            raise ValueError(f"a run lies outside the {name} buffer of {rows} rows")
    return src, dst, n


def _host_side(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def copy_runs_batched(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy every run with one cudaMemcpyBatchAsync on ``stream`` (default: the current one).

    Raises ValueError/TypeError for bad arguments (runs out of bounds included, checked here
    before the driver sees them) and BatchCopyError when the batch path cannot take the copy.
    """
    src, dst, n = _check_runs(src_words, dst_words, src_starts, dst_starts, lengths)
    cuda_sides = {t.device for t in (src_words, dst_words) if t.device.type == "cuda"}
    if not cuda_sides:
        raise BatchCopyError("no device side", "both buffers are host memory")
    if len(cuda_sides) > 1:
        raise BatchCopyError("two devices", f"buffers on {sorted(map(str, cuda_sides))}")
    host_pinned = all(t.is_pinned() for t in (src_words, dst_words) if _host_side(t))
    if len(n) == 0:
        return
    row_bytes = src_words.shape[1] * src_words.element_size()
    copy_pointers_batched(
        (dst * row_bytes + dst_words.data_ptr()).astype(np.uint64),
        (src * row_bytes + src_words.data_ptr()).astype(np.uint64),
        (n * row_bytes).astype(np.uint64),
        cuda_sides.pop(),
        host_pinned=host_pinned,
        stream=stream,
    )


def copy_pointers_batched(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    device: torch.device,
    *,
    host_pinned: bool,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """:func:`batch_copy_pointers` on ``stream`` (default: ``device``'s current one), read in
    stream order, after the checks that turn what the driver would refuse or mishandle
    (no batch API, pageable host memory, the legacy stream, a capture) into BatchCopyError.
    """
    rt = _runtime()
    if rt is None or not batch_copy_available():
        raise BatchCopyError("unavailable", "cuda-bindings or CUDA >= 12.8 missing")
    if not host_pinned:
        raise BatchCopyError("pageable host memory", "a host buffer is not pinned")
    if len(sizes) == 0:
        return
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    if stream.cuda_stream in _LEGACY_STREAM_HANDLES:
        raise BatchCopyError("legacy default stream", "cudaMemcpyBatchAsync rejects it")
    if torch.cuda.is_current_stream_capturing():
        raise BatchCopyError("stream capture", "cudaMemcpyBatchAsync cannot be captured")
    with torch.cuda.device(device):
        batch_copy_pointers(dsts, srcs, sizes, stream, source_in_stream_order=True)


def batch_copy_pointers(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
    *,
    source_in_stream_order: bool,
    max_copies_per_call: int | None = MAX_COPIES_PER_CALL,
) -> None:
    """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` with cudaMemcpyBatchAsync.

    The arrays are contiguous 64-bit host arrays of equal length, read during the calls;
    the current device must own ``stream``. ``source_in_stream_order=False`` lets the
    copies read their sources in any order (only for sources no stream is writing). The
    copies go in consecutive calls of at most ``max_copies_per_call`` copies each (None: one
    call, as an engine's own batched op does). Raises BatchCopyError with the CUDA error's
    name when a submission is refused; the calls before it stay submitted.
    """
    rt = _runtime()
    if rt is None:
        raise BatchCopyError("unavailable", "cuda-bindings missing")
    if max_copies_per_call is not None and max_copies_per_call < 1:
        raise ValueError(f"max_copies_per_call must be positive, got {max_copies_per_call}")
    attrs = _copy_attrs(rt, source_in_stream_order)
    step = max_copies_per_call or max(len(sizes), 1)
    for start in range(0, len(sizes), step):
        end = start + step
        _submit_batch(rt, attrs, dsts[start:end], srcs[start:end], sizes[start:end], stream)


def _submit_batch(
    rt: Any,
    attrs: Any,
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
) -> None:
    direct = _direct_batch_call()
    count = len(sizes)
    if direct is not None:
        attrs_index = ctypes.c_size_t(0)
        err = direct(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            attrs.getPtr(),
            ctypes.addressof(attrs_index),
            1,
            stream.cuda_stream,
        )
        if err != 0:
            clear_pending_error()
            raise BatchCopyError(rt.cudaGetErrorName(rt.cudaError_t(err))[1].decode())
        return
    result = rt.cudaMemcpyBatchAsync(
        dsts.tolist(), srcs.tolist(), sizes.tolist(), count, [attrs], [0], 1, stream.cuda_stream
    )
    # CUDA 12.8/12.9 bindings return (err, failIdx); CUDA 13 dropped failIdx and returns (err,).
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        # The caller copies the runs another way and goes on: the refusal must not stay the
        # runtime's last error for torch's next launch check to report as its own.
        clear_pending_error()
        name = rt.cudaGetErrorName(err)[1].decode()
        detail = (
            f"failed at copy {result[1]}" if isinstance(result, tuple) and len(result) > 1 else ""
        )
        raise BatchCopyError(name, detail)


def copy_runs_each(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """The fallback: one non-blocking ``copy_`` per run on the current stream."""
    src, dst, n = _check_runs(src_words, dst_words, src_starts, dst_starts, lengths)
    for src_start, dst_start, length in zip(src.tolist(), dst.tolist(), n.tolist(), strict=True):
        dst_words[dst_start : dst_start + length].copy_(
            src_words[src_start : src_start + length], non_blocking=True
        )
