"""vLLM's offload handler and kvcore's over one layout, driven as vLLM's worker drives them.

:func:`stock_handler` builds vLLM's ``SingleDirectionOffloadingHandler`` (on a CPU, over
host stand-ins), :func:`kvcore_handler` kvcore's in its place, and :func:`runnable_stock`
a copy of stock whose copy op runs where vLLM's compiled one is absent (the same driver
call on a GPU, one memmove per descriptor on a CPU). :func:`submit_and_collect` drives a
handler through one step's jobs as vLLM's offloading worker does. Apart from the A/B's
timing (:mod:`benchmarks.vllm.ab`) because the sweep and the soak build and drive their
handlers the same way.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import inspect
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import TransferResult
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

from benchmarks.vllm.host_platform import is_run_on_host, run_on_host, without_host_methods
from benchmarks.vllm.offload_layout import Layout
from kvcore.config import KVCoreConfig
from kvcore.issuer import Issuer
from kvcore.kernels.batch_copy import batch_copy_available, batch_copy_pointers
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy, vllm_handler_policy
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams
from kvcore_vllm.handler_install import handler_issuer, handler_stream_priority
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.stock_copies import gpu_tensors_of
from kvcore_vllm.transfers import KVCoreOffloadingHandler


class _HostAsDevice(torch.Tensor):
    """A host tensor that the stock handler's constructor accepts as its GPU side.

    Only for CPU dry runs and tests: the constructor asserts CUDA or XPU tensors, while
    everything kvcore and the stock descriptor fill do with them works on host memory.
    """

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


# Read once: every job a bench submits asks it, and reading it costs a metadata lookup.
_SHAPE = installed_shape()
# The GPU tensors of stock handlers built here on a release whose handler holds none.
_GPU_TENSORS: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()
# Each handler's CanonicalKVCaches, built once as vLLM's connector holds them.
_KV_CACHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def handler_gpu_tensors(handler: Any) -> list[torch.Tensor]:
    """The GPU KV tensors a stock handler (built by :func:`stock_handler`) or kvcore's copies
    to or from."""
    if isinstance(handler, KVCoreOffloadingHandler):
        return handler.gpu_tensors
    if _SHAPE.device_pointers:
        return _GPU_TENSORS[handler]
    return gpu_tensors_of(handler)


def transfer_args(handler: Any, src_spec: Any, dst_spec: Any) -> tuple[Any, Any]:
    """What the installed vLLM passes ``handler.transfer_async`` after the job id for a job
    of these specs: the specs themselves, or (0.34) the device pointers its connector
    resolves with its own ``resolve_device_pointers``, and the CPU spec."""
    if not _SHAPE.device_pointers:
        return src_spec, dst_spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    gpu_spec, cpu_spec = (src_spec, dst_spec) if handler.gpu_to_cpu else (dst_spec, src_spec)
    return resolve_device_pointers(gpu_spec, canonical_kv_caches(handler)), cpu_spec


def canonical_kv_caches(handler: Any) -> Any:
    """The ``CanonicalKVCaches`` a handler's worker is built on, on a release whose worker
    passes them to kvcore's handlers (0.34); None on the others."""
    if not _SHAPE.device_pointers:
        return None
    kv_caches = _KV_CACHES.get(handler)
    if kv_caches is None:
        from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

        tensors = handler_gpu_tensors(handler)
        kv_caches = _KV_CACHES[handler] = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
            group_data_refs=handler.layer_refs_per_group,
        )
    return kv_caches


