"""Triton row gather between pinned host memory and device memory, through UVA addresses.

``gather_rows_uva`` copies ``dst[dst_idx[k]] = src[src_idx[k]]`` with a persistent grid of a
few CTAs. PCIe needs many bytes in flight, so each CTA handles a 2-D tile of several rows per
iteration and issues the loads of the whole tile before its stores. ``row_gather`` does its
checks and tile choice once for a caller that gathers between the same buffers again. Triton
is optional: import this module freely and ask ``triton_available()`` before calling
``gather_rows_uva``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcore.kernels.triton_kernels import triton
from kvcore.kernels.triton_tile import (
    VECTOR_BYTES,
    Launch,
    check_ctas,
    check_indices,
    check_rows,
    check_tile,
    kernel_device,
    widest_word,
)
from kvcore.row_words import check_word_views

if triton is not None:
    from kvcore.kernels.triton_kernels import gather_rows_kernel


def gather_rows_uva(
    src_words: torch.Tensor,
    src_idx: torch.Tensor,
    dst_words: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    ctas: int = 8,
    rows_per_iter: int | None = None,
    num_warps: int | None = None,
    block_words: int | None = None,
) -> None:
    """``dst_words[dst_idx[k]] = src_words[src_idx[k]]`` for every k, on the current stream.

    One of src/dst may be pinned host memory, addressed from the GPU through UVA. The indices
    are int64 tensors on the kernel's device; they are never read back on the host, so they are
    not bounds-checked here (the caller checked them on CPU before uploading).

    ``rows_per_iter``, ``num_warps`` and ``block_words`` override the tile for tuning;
    ``block_words`` counts words of the widest width both sides' alignment allows (8 B for
    rows of a multiple of 8 B at 8-B aligned addresses).
    """
    gather = row_gather(
        src_words,
        dst_words,
        rows_per_iter=rows_per_iter,
        num_warps=num_warps,
        block_words=block_words,
    )
    gather(src_idx, dst_idx, ctas=ctas)


@dataclass(frozen=True, eq=False)
class RowGather:
    """:func:`gather_rows_uva` between two row views, their checks and tile done once: a
    caller that gathers between the same buffers again (a plan executed layer after layer)
    pays only for the indices' checks and the launch."""

    src: torch.Tensor
    """The source as a view of the kernel's word type."""
    dst: torch.Tensor
    align: int
    device: torch.device
    launch: Launch

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, *, ctas: int = 8) -> None:
        """The gather for these int64 indices on the kernel's device, on the current stream."""
        check_indices(src_idx, dst_idx, self.device)
        check_ctas(ctas)
        n_rows = src_idx.numel()
        if n_rows == 0 or self.src.shape[1] == 0:
            return
        src, dst = self.src, self.dst
        args = (src, dst, src_idx, dst_idx, n_rows, src.stride(0), dst.stride(0))
        tiles = -(-n_rows // self.launch.rows)
        self.launch.run(gather_rows_kernel, args, tiles, ctas, self.align, self.device)


def row_gather(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    *,
    rows_per_iter: int | None = None,
    num_warps: int | None = None,
    block_words: int | None = None,
) -> RowGather:
    """The :class:`RowGather` between ``src_words`` and ``dst_words`` (checked as
    :func:`gather_rows_uva` checks them, host pinning included)."""
    if triton is None:
        raise RuntimeError("gather_rows_uva needs Triton, which is not installed")
    check_word_views(src_words, dst_words)
    check_rows(src_words, "src_words")
    check_rows(dst_words, "dst_words")
    device = kernel_device(src_words, dst_words)
    check_tile(rows_per_iter, num_warps, block_words)
    word = widest_word(src_words, dst_words)
    src_view = src_words.view(word)
    dst_view = dst_words.view(word)
    align = math.gcd(src_view.stride(0), dst_view.stride(0), VECTOR_BYTES // word.itemsize)
    launch = Launch(src_view.shape[1], word.itemsize, rows_per_iter, num_warps, block_words)
    return RowGather(src_view, dst_view, align, device, launch)
