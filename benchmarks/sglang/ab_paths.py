"""The A/B's ways of making one SGLang transfer call: stock's, the direct model's, kvcore's.

Each :class:`PathRun` is a call ready to time, or the reason it cannot run here.
:func:`stock_path` calls SGLang's pool method with the indices where its cache controller
puts them (:func:`stock_indices`); :func:`direct_model_path` issues from Python the copies
sgl_kernel's ``direct`` ops make; :func:`kvcore_path` calls kvcore's AROUND hook as SGLang's
``HookRegistry`` does, and :func:`kvcore_gpu_indices_path` with the indices on the GPU.
The sweep's sides build their calls from :func:`stock_indices`, :func:`stock_kernel_sms`
and :func:`direct_copies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.sglang.pool_case import Component, PoolCase
from kvcore.mover import Mover
from kvcore.runs import find_paired_runs

OPS = ("load", "backup")
LOAD_LAYER = 1
# The direct model issues one Python copy_ per copy; past this many per call it would only
# measure Python.
MAX_MODEL_COPIES = 16384
METHOD_NAMES = {"load": "load_to_device_per_layer", "backup": "backup_from_device_all_layer"}


@dataclass
class PathRun:
    """One way to make a call: ``fn`` does it, or ``not_runnable`` says why it cannot."""

    name: str
    fn: Callable[[], None] | None
    sms: str
    not_runnable: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def host_pool_class(case: PoolCase) -> type:
    """The host pool's class, whose methods kvcore's hooks are registered for."""
    return type(case.pool)


def _call(case: PoolCase, op: str, method: Callable[..., Any], h: Any, d: Any, backend: str):
    if op == "load":
        return lambda: method(case.pool, case.device_pool, h, d, LOAD_LAYER, backend)
    return lambda: method(case.pool, case.device_pool, h, d, backend)


def stock_indices(
    case: PoolCase, op: str, backend: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where SGLang 0.5.23's cache controller puts the indices before the pool sees them."""
    if backend == "direct":
        return host_idx, dev_idx
    staged_write_back = (
        op == "backup"
        and case.layout == "page_first"
        and getattr(case.pool, "can_use_write_back_jit", False)
    )
    host = host_idx if staged_write_back else host_idx.to(case.opts.device)
    return host, dev_idx.to(case.opts.device)


def stock_kernel_sms(case: PoolCase, op: str, backend: str) -> tuple[str, str | None]:
    """(what the stock call runs and the SMs it holds, or None; why it cannot run, or None)."""
    if case.opts.device.type != "cuda":
        return "", "stock transfers need CUDA"
    if backend == "direct":
        # sgl_kernel's transfer_kv_direct / *_direct_pf_lf: one copy_ per run or page.
        return "sgl_kernel direct copies (copy engines, 0 SMs)", None
    from sglang.kernels.ops.kvcache import hicache

    if op == "backup" and case.layout == "page_first" and case.pool.can_use_write_back_jit:
        quota = hicache.DEFAULT_BLOCK_QUOTA
        return f"JIT staged write-back: relayout kernel ({quota} CTAs) + page DMA", None
    if not case.pool.can_use_jit:
        return "sgl_kernel.kvcacheio kernel", None
    element = case.row_bytes // len(case.components)
    tma = hicache.use_hicache_tma_kernel(
        element_size=element, block_quota=hicache.TMA_BLOCK_QUOTA, page_size=case.page_size
    )
    if tma:
        return f"JIT TMA kernel, {hicache.TMA_BLOCK_QUOTA} CTAs", None
    return f"JIT register kernel, {hicache.DEFAULT_BLOCK_QUOTA} CTAs", None