def submit(handler: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
    """``handler.transfer_async`` for a job of these specs, as the installed vLLM calls it."""
    result: bool = handler.transfer_async(job_id, *transfer_args(handler, src_spec, dst_spec))
    return result


def stock_handler(
    gpu: list[torch.Tensor],
    host: list[torch.Tensor],
    layout: Layout,
    *,
    gpu_to_cpu: bool,
    groups: int = 1,
) -> SingleDirectionOffloadingHandler:
    """vLLM's own handler over the tensors; on a CPU ``gpu``, over host stand-ins and with
    its methods runnable there (:func:`benchmarks.vllm.host_platform.run_on_host`)."""
    on_host = gpu[0].device.type == "cpu"
    if on_host:
        gpu = [t.as_subclass(_HostAsDevice) for t in gpu]
    shape = _SHAPE
    options: dict[str, Any] = {
        shape.name("blocks_per_chunk"): layout.blocks_per_chunk,
        shape.name("layer_refs_per_group"): layout.refs(groups),
    }
    if "host_memory_is_pinned" in inspect.signature(SingleDirectionOffloadingHandler).parameters:
        options["host_memory_is_pinned"] = gpu[0].device.type == "cuda"
    if not shape.device_pointers:
        options["gpu_tensors"] = list(gpu)
    handler = SingleDirectionOffloadingHandler(
        cpu_tensors=list(host), gpu_to_cpu=gpu_to_cpu, **options
    )
    if shape.device_pointers:
        _GPU_TENSORS[handler] = list(gpu)
    return run_on_host(handler) if on_host else handler


def kvcore_handler(
    stock: SingleDirectionOffloadingHandler,
    *,
    policy: PathPolicy | None = None,
    metrics: Metrics | None = None,
    mover: Mover | None = None,
    streams: NamedStreams | None = None,
    stock_rules: bool = True,
    stock_share: float = 0.0,
    plan_policy: PathPolicy | None = None,
    issuer: Issuer | None = None,
) -> KVCoreOffloadingHandler:
    """kvcore's handler in place of ``stock``, on CUDA streams or, on a CPU, run at once;
    ``policy`` defaults to the one the environment (KVCORE_*) asks for. ``plan_policy``: the
    thresholds jobs are planned with; by default the mover's, or, where neither ``policy``
    nor ``mover`` is given, the environment's for the handler's direction (:func:`env_policy`).
    ``issuer``: the thread that issues its jobs; on CUDA streams, by default the one
    ``KVCORE_BACKGROUND_ISSUE`` asks for, as the plugin's handlers have."""
    gpu_tensors = handler_gpu_tensors(stock)
    device = gpu_tensors[0].device
    compute: Callable[[], Any]
    name = "store" if stock.gpu_to_cpu else "load"
    if streams is None and device.type == "cuda":
        config = KVCoreConfig.from_env()
        priority = handler_stream_priority(config, gpu_to_cpu=stock.gpu_to_cpu)
        cuda = CudaStreams(device, priority=priority)
        streams, compute = cuda, cuda.compute_stream
        issuer = handler_issuer(config, name, device) if issuer is None else issuer
    else:
        streams = CpuSyncStreams() if streams is None else streams
        compute = _named(streams, "compute")
    if plan_policy is None and policy is None and mover is None:
        plan_policy = env_policy(gpu_to_cpu=stock.gpu_to_cpu)
    return KVCoreOffloadingHandler(
        stock,
        mover=Mover(policy or env_policy(), metrics=metrics) if mover is None else mover,
        gpu_tensors=gpu_tensors,
        streams=streams,
        compute_stream=compute,
        name=name,
        metrics=metrics,
        stock_rules=stock_rules,
        stock_share=stock_share,
        plan_policy=plan_policy,
        issuer=issuer,
    )


def env_policy(*, gpu_to_cpu: bool = False) -> PathPolicy:
    """The policy kvcore's vLLM handlers plan with, under this process's settings: the
    shared mover's (a load handler's), or with ``gpu_to_cpu`` a store handler's."""
    return vllm_handler_policy(KVCoreConfig.from_env(), gpu_to_cpu=gpu_to_cpu)


def _named(streams: NamedStreams, name: str) -> Callable[[], Any]:
    return lambda: streams.stream(name)


def compiled_ops_loaded() -> bool:
    return hasattr(torch.ops, "_C_cache_ops") and hasattr(
        torch.ops._C_cache_ops, "swap_blocks_batch"
    )


def runnable_stock(
    stock: SingleDirectionOffloadingHandler, device: torch.device
) -> SingleDirectionOffloadingHandler:
    """``stock`` where its copy op can run here, else a copy of it whose copy op is the same
    copy done another way: on a GPU without vLLM's compiled ops, the same driver call; on a
    CPU, where vLLM has no copy op, one memmove per descriptor (the jobs kvcore's handler
    leaves to stock need one to run at all)."""
    if device.type != "cuda":
        return _with_copy_op(stock, _host_swap_blocks_batch)
    if compiled_ops_loaded() or not batch_copy_available():
        return stock
    return with_emulated_copy_op(stock)


def with_emulated_copy_op(
    stock: SingleDirectionOffloadingHandler,
) -> SingleDirectionOffloadingHandler:
    """A copy of ``stock`` whose compiled copy op, where it picked that op, is replaced by
    the same driver call on the same descriptors (vLLM's Triton pick is kept as is).

    Everything else (descriptor fill, streams, events, get_finished) is vLLM's own code, so
    the handler's host cost is measured too, as it is for kvcore's handler.
    """
    triton_pick = isinstance(stock._swap_blocks_batch, functools.partial)
    return _with_copy_op(stock, None if triton_pick else emulated_swap_blocks_batch)


def _with_copy_op(
    stock: SingleDirectionOffloadingHandler, swap: Callable[..., None] | None
) -> SingleDirectionOffloadingHandler:
    """A copy of ``stock`` with its own queue of jobs, streams, events and descriptor
    buffers, copying with ``swap`` (None keeps its own copy op)."""
    emulated = copy.copy(stock)
    if stock in _GPU_TENSORS:
        _GPU_TENSORS[emulated] = _GPU_TENSORS[stock]
    if is_run_on_host(stock):
        # The copied methods are bound to ``stock``: bind the copy's own.
        run_on_host(without_host_methods(emulated))
    if swap is not None:
        emulated._swap_blocks_batch = swap
    emulated._transfers = deque()
    emulated._transfer_events = {}
    emulated._stream_pool, emulated._event_pool, emulated._buffer_pool = [], [], []
    return emulated


def _host_swap_blocks_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool
) -> None:
    """vLLM's swap_blocks_batch contract on host memory: one memmove per descriptor."""
    for source, target, size in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(target, source, size)


