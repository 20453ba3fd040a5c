"""Whether a source/destination pair of row tensors can move on kvcore's own paths."""

from __future__ import annotations

import torch

from kvcore.row_words import row_word_bytes

SUPPORTED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def fallback_reason(src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """Why copying rows of ``src`` into rows of ``dst`` must take the engine's stock path,
    or None when kvcore's paths copy them exactly."""
    return check_pair(src, dst)[0]


def check_pair(src: torch.Tensor, dst: torch.Tensor) -> tuple[str | None, int]:
    """:func:`fallback_reason`, and the widest word both sides' rows can be viewed as
    (0 when there is a reason)."""
    if not {src.device.type, dst.device.type} <= SUPPORTED_DEVICE_TYPES:
        return "unsupported_device", 0
    if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
        # A peer copy between GPUs is not a host transfer.
        return "unsupported_device", 0
    if src.dtype != dst.dtype:
        return "dtype_mismatch", 0
    if src.shape[1:] != dst.shape[1:]:
        return "row_shape_mismatch", 0
    src_width, dst_width = row_word_bytes(src), row_word_bytes(dst)
    if src_width is None or dst_width is None:
        return "strided_rows", 0
    if _shares_bytes(src, dst):
        # Stock indexing reads every source row before writing; run copies would not.
        return "overlapping_buffers", 0
    return None, min(src_width, dst_width)


def _shares_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dense tensors on one device overlap in memory."""
    if a.device != b.device:
        return False
    a_size = a.numel() * a.element_size()
    b_size = b.numel() * b.element_size()
    if a_size == 0 or b_size == 0:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b_size and b_start < a_start + a_size
