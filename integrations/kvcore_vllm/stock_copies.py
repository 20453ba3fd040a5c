"""What kvcore's offload handler reads from and runs of the stock handler it replaces.

kvcore's handler needs the stock handler's block geometry and layer references, and for
the jobs it leaves to stock, the stock descriptor fill and copy op. Releases name these
differently, and vLLM 0.25 has no fill method at all: its ``transfer_async`` fills the
descriptors inline, from the module's ``compute_sub_block_ptrs``. :class:`StockCopies`
gives kvcore's handler one face over every supported release; on 0.25 it fills a
group's descriptors by calling that same pointer function for each layer reference, in
the order stock's inline loop does, so a fallen-back job issues stock's descriptors.
From 0.34 the stock handler holds only its CPU tensors; the GPU ones are the caller's
(:func:`kvcore_vllm.device_pointers.gpu_rows` of the worker's KV caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.cpu import gpu_worker

from kvcore_vllm.releases import ReleaseShape, installed_shape


def gpu_tensors_of(handler: Any) -> list[torch.Tensor]:
    """The GPU side's KV tensors of a stock handler of either direction, on a release whose
    handler holds them (before 0.34)."""
    tensors: list[torch.Tensor] = handler.src_tensors if handler.gpu_to_cpu else handler.dst_tensors
    return tensors


class StockCopies:
    """One stock ``SingleDirectionOffloadingHandler``, as 0.33 names what kvcore uses.

    ``gpu_tensors``: the GPU KV tensors as int8 rows, on a release whose handler does not
    hold them (``shape.device_pointers``); read from the handler otherwise.
    ``blocks_per_chunk`` is the CPU side's factor: GPU blocks per CPU chunk.
    """

    def __init__(
        self,
        handler: Any,
        shape: ReleaseShape | None = None,
        gpu_tensors: Sequence[torch.Tensor] | None = None,
    ) -> None:
        shape = installed_shape() if shape is None else shape
        self.handler = handler
        self.gpu_to_cpu: bool = handler.gpu_to_cpu
        self.layer_refs_per_group: list[list[Any]] = getattr(
            handler, shape.name("layer_refs_per_group")
        )
        self.canonical_layout = getattr(handler, "_canonical_copy_plans", None) is not None
        self._fills_inline = shape.fills_in_transfer_async
        self._fills_from_pointers = shape.device_pointers
        if shape.device_pointers:
            if gpu_tensors is None:
                raise ValueError("this vLLM's handler holds no GPU tensors: pass gpu_tensors")
            self.gpu_tensors: list[torch.Tensor] = list(gpu_tensors)
            self.cpu_tensors: list[torch.Tensor] = handler.cpu_tensors
            self.blocks_per_chunk: int = handler.blocks_per_chunk
        else:
            self.gpu_tensors = gpu_tensors_of(handler)
            self.cpu_tensors = handler.dst_tensors if self.gpu_to_cpu else handler.src_tensors
            cpu_side = "dst_blocks_per_chunk" if self.gpu_to_cpu else "src_blocks_per_chunk"
            self.blocks_per_chunk = getattr(handler, shape.name(cpu_side))

    @property
    def src_tensors(self) -> list[torch.Tensor]:
        return self.gpu_tensors if self.gpu_to_cpu else self.cpu_tensors

    @property
    def dst_tensors(self) -> list[torch.Tensor]:
        return self.cpu_tensors if self.gpu_to_cpu else self.gpu_tensors

    @property
    def src_blocks_per_chunk(self) -> int:
        return 1 if self.gpu_to_cpu else self.blocks_per_chunk

    @property
    def dst_blocks_per_chunk(self) -> int:
        return self.blocks_per_chunk if self.gpu_to_cpu else 1

    @property
    def copy_op(self) -> Any:
        """The copy op the stock handler picked (read per call: tests may replace it)."""
        return self.handler._swap_blocks_batch

    def max_copy_ops(self, group_sizes: Sequence[int]) -> int:
        """Descriptors a job of ``group_sizes`` blocks per group may need."""
        if not self._fills_inline:
            return int(self.handler._estimate_max_copy_ops(group_sizes))
        refs = self.layer_refs_per_group
        return sum(size * len(group) for size, group in zip(group_sizes, refs, strict=True))

    def fill_group(
        self,
        group: int,
        *,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        pages: int,
        src_skip: int,
        dst_skip: int,
        out: tuple[np.ndarray, np.ndarray, np.ndarray],
        op_index: int,
    ) -> tuple[int, int]:
        """Stock's descriptors for one group, written into ``out`` from ``op_index``;
        returns the index past them and the bytes they copy. Releases that fill from
        device pointers (0.34) fill only inside their own ``transfer_async``."""
        if self._fills_from_pointers:
            raise NotImplementedError(
                "this vLLM fills descriptors from the connector's device pointers; "
                "stock's fill is reached through its transfer_async"
            )
        all_src, all_dst, all_sizes = out
        if not self._fills_inline:
            filled: tuple[int, int] = self.handler._fill_group_ops(
                group,
                group_src=src_ids,
                group_dst=dst_ids,
                group_size=pages,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_index,
            )
            return filled
        nbytes = 0
        for ref in self.layer_refs_per_group[group]:
            end = op_index + pages
            gpu_worker.compute_sub_block_ptrs(
                src_ids,
                self.src_blocks_per_chunk,
                all_src[op_index:end],
                self.src_tensors[ref.tensor_idx],
                skip_count=src_skip,
            )
            gpu_worker.compute_sub_block_ptrs(
                dst_ids,
                self.dst_blocks_per_chunk,
                all_dst[op_index:end],
                self.dst_tensors[ref.tensor_idx],
                skip_count=dst_skip,
            )
            all_sizes[op_index:end] = ref.page_size_bytes
            nbytes += pages * ref.page_size_bytes
            op_index = end
        return op_index, nbytes

    def copy(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        """Stock's copy op over filled descriptors, with stock's source access order."""
        self.copy_op(src, dst, sizes, is_src_access_order_any=not self.gpu_to_cpu)

    def shutdown(self) -> None:
        self.handler.shutdown()