def stock_path(
    case: PoolCase, op: str, backend: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> PathRun:
    name = f"stock:{backend}"
    sms, reason = stock_kernel_sms(case, op, backend)
    if reason is not None:
        return PathRun(name, None, "", reason)
    method = vars(host_pool_class(case))[METHOD_NAMES[op]]
    h, d = stock_indices(case, op, backend, host_idx, dev_idx)
    return PathRun(name, _call(case, op, method, h, d, backend), sms)


def direct_copies(
    case: PoolCase, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> list[tuple[int, int, int]]:
    """(host slot, device slot, rows) of each copy sgl_kernel's ``direct`` ops issue per layer
    and buffer: ``layer_first`` one per run where host and device slots both step by one,
    after SGLang sorts the pairs by host slot; ``page_first_direct`` one per page."""
    if case.layout == "page_first_direct":
        page = case.page_size
        starts = zip(host_idx[::page].tolist(), dev_idx[::page].tolist(), strict=True)
        return [(h, d, page) for h, d in starts]
    order = host_idx.argsort()
    runs = find_paired_runs(host_idx[order], dev_idx[order])
    return list(
        zip(runs.src_starts.tolist(), runs.dst_starts.tolist(), runs.lengths.tolist(), strict=True)
    )


def direct_model_path(
    case: PoolCase, op: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> PathRun:
    """The copies stock ``direct`` makes, one ``copy_`` each, issued from Python.

    sgl_kernel issues the same copies from C++; only the host time per copy differs
    (Python's is the larger), so this bounds stock ``direct`` from below.
    """
    name = "model:direct"
    copies = direct_copies(case, host_idx, dev_idx)
    layers = [LOAD_LAYER] if op == "load" else list(range(case.opts.layers))
    calls = len(copies) * len(layers) * len(case.components)
    sms = f"copy engines, 0 SMs; {calls} copy_ calls from Python"
    if calls > MAX_MODEL_COPIES:
        return PathRun(name, None, sms, f"{calls} copies per call (over {MAX_MODEL_COPIES})")
    page = case.page_size

    def host_block(c: Component, layer: int, slot: int, rows: int) -> torch.Tensor:
        if case.layout == "page_first_direct":
            return c.host[slot // page, layer]
        return c.host[layer, slot : slot + rows]

    def run() -> None:
        for h, d, rows in copies:
            for layer in layers:
                for c in case.components:
                    host, device = host_block(c, layer, h, rows), c.devices[layer][d : d + rows]
                    if op == "load":
                        device.copy_(host, non_blocking=True)
                    else:
                        host.copy_(device, non_blocking=True)

    return PathRun(name, run, sms)


def kvcore_path(
    case: PoolCase,
    op: str,
    backend: str,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    mover: Mover,
) -> PathRun:
    """The AROUND hook as HookRegistry calls it: ``hook(original, pool, *args)``.

    The original recorded here copies nothing, so a call the hook hands to stock
    fails the byte check and is reported with the reason the mover counted.
    """
    from benchmarks.sglang.hook_adapter import pool_method_hook

    hook = pool_method_hook(host_pool_class(case), METHOD_NAMES[op])
    detail: dict[str, Any] = {"stock_calls": 0}

    def original(*args: Any, **kwargs: Any) -> None:
        detail["stock_calls"] += 1

    def around(*args: Any) -> None:
        hook(original, *args)

    run = PathRun(f"kvcore:{backend}", _call(case, op, around, host_idx, dev_idx, backend), "")
    run.detail = detail
    return run


def kvcore_gpu_indices_path(
    case: PoolCase, op: str, host_idx: torch.Tensor, dev_idx: torch.Tensor, mover: Mover
) -> PathRun:
    """The hook as a CUDA deployment with the ``kernel`` io backend calls it: the host
    indices moved to the GPU through the ``move_indices`` hook (which remembers the CPU
    ones), the device indices on the GPU, where kvcore plans around them unread."""
    from benchmarks.sglang.hook_adapter import move_indices

    def to_device(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
        return h.to(case.opts.device), d

    moved, _ = move_indices(to_device, None, host_idx, dev_idx)
    run = kvcore_path(case, op, "kernel", moved, dev_idx.to(case.opts.device), mover)
    run.name = "kvcore:kernel-gpu-indices"
    return run
