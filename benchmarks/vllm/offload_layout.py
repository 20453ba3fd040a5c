"""One vLLM offload layout and the jobs over it, for the vLLM benches.

:class:`Layout` holds the GPU KV tensors and their host counterparts as vLLM lays them
out (one dense host tensor per KV tensor, or strided views of one shared region), filled
with random bytes; :func:`fragmented_ids` and :func:`job_specs` make a job's block ids
and the load/store specs vLLM's handlers take. Apart from the handlers and the timing
(:mod:`benchmarks.vllm.offload_handlers`, :mod:`benchmarks.vllm.ab`) because the A/B,
the sweep's pools and the soak all build their tensors and jobs this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

# vLLM aligns each chunk row of its shared host region to the OS page size.
HOST_ROW_ALIGNMENT = 4096


@dataclass(frozen=True)
class Layout:
    """One vLLM offload layout: GPU KV tensors and their host counterparts."""

    page_bytes: int
    """Bytes of one GPU block of one KV tensor."""
    tensors: int = 1
    """KV tensors: one per layer, or one for a cross-layer layout (each page all layers)."""
    blocks_per_chunk: int = 1
    gpu_blocks: int = 64
    cpu_chunks: int = 64
    shared_region: bool = False
    """Host tensors as strided views of one region whose chunk rows hold every tensor's
    pages (vLLM's shared mmap region); otherwise one dense host tensor per KV tensor."""
    ref_page_bytes: int | None = None
    """Bytes vLLM copies of each page (its unpadded size); None copies whole pages."""

    def refs(self, groups: int = 1) -> list[list[CanonicalKVCacheRef]]:
        copied = self.page_bytes if self.ref_page_bytes is None else self.ref_page_bytes
        return [[CanonicalKVCacheRef(t, copied) for t in range(self.tensors)]] * groups

    @property
    def host_row_bytes(self) -> int:
        """Bytes of one chunk row of the shared host region: every tensor's chunk, aligned."""
        chunk_bytes = self.page_bytes * self.blocks_per_chunk
        return -(-self.tensors * chunk_bytes // HOST_ROW_ALIGNMENT) * HOST_ROW_ALIGNMENT

    def make_tensors(
        self, device: torch.device, generator: torch.Generator
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Random GPU-side and host-side tensors, int8 ``[rows, bytes]`` as vLLM has them."""
        gpu = [
            _random((self.gpu_blocks, self.page_bytes), generator, device)
            for _ in range(self.tensors)
        ]
        chunk_bytes = self.page_bytes * self.blocks_per_chunk
        if not self.shared_region:
            host = [
                _random_host((self.cpu_chunks, chunk_bytes), generator, device)
                for _ in range(self.tensors)
            ]
            return gpu, host
        region = _random_host((self.cpu_chunks * self.host_row_bytes,), generator, device)
        return gpu, self.host_views(region)

    def host_views(self, region: torch.Tensor) -> list[torch.Tensor]:
        """The host tensors as strided views of ``region`` (int8, at least ``cpu_chunks`` rows
        of :attr:`host_row_bytes`), chunk row by chunk row as vLLM's shared region has them."""
        chunk_bytes = self.page_bytes * self.blocks_per_chunk
        row = self.host_row_bytes
        if region.dtype != torch.int8 or region.numel() < self.cpu_chunks * row:
            raise ValueError(
                f"the region must be int8 and hold {self.cpu_chunks} rows of {row} bytes"
            )
        base = region.storage_offset()
        return [
            region.as_strided((self.cpu_chunks, chunk_bytes), (row, 1), base + t * chunk_bytes)
            for t in range(self.tensors)
        ]


def _random(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random bytes on ``device``; drawn there on a GPU, where a host draw of the
    gigabytes a run needs would take minutes, seeded from ``generator`` either way."""
    if device.type != "cuda":
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
    on_device = torch.Generator(device).manual_seed(seed)
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=on_device, device=device)


def _random_host(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random host bytes, pinned when ``device`` is a GPU (vLLM pins its host cache)."""
    if device.type != "cuda":
        return _random(shape, generator, device)
    host = torch.empty(shape, dtype=torch.int8, pin_memory=True)
    return host.copy_(_random(shape, generator, device))


def fragmented_ids(count: int, fragmentation: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` ascending unique ids; ``fragmentation`` of the neighbour pairs are not adjacent."""
    breaks = np.zeros(max(count - 1, 0), dtype=bool)
    broken = round(fragmentation * len(breaks))
    breaks[rng.choice(len(breaks), size=broken, replace=False)] = True
    steps = np.where(breaks, 2 + rng.integers(0, 3, size=len(breaks)), 1)
    return np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)


def job_specs(
    gpu_ids: np.ndarray, cpu_ids: np.ndarray, *, gpu_to_cpu: bool, block_index: int = 0
) -> tuple[Any, Any]:
    """(src_spec, dst_spec) of a one-group job."""
    gpu = GPULoadStoreSpec(
        gpu_ids.tolist(), group_sizes=[len(gpu_ids)], block_indices=[block_index]
    )
    cpu = CPULoadStoreSpec(cpu_ids.tolist())
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
