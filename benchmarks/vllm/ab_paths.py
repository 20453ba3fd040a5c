"""The ways of running one offload job that the vLLM A/B times, stock's and kvcore's.

:func:`runnable_paths` lists those that can run here: vLLM's handler end to end (or with
its compiled copy op emulated), the driver call its compiled op makes, its Triton kernel,
one ``copy_`` per descriptor, and kvcore's handler with and without its stock rules. Apart
from the timing loop (:mod:`benchmarks.vllm.ab`) because what each path issues is its
own concern, and ``scripts/vllm_ab.sh`` wraps the list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

from benchmarks.vllm.offload_handlers import (
    compiled_ops_loaded,
    emulated_swap_blocks_batch,
    through_handler,
    with_emulated_copy_op,
)
from kvcore.kernels.batch_copy import batch_copy_available
from kvcore_vllm.stock_copies import StockCopies, gpu_tensors_of
from kvcore_vllm.transfers import KVCoreOffloadingHandler


@dataclass
class _Path:
    """One way of running the job; handler paths record their ``transfer_async`` time."""

    name: str
    run: Callable[[], None]
    submit_seconds: list[float] = field(default_factory=list)


def runnable_paths(
    stock: SingleDirectionOffloadingHandler,
    kvcore: KVCoreOffloadingHandler,
    kvcore_own: KVCoreOffloadingHandler,
    specs: tuple[Any, Any],
    device: torch.device,
    jobs: int = 1,
) -> list[_Path]:
    """The paths that can run here; stock ones fill their descriptors per job, as stock does.
    Each runs the job ``jobs`` times before it is waited for."""
    paths: list[_Path] = []

    def through(name: str, handler: Any) -> None:
        submit_seconds: list[float] = []
        run = functools.partial(through_handler, handler, specs, submit_seconds, jobs)
        paths.append(_Path(name, run, submit_seconds))

    def repeated(name: str, run: Callable[[], None]) -> None:
        def run_all() -> None:
            for _ in range(jobs):
                run()

        paths.append(_Path(name, run_all))

    if device.type == "cuda":
        if compiled_ops_loaded():
            through("stock_handler", stock)
        elif batch_copy_available() and hasattr(stock, "_swap_blocks_batch"):
            through("stock_handler_emul", with_emulated_copy_op(stock))
        if batch_copy_available():
            # Stock copies on a stream of its own; the batch API rejects the legacy default one.
            side = torch.cuda.Stream(device)
            repeated("stock_batch_dma", lambda: _batch_dma(*_stock_descriptors(stock, specs), side))
        if _triton_applies(stock, specs):
            repeated("stock_triton", lambda: _triton_swap(*_stock_descriptors(stock, specs)))
    repeated("per_block_copy", lambda: _per_block(stock, specs))
    through("kvcore", kvcore)
    through("kvcore_own", kvcore_own)
    return paths


def _stock_descriptors(
    stock: SingleDirectionOffloadingHandler, specs: tuple[Any, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stock handler's descriptors for the job, filled by its own code."""
    gpu_spec, cpu_spec = specs if stock.gpu_to_cpu else specs[::-1]
    size = len(gpu_spec.block_ids)
    copies = StockCopies(stock)
    count = copies.max_copy_ops([size])
    # Pinned where stock pins them, so the Triton path uploads them as stock does.
    pin = torch.cuda.is_available()
    buffers = [torch.empty(count, dtype=torch.int64, pin_memory=pin) for _ in range(3)]
    src_ids, dst_ids = (
        (gpu_spec.block_ids, cpu_spec.block_ids)
        if stock.gpu_to_cpu
        else (cpu_spec.block_ids, gpu_spec.block_ids)
    )
    filled, _ = copies.fill_group(
        0,
        src_ids=src_ids,
        dst_ids=dst_ids,
        pages=size,
        src_skip=0,
        dst_skip=0,
        out=(buffers[0].numpy(), buffers[1].numpy(), buffers[2].numpy()),
        op_index=0,
    )
    src, dst, sizes = (b[:filled] for b in buffers)
    return src, dst, sizes


def _batch_dma(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, stream: torch.cuda.Stream
) -> None:
    """One cudaMemcpyBatchAsync over the stock descriptors, as vLLM's compiled op issues,
    on ``stream`` once it has caught up with the current one (stock's ordering)."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        emulated_swap_blocks_batch(src, dst, sizes, is_src_access_order_any=False)


def _triton_applies(stock: SingleDirectionOffloadingHandler, specs: tuple[Any, Any]) -> bool:
    """Whether stock would give this job to its Triton kernel (see _select_swap_blocks_fn)."""
    from vllm.v1.kv_offload.cpu import swap_blocks_triton as swap

    if stock.gpu_to_cpu:
        return False
    page = stock.dst_tensors[0].shape[1]
    descriptors = len(specs[1].block_ids) * len(stock.dst_tensors)
    return page < swap.THRESHOLD_BYTES and page % 8 == 0 and descriptors >= swap.MIN_N


def _triton_swap(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
    from vllm.v1.kv_offload.cpu import swap_blocks_triton as swap

    page = int(sizes.max())
    chunk = min(1 << (page - 1).bit_length(), 8192)
    swap.swap_blocks_batch(src, dst, sizes, bytes_per_chunk=chunk)


def _per_block(stock: SingleDirectionOffloadingHandler, specs: tuple[Any, Any]) -> None:
    gpu_spec, cpu_spec = specs if stock.gpu_to_cpu else specs[::-1]
    gpu_tensors = gpu_tensors_of(stock)
    cpu_tensors = stock.dst_tensors if stock.gpu_to_cpu else stock.src_tensors
    for gpu, cpu in zip(gpu_tensors, cpu_tensors, strict=True):
        for block, chunk in zip(
            gpu_spec.block_ids.tolist(), cpu_spec.block_ids.tolist(), strict=True
        ):
            if stock.gpu_to_cpu:
                cpu[chunk].copy_(gpu[block], non_blocking=True)
            else:
                gpu[block].copy_(cpu[chunk], non_blocking=True)
