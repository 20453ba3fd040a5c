"""A vLLM offload job's pages, group by group: each GPU block paired with its CPU sub-block.

A job names its GPU blocks and its CPU chunks group after group (a KV cache group of a
hybrid model each); a CPU chunk holds ``blocks_per_chunk`` GPU blocks, and a group's first
chunk is entered as far in as its first block's place in its request. :func:`split_groups`
cuts the job's ids into one :class:`Segment` per group and checks that they add up.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    """The blocks of one KV cache group in one job."""

    group: int
    gpu_ids: np.ndarray
    """The group's GPU block ids, as the job gave them."""
    cpu_ids: np.ndarray
    """The group's CPU chunk ids, as the job gave them."""
    skip: int
    """Sub-blocks of the first CPU chunk that come before the group's first block."""
    blocks_per_chunk: int

    @property
    def pages(self) -> int:
        return len(self.gpu_ids)

    @functools.cached_property
    def gpu_blocks(self) -> np.ndarray:
        """int64 GPU block per copied page."""
        return self.gpu_ids.astype(np.int64)

    @functools.cached_property
    def cpu_sub_blocks(self) -> np.ndarray:
        """int64 CPU sub-block (chunk * blocks_per_chunk + j) per copied page."""
        chunk_starts = self.cpu_ids.astype(np.int64) * self.blocks_per_chunk
        sub_blocks = (chunk_starts[:, None] + np.arange(self.blocks_per_chunk)).ravel()
        return sub_blocks[self.skip : self.skip + self.pages]

    def one_run(self) -> bool:
        """Whether the pages are consecutive on both sides (one run, one DMA)."""
        # Sub-blocks run on across chunks exactly when the chunk ids do.
        return _consecutive(self.gpu_ids) and _consecutive(self.cpu_ids)


def _consecutive(ids: np.ndarray) -> bool:
    if len(ids) < 2:
        return True
    # The span alone rules out most scattered jobs without a pass over them.
    if int(ids[-1]) - int(ids[0]) != len(ids) - 1:
        return False
    return bool((np.diff(ids) == 1).all())


def split_groups(
    gpu_ids: np.ndarray,
    cpu_ids: np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
) -> list[Segment]:
    """The job's pages per group, paired GPU block to CPU sub-block.

    Group ``g`` has ``group_sizes[g]`` GPU blocks, logically starting at block
    ``block_indices[g]`` of its request, so its first CPU chunk is entered
    ``block_indices[g] % blocks_per_chunk`` sub-blocks in.
    """
    if len(group_sizes) != len(block_indices):
        raise ValueError(f"{len(group_sizes)} group sizes but {len(block_indices)} block indices")
    segments = []
    gpu_at = cpu_at = 0
    for group, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        chunks = -(-(size + skip) // blocks_per_chunk)
        gpu_part = gpu_ids[gpu_at : gpu_at + size]
        cpu_part = cpu_ids[cpu_at : cpu_at + chunks]
        if len(gpu_part) != size or len(cpu_part) != chunks:
            raise ValueError(
                f"group {group} needs {size} GPU blocks and {chunks} CPU chunks; the job has "
                f"{len(gpu_ids) - gpu_at} and {len(cpu_ids) - cpu_at} left"
            )
        segments.append(Segment(group, gpu_part, cpu_part, skip, blocks_per_chunk))
        gpu_at += size
        cpu_at += chunks
    if gpu_at != len(gpu_ids) or cpu_at != len(cpu_ids):
        raise ValueError(
            f"the groups cover {gpu_at} of {len(gpu_ids)} GPU blocks and {cpu_at} of "
            f"{len(cpu_ids)} CPU chunks"
        )
    return segments
