"""What the vLLM sweep (:mod:`benchmarks.vllm.sweep`) runs: its model layouts and cells.

A :class:`ModelLayout` is one model's KV cache as vLLM's offload worker sees it (per-layer
or cross-layer tensors, layers, page bytes); a :class:`SweepPlan` is the layouts, request
sizes, fragmentations, directions and jobs in flight to sweep, with the repeats each cell
gets. :data:`FULL` is the GPU sweep, :data:`QUICK` the one that runs on a CPU in seconds.
Apart from the sweep's run because the soak sizes its pages from the same layouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.vllm.offload_layout import Layout
from benchmarks.vllm.sweep_pools import slice_blocks

BLOCK_TOKENS = 16
# 16 tokens x (K, V) x 4 KV heads x head dim 128 x bf16 (an 8-KV-head model at TP 2).
MHA_PAGE_BYTES = 16 * 2 * 4 * 128 * 2
# 16 tokens x (512 latent + 64 rope) x bf16, one page a layer (DeepSeek-style MLA).
MLA_PAGE_BYTES = 16 * 576 * 2


@dataclass(frozen=True)
class ModelLayout:
    """One model's KV cache as vLLM's offload worker sees it."""

    cross_layer: bool
    layers: int
    page: str
    """What a layer's page holds (mha, mla, ...), for the case name."""
    layer_page_bytes: int

    @property
    def name(self) -> str:
        kind = "cross-layer" if self.cross_layer else "per-layer"
        return f"{kind}/{self.layers}L/{self.page}-{_size(self.layer_page_bytes)}"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.layers * self.layer_page_bytes

    def layout(self, blocks: int) -> Layout:
        return Layout(
            page_bytes=self.block_bytes if self.cross_layer else self.layer_page_bytes,
            tensors=1 if self.cross_layer else self.layers,
            gpu_blocks=blocks,
            cpu_chunks=blocks,
            shared_region=True,
        )


@dataclass(frozen=True)
class SweepPlan:
    layouts: tuple[ModelLayout, ...]
    sizes: tuple[int, ...]
    """Blocks a job."""
    frags: tuple[float, ...]
    ops: tuple[str, ...] = ("store", "load")
    jobs: tuple[int, ...] = (1, 4)
    """Jobs a request (submitted back to back, then waited for)."""
    min_repeats: int = 3
    max_repeats: int = 41
    """Requests of a millisecond or less vary by tens of percent from one to the next on a
    GPU: with 9, cells where both sides ran the same stock copy differed by 0.5-1.8x."""
    repeat_bytes: int = 1 << 30
    """Requests moving less than this get more repeats, up to ``max_repeats``."""
    seed: int = 0
    gemm: bool = False
    """Time a GEMM batch beside one more request of each side, in cells of at least
    ``gemm_min_bytes`` on CUDA (:mod:`benchmarks.gemm_share`)."""
    gemm_min_bytes: int = 256 << 20

    def cells(self, op: str) -> Iterator[tuple[float, int, int]]:
        """(frag, jobs, blocks) of one pass; several jobs in flight only while they move no
        more blocks than the largest single job."""
        for frag in self.frags:
            for jobs in self.jobs:
                for blocks in self.sizes:
                    if jobs == 1 or jobs * blocks <= max(self.sizes):
                        yield frag, jobs, blocks

    def pool_blocks(self) -> int:
        return max(jobs * slice_blocks(blocks) for _, jobs, blocks in self.cells(self.ops[0]))

    def repeats(self, nbytes: int) -> int:
        wanted = math.ceil(self.repeat_bytes / max(nbytes, 1))
        return max(self.min_repeats, min(self.max_repeats, wanted))


FULL = SweepPlan(
    layouts=(
        ModelLayout(False, 32, "mha", MHA_PAGE_BYTES),
        ModelLayout(False, 61, "mla", MLA_PAGE_BYTES),
        ModelLayout(True, 32, "mha", MHA_PAGE_BYTES),
        ModelLayout(True, 61, "mla", MLA_PAGE_BYTES),
    ),
    sizes=(1, 4, 16, 64, 256, 1024, 4096),
    frags=(0.0, 0.5, 1.0),
)
# Small pages so that it runs on a CPU in seconds; per-layer requests of 16 blocks and
# more reach kvcore's own paths (512 pages a submission), smaller ones stay stock.
QUICK = SweepPlan(
    layouts=(ModelLayout(False, 32, "small", 1 << 10), ModelLayout(True, 32, "small", 1 << 10)),
    sizes=(1, 4, 16, 64),
    frags=(0.5,),
    min_repeats=2,
    max_repeats=2,
)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 10}KiB" if nbytes % 1024 == 0 else f"{nbytes}B"
