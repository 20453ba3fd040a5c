"""A GPU KV tensor and its CPU offload tensor seen as two tensors of equal, dense rows.

vLLM's offload handlers copy whole pages: GPU block ``b`` of a ``[blocks, page]`` tensor
to or from sub-block ``j`` of CPU chunk ``c`` of a ``[chunks, page * blocks_per_chunk]``
tensor. Either tensor may have a row stride larger than its row (vLLM's shared host
region interleaves every layer of a chunk in one row), which kvcore's mover cannot
index. Cutting both sides into rows of ``gcd(page, strides)`` elements gives two dense
tensors in which every page is ``pieces`` consecutive rows, so the mover sees a page
as a run and merges pages that are adjacent on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcore.row_views import RowMap, dense_rows

# More rows per page than this would make the row indices larger than the copies are
# worth; such layouts keep the stock path.
MAX_PIECES_PER_PAGE = 64


@dataclass(frozen=True)
class PageRows:
    """Row views of one GPU/CPU tensor pair and where each page lies in them."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    gpu_pages: RowMap
    """GPU block ``b``'s rows: ``pieces`` rows, a block every GPU row stride."""
    cpu_pages: RowMap
    """CPU sub-block ``chunk * blocks_per_chunk + j``'s rows: ``pieces`` rows, the sub-blocks
    of a chunk side by side, a chunk every CPU row stride."""

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """Equal geometries give equal row indices for the same block ids."""
        gpu, cpu = self.gpu_pages, self.cpu_pages
        return (self.gpu.shape[1], gpu.width, gpu.period, cpu.period)


def page_rows(
    gpu: torch.Tensor,
    cpu: torch.Tensor,
    blocks_per_chunk: int,
    max_pieces: int = MAX_PIECES_PER_PAGE,
) -> PageRows | str:
    """The row views of ``gpu`` and ``cpu``, or why the pair cannot have them."""
    if gpu.dtype != cpu.dtype:
        return "dtype_mismatch"
    if gpu.dim() != 2 or cpu.dim() != 2:
        return "row_shape_mismatch"
    page = gpu.shape[1]
    if page == 0 or cpu.shape[1] != page * blocks_per_chunk:
        return "row_shape_mismatch"
    if gpu.shape[0] == 0 or cpu.shape[0] == 0:
        return "empty_tensor"
    gpu_stride, cpu_stride = gpu.stride(0), cpu.stride(0)
    if gpu.stride(1) != 1 or cpu.stride(1) != 1:
        return "strided_rows"
    if gpu_stride < page or cpu_stride < cpu.shape[1]:
        # Rows that overlap: stock copies would race on the shared bytes.
        return "overlapping_rows"
    row = math.gcd(page, gpu_stride, cpu_stride)
    pieces = page // row
    if pieces > max_pieces:
        return "unaligned_rows"
    return PageRows(
        gpu=dense_rows(gpu, (row,)),
        cpu=dense_rows(cpu, (row,)),
        gpu_pages=RowMap(gpu.shape[0], group=1, period=gpu_stride // row, width=pieces),
        cpu_pages=RowMap(
            cpu.shape[0] * blocks_per_chunk,
            group=blocks_per_chunk,
            period=cpu_stride // row,
            width=pieces,
        ),
    )


def page_bytes(t: torch.Tensor) -> int:
    """Bytes of one page (row) of a ``[blocks, page]`` KV tensor."""
    return t.shape[1] * t.element_size()
