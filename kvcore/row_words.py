"""A tensor's rows as integer words: the byte view every copy path moves.

Copying integer words instead of the tensor's own dtype keeps NaN payloads, fp8 and bf16
bit-exact. Planning, the layer checks and every kernel set read a row's size and word view
from here, so that none of them imports another for it.
"""

from __future__ import annotations

import math

import torch

WORD_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


def check_word_views(src_words: torch.Tensor, dst_words: torch.Tensor) -> None:
    """Both are 2-D ``[rows, words]`` tensors of one word dtype and one row width."""
    for tensor, name in ((src_words, "src_words"), (dst_words, "dst_words")):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D [rows, words], got shape {tuple(tensor.shape)}")
    if src_words.dtype != dst_words.dtype:
        raise TypeError(f"word dtypes differ: {src_words.dtype} vs {dst_words.dtype}")
    if src_words.shape[1] != dst_words.shape[1]:
        raise ValueError(f"words per row differ: {src_words.shape[1]} vs {dst_words.shape[1]}")


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (everything after dim 0)."""
    return math.prod(t.shape[1:]) * t.element_size()


def row_word_bytes(t: torch.Tensor) -> int | None:
    """Widest word size dividing the row bytes and the tensor's alignment.

    None when the rows have no byte view: dim 0 is missing, a row is not dense,
    dim 0 is not packed (stride != row numel), or a lazy conj/neg bit means the
    stored bytes are not the values.
    """
    if t.dim() == 0 or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    size = row_bytes(t)
    if size == 0 or t.shape[0] == 0:
        # No bytes to move: nothing to align, and a wider view can trip torch's stride
        # checks (a [n, 0, k] tensor keeps stride k along dim 0, and torch calls a tensor
        # of no rows contiguous whatever its dim-0 stride).
        return 1
    # torch checks the storage offset when viewing as a wider dtype; the data
    # pointer is what the hardware sees. Both must be aligned.
    offset = t.storage_offset() * t.element_size()
    address = t.data_ptr()
    for width in WORD_DTYPES:
        if size % width == 0 and offset % width == 0 and address % width == 0:
            return width
    raise AssertionError("a width of 1 always divides")


def as_row_words(t: torch.Tensor, word_bytes: int | None = None) -> torch.Tensor | None:
    """``[rows, words]`` integer view of ``t`` sharing its memory; None if no byte view exists.

    ``word_bytes`` narrows the word (so that two tensors with different
    alignments get the same word type); it must divide the widest valid width.
    """
    widest = row_word_bytes(t)
    if widest is None:
        return None
    width = widest if word_bytes is None else word_bytes
    if width not in WORD_DTYPES or widest % width:
        raise ValueError(f"word size {width} does not fit a tensor whose widest word is {widest}")
    return rows_as_words(t, width)


def rows_as_words(t: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """:func:`as_row_words` for a width already checked against :func:`row_word_bytes`."""
    rows = t.shape[0]
    as_bytes = t.reshape(rows, math.prod(t.shape[1:])).view(torch.uint8)
    return as_bytes.view(WORD_DTYPES[word_bytes])
