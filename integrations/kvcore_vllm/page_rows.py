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

import numpy as np
import torch

# More rows per page than this would make the row indices larger than the copies are
# worth; such layouts keep the stock path.
MAX_PIECES_PER_PAGE = 64


@dataclass(frozen=True)
class PageRows:
    """Row views of one GPU/CPU tensor pair and where each page lies in them."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    pieces: int
    """Rows per page."""
    gpu_block_rows: int
    """Rows from one GPU block to the next."""
    cpu_chunk_rows: int
    """Rows from one CPU chunk to the next."""

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """Equal geometries give equal row indices for the same block ids."""
        return (self.gpu.shape[1], self.pieces, self.gpu_block_rows, self.cpu_chunk_rows)

    def gpu_rows(self, blocks: np.ndarray) -> np.ndarray:
        """Row indices of GPU blocks ``blocks``, page after page."""
        return self._expand(blocks * self.gpu_block_rows)

    def cpu_rows(self, sub_blocks: np.ndarray, blocks_per_chunk: int) -> np.ndarray:
        """Row indices of CPU sub-blocks (``chunk * blocks_per_chunk + j``), page after page."""
        chunks, within = np.divmod(sub_blocks, blocks_per_chunk)
        return self._expand(chunks * self.cpu_chunk_rows + within * self.pieces)

    def _expand(self, first_rows: np.ndarray) -> np.ndarray:
        if self.pieces == 1:
            return first_rows
        return (first_rows[:, None] + np.arange(self.pieces, dtype=np.int64)).ravel()


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
        gpu=_as_rows(gpu, row),
        cpu=_as_rows(cpu, row),
        pieces=pieces,
        gpu_block_rows=gpu_stride // row,
        cpu_chunk_rows=cpu_stride // row,
    )


def _as_rows(t: torch.Tensor, row: int) -> torch.Tensor:
    """``t``'s memory from its first to its last element as dense rows of ``row`` elements."""
    span = (t.shape[0] - 1) * t.stride(0) + t.shape[1]
    return t.as_strided((span // row, row), (row, 1))
