"""A/B of vLLM's CPU offload copies: the stock handler's paths against kvcore's handler.

:func:`ab` builds one vLLM offload layout per descriptor size (GPU KV tensors, the
host tensors as vLLM lays them out, vLLM's own ``SingleDirectionOffloadingHandler``
over them), submits the same job to each path, checks the destination bytes against
the source after every timed copy, and returns one row per (direction, size,
fragmentation, path). Stock paths, whichever can run where it runs:

* ``stock_handler``: vLLM's handler end to end, when vLLM's compiled ops are loaded;
* ``stock_handler_emul``: where they are not, vLLM's handler end to end with its compiled
  copy op (when it picked that op over its Triton kernel) replaced by the same driver call
  on the same descriptor arrays, read in place through ctypes;
* ``stock_batch_dma``: what its compiled op does (one cudaMemcpyBatchAsync over one
  descriptor per page), issued through kvcore's binding of the same driver call;
* ``stock_triton``: vLLM's Triton swap kernel over the stock descriptors (loads whose
  pages stock would give it: under 28 KiB, 8-byte multiples, 16 descriptors or more);
* ``per_block_copy``: one ``copy_`` per descriptor, the Python-level floor.

kvcore paths: ``kvcore`` is its handler as installed (jobs whose stock copy it judges
cheaper stay stock); ``kvcore_own`` is the same handler with those rules off, so that
every job it can copy exactly runs on its own paths (what the rules should be is read
off the two).

On a CPU ``device`` only ``per_block_copy`` and the kvcore paths run (a tiny dry run).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import inspect
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

from kvcore.bench.vllm.host_platform import is_run_on_host, run_on_host, without_host_methods
from kvcore.config import KVCoreConfig
from kvcore.kernels.batch_copy import batch_copy_available, batch_copy_pointers
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.path_policy import PathPolicy, policy_from_config
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.stock_copies import StockCopies, gpu_tensors_of
from kvcore_vllm.transfers import KVCoreOffloadingHandler

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


class _HostAsDevice(torch.Tensor):
    """A host tensor that the stock handler's constructor accepts as its GPU side.

    Only for CPU dry runs and tests: the constructor asserts CUDA or XPU tensors, while
    everything kvcore and the stock descriptor fill do with them works on host memory.
    """

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def stock_handler(
    gpu: list[torch.Tensor],
    host: list[torch.Tensor],
    layout: Layout,
    *,
    gpu_to_cpu: bool,
    groups: int = 1,
) -> SingleDirectionOffloadingHandler:
    """vLLM's own handler over the tensors; on a CPU ``gpu``, over host stand-ins and with
    its methods runnable there (:func:`kvcore.bench.vllm.host_platform.run_on_host`)."""
    on_host = gpu[0].device.type == "cpu"
    if on_host:
        gpu = [t.as_subclass(_HostAsDevice) for t in gpu]
    shape = installed_shape()
    options: dict[str, Any] = {
        shape.name("blocks_per_chunk"): layout.blocks_per_chunk,
        shape.name("layer_refs_per_group"): layout.refs(groups),
    }
    if "host_memory_is_pinned" in inspect.signature(SingleDirectionOffloadingHandler).parameters:
        options["host_memory_is_pinned"] = gpu[0].device.type == "cuda"
    handler = SingleDirectionOffloadingHandler(
        gpu_tensors=list(gpu), cpu_tensors=list(host), gpu_to_cpu=gpu_to_cpu, **options
    )
    return run_on_host(handler) if on_host else handler


def kvcore_handler(
    stock: SingleDirectionOffloadingHandler,
    *,
    policy: PathPolicy | None = None,
    metrics: Metrics | None = None,
    mover: Mover | None = None,
    streams: NamedStreams | None = None,
    stock_rules: bool = True,
) -> KVCoreOffloadingHandler:
    """kvcore's handler in place of ``stock``, on CUDA streams or, on a CPU, run at once;
    ``policy`` defaults to the one the environment (KVCORE_*) asks for."""
    device = gpu_tensors_of(stock)[0].device
    compute: Callable[[], Any]
    if streams is None and device.type == "cuda":
        cuda = CudaStreams(device)
        streams, compute = cuda, cuda.compute_stream
    else:
        streams = CpuSyncStreams() if streams is None else streams
        compute = _named(streams, "compute")
    return KVCoreOffloadingHandler(
        stock,
        mover=Mover(policy or env_policy(), metrics=metrics) if mover is None else mover,
        streams=streams,
        compute_stream=compute,
        name="store" if stock.gpu_to_cpu else "load",
        metrics=metrics,
        stock_rules=stock_rules,
    )


def env_policy() -> PathPolicy:
    return policy_from_config(KVCoreConfig.from_env())


def _named(streams: NamedStreams, name: str) -> Callable[[], Any]:
    return lambda: streams.stream(name)


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


def ab(
    device: torch.device | str,
    block_bytes_list: Sequence[int] = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20),
    frag_levels: Sequence[float] = (0.0, 0.5, 1.0),
    *,
    job_bytes: int = 64 << 20,
    tensors: int = 1,
    shared_region: bool = False,
    directions: Iterable[bool] = (True, False),
    repeats: int = 10,
    passes: int = 2,
    jobs: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time each stock path and kvcore's handler; one dict per (direction, size, frag, path).

    Each job moves about ``job_bytes`` in pages of ``block_bytes`` per KV tensor
    (``tensors`` of them: 1 is a cross-layer layout), with both sides' ids broken at
    ``frag`` of the neighbour pairs. Each path runs ``repeats`` timed copies in each of
    ``passes`` passes; a timed copy is ``jobs`` copies of the job issued back to back,
    so that with more than one, host time overlaps the copies as in a busy worker. Keys:
    direction, block_bytes, frag, path, pages, descriptors, jobs, seconds (median, for
    all ``jobs``), gbps, submit_us (median host time of a handler's ``transfer_async``;
    None for paths that are no handler), bytes_ok (every pass's destination checked).
    """
    device = torch.device(device)
    rows: list[dict[str, Any]] = []
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for block_bytes in block_bytes_list:
        pages = max(16, min(4096, job_bytes // (block_bytes * tensors)))
        # fragmented_ids steps by at most 4, and the ids start below `pages`.
        span = pages * 5
        layout = Layout(
            page_bytes=block_bytes,
            tensors=tensors,
            gpu_blocks=span,
            cpu_chunks=span,
            shared_region=shared_region,
        )
        gpu, host = layout.make_tensors(device, generator)
        for gpu_to_cpu in directions:
            stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
            # The jobs kvcore leaves to stock need stock's copy op: emulated where it is absent.
            kvcore = kvcore_handler(runnable_stock(stock, device))
            kvcore_own = kvcore_handler(runnable_stock(stock, device), stock_rules=False)
            for frag in frag_levels:
                gpu_ids = fragmented_ids(pages, frag, rng) + int(rng.integers(0, pages))
                cpu_ids = fragmented_ids(pages, frag, rng) + int(rng.integers(0, pages))
                specs = job_specs(gpu_ids, cpu_ids, gpu_to_cpu=gpu_to_cpu)
                check = _Pages(gpu, host, gpu_ids, cpu_ids, gpu_to_cpu)
                paths = runnable_paths(stock, kvcore, kvcore_own, specs, device, jobs)
                samples: dict[str, list[float]] = {p.name: [] for p in paths}
                copied = dict.fromkeys(samples, True)
                # Passes in alternating order, so that drift of the link or the host over
                # a cell's minutes is spread over every path instead of biasing one.
                for round_index in range(passes):
                    for path in paths if round_index % 2 == 0 else paths[::-1]:
                        check.poison()
                        samples[path.name] += _time(path.run, device, repeats)
                        copied[path.name] = copied[path.name] and check.copied()
                nbytes = pages * block_bytes * tensors * jobs
                for path in paths:
                    seconds = statistics.median(samples[path.name])
                    rows.append(
                        {
                            "direction": "d2h" if gpu_to_cpu else "h2d",
                            "block_bytes": block_bytes,
                            "frag": frag,
                            "path": path.name,
                            "pages": pages,
                            "descriptors": pages * tensors,
                            "jobs": jobs,
                            "seconds": seconds,
                            "gbps": nbytes / seconds / 1e9,
                            "submit_us": (
                                statistics.median(path.submit_seconds) * 1e6
                                if path.submit_seconds
                                else None
                            ),
                            "bytes_ok": copied[path.name],
                        }
                    )
            kvcore.shutdown()
            kvcore_own.shutdown()
    return rows


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
            through("stock_handler_emul", _with_emulated_copy_op(stock))
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
    return _with_emulated_copy_op(stock)


def _with_emulated_copy_op(
    stock: SingleDirectionOffloadingHandler,
) -> SingleDirectionOffloadingHandler:
    """A copy of ``stock`` whose compiled copy op, where it picked that op, is replaced by
    the same driver call on the same descriptors (vLLM's Triton pick is kept as is).

    Everything else (descriptor fill, streams, events, get_finished) is vLLM's own code, so
    the handler's host cost is measured too, as it is for kvcore's handler.
    """
    triton_pick = isinstance(stock._swap_blocks_batch, functools.partial)
    return _with_copy_op(stock, None if triton_pick else _emulated_swap_blocks_batch)


def _with_copy_op(
    stock: SingleDirectionOffloadingHandler, swap: Callable[..., None] | None
) -> SingleDirectionOffloadingHandler:
    """A copy of ``stock`` with its own queue of jobs, streams, events and descriptor
    buffers, copying with ``swap`` (None keeps its own copy op)."""
    emulated = copy.copy(stock)
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


def _emulated_swap_blocks_batch(
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


def submit_and_collect(
    handler: Any, jobs: Sequence[tuple[int, tuple[Any, Any]]], submit_seconds: list[float]
) -> list[TransferResult]:
    """What vLLM's offloading worker does with a step's jobs: ``transfer_async`` each
    (its host time appended to ``submit_seconds``), ``wait`` for all of them, then
    ``get_finished`` until every one is reported; returns the results as reported."""
    for job_id, (src_spec, dst_spec) in jobs:
        started = time.perf_counter()
        handler.transfer_async(job_id, src_spec, dst_spec)
        submit_seconds.append(time.perf_counter() - started)
    handler.wait({job_id for job_id, _ in jobs})
    results: list[TransferResult] = []
    deadline = time.perf_counter() + COLLECT_TIMEOUT_S
    while len(results) < len(jobs):
        results += handler.get_finished()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(jobs) - len(results)} jobs were never reported finished")
    return results


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


def compiled_ops_loaded() -> bool:
    return hasattr(torch.ops, "_C_cache_ops") and hasattr(
        torch.ops._C_cache_ops, "swap_blocks_batch"
    )


def _batch_dma(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, stream: torch.cuda.Stream
) -> None:
    """One cudaMemcpyBatchAsync over the stock descriptors, as vLLM's compiled op issues,
    on ``stream`` once it has caught up with the current one (stock's ordering)."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        _emulated_swap_blocks_batch(src, dst, sizes, is_src_access_order_any=False)


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


class _Pages:
    """A job's destination pages: poisoned before a path runs, compared after."""

    def __init__(
        self,
        gpu: list[torch.Tensor],
        host: list[torch.Tensor],
        gpu_ids: np.ndarray,
        cpu_ids: np.ndarray,
        gpu_to_cpu: bool,
    ) -> None:
        self._gpu, self._host, self._gpu_to_cpu = gpu, host, gpu_to_cpu
        self._gpu_index = torch.from_numpy(gpu_ids).to(gpu[0].device)
        self._cpu_index = torch.from_numpy(cpu_ids)

    def poison(self) -> None:
        """Every destination byte made different from its source byte."""
        for device_side, host_side in zip(self._gpu, self._host, strict=True):
            source = device_side[self._gpu_index].cpu()
            if self._gpu_to_cpu:
                host_side[self._cpu_index] = torch.bitwise_not(source)
            else:
                device_side[self._gpu_index] = torch.bitwise_not(host_side[self._cpu_index]).to(
                    device_side.device
                )

    def copied(self) -> bool:
        for device_side, host_side in zip(self._gpu, self._host, strict=True):
            if not torch.equal(device_side[self._gpu_index].cpu(), host_side[self._cpu_index]):
                return False
        return True


def _time(run: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs, each to the device's end, after one warm-up."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        samples.append(time.perf_counter() - started)
    return samples