def emulated_swap_blocks_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool
) -> None:
    """vLLM's compiled swap_blocks_batch: one cudaMemcpyBatchAsync over the descriptor
    arrays as they lie in memory, on the current stream."""
    batch_copy_pointers(
        dst.numpy().view(np.uint64),
        src.numpy().view(np.uint64),
        sizes.numpy().view(np.uint64),
        torch.cuda.current_stream(),
        source_in_stream_order=not is_src_access_order_any,
        max_copies_per_call=None,
    )


def through_handler(
    handler: Any, specs: tuple[Any, Any], submit_seconds: list[float], jobs: int = 1
) -> None:
    """``jobs`` copies of the job submitted back to back (as a worker does when several
    are due), then waited for; each submission's host time is recorded."""
    submit_and_collect(handler, [(job_id, specs) for job_id in range(jobs)], submit_seconds)


# A job not reported this long after wait() returned is lost: the handler is broken.
COLLECT_TIMEOUT_S = 300.0


def submit_timed(
    handler: Any, jobs: Sequence[tuple[int, tuple[Any, Any]]], submit_seconds: list[float]
) -> None:
    """``transfer_async`` for each job in order, its host time appended to
    ``submit_seconds``."""
    for job_id, (src_spec, dst_spec) in jobs:
        started = time.perf_counter()
        submit(handler, job_id, src_spec, dst_spec)
        submit_seconds.append(time.perf_counter() - started)


def submit_and_collect(
    handler: Any,
    jobs: Sequence[tuple[int, tuple[Any, Any]]],
    submit_seconds: list[float],
    between: Callable[[], object] | None = None,
) -> list[TransferResult]:
    """What vLLM's offloading worker does with a step's jobs: ``transfer_async`` each
    (its host time appended to ``submit_seconds``), ``wait`` for all of them, then
    ``get_finished`` until every one is reported; returns the results as reported.
    ``between`` runs after the submissions and before the wait: what the engine queues
    meanwhile (the next batch's forward)."""
    submit_timed(handler, jobs, submit_seconds)
    if between is not None:
        between()
    handler.wait({job_id for job_id, _ in jobs})
    results: list[TransferResult] = []
    deadline = time.perf_counter() + COLLECT_TIMEOUT_S
    while len(results) < len(jobs):
        results += handler.get_finished()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(jobs) - len(results)} jobs were never reported finished")
    return results


def submit_and_step(
    handler: Any,
    jobs: Sequence[tuple[int, tuple[Any, Any]]],
    submit_seconds: list[float],
    step: Callable[[], object],
    max_steps: int,
) -> tuple[list[TransferResult], list[float]]:
    """What vLLM's engine does around a step's loads, step after step: ``transfer_async``
    each job (its host time appended to ``submit_seconds``), then ``step`` (the running
    batch's forward, run to its end as the engine's sampling waits for it) and
    ``get_finished`` at the end of each, until every job is reported; nothing waits for
    the jobs themselves. Returns the results as reported and each step's end
    (``time.perf_counter``)."""
    submit_timed(handler, jobs, submit_seconds)
    results: list[TransferResult] = []
    ends: list[float] = []
    while len(results) < len(jobs):
        if len(ends) == max_steps:
            raise TimeoutError(
                f"{len(jobs) - len(results)} jobs were not reported within {max_steps} steps"
            )
        step()
        results += handler.get_finished()
        ends.append(time.perf_counter())
    return results, ends
