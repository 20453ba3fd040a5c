"""Host time to submit kvcore's transfers, and of the CUDA calls they are made of (issue 3).

Runs on a CUDA machine: ``python scripts/submit_cost.py [--rows N] [--json out.json]``.
For each item it queues a long spin kernel first, so every call is measured while the GPU
is busy (as when an engine queues layer after layer), and reports the median host
microseconds of ``--repeats`` calls, then the median of a few calls on an idle GPU, then of
a few calls each after a 10 ms pause of the host (what an isolated transfer pays: on the
lent H200 the first CUDA call after a pause costs far more than the same call in a row).
Items: torch and ctypes copies, events, the index upload, the gather kernel's launch
through Triton's JIT and through the compiled kernel, ``index_copy_``, and
``Mover.execute`` for each path on an already made plan.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.bench.measure import queued_host_seconds
from kvcore.bench.other_jobs import execute_per_layer
from kvcore.direction import Direction
from kvcore.kernels import triton_kernels
from kvcore.kernels.cudart import loaded_cudart
from kvcore.kernels.index_upload import IndexUploader
from kvcore.kernels.triton_rows import gather_rows_uva
from kvcore.kernels.triton_tile import default_tile
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import TransferPath
from kvcore.planning.plans import plan

SPIN_CYCLES = 200_000_000
PAUSE_SECONDS = 0.01


def _cudart() -> ctypes.CDLL:
    lib = loaded_cudart()
    if lib is None:
        raise RuntimeError("torch has no libcudart loaded")
    return lib


def measure(fn: Callable[[], object], device: torch.device, repeats: int) -> dict[str, float]:
    """Median host time of ``fn`` with the GPU busy (a spin kernel queued first), and with
    it idle (each call synchronised before the next): both, because a CUDA call's host cost
    can depend on what is queued."""
    fn()
    busy = queued_host_seconds(fn, device, repeats, spin_cycles=SPIN_CYCLES)
    idle = _each_after_sync(fn, max(3, repeats // 4))
    paused = _each_after_sync(fn, max(3, repeats // 4), pause_seconds=PAUSE_SECONDS)
    busy.sort()
    return {
        "median_us": statistics.median(busy) * 1e6,
        "p10_us": busy[len(busy) // 10] * 1e6,
        "p90_us": busy[(9 * len(busy)) // 10] * 1e6,
        "idle_median_us": statistics.median(idle) * 1e6,
        "paused_median_us": statistics.median(paused) * 1e6,
    }


def _each_after_sync(
    fn: Callable[[], object], calls: int, pause_seconds: float = 0.0
) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn``, each issued once the GPU is idle
    and, with ``pause_seconds``, after the host thread has spun that long."""
    seconds = []
    for _ in range(calls):
        if pause_seconds:
            _spin_host(pause_seconds)
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return seconds


def _spin_host(seconds: float) -> None:
    """Keep the host thread busy without a CUDA call, as an engine computing on the CPU."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def layered_items(
    item: Callable[[str, Callable[[], object]], None],
    mover: Mover,
    host: torch.Tensor,
    dev: torch.Tensor,
    gen: torch.Generator,
) -> None:
    """A 32-layer job (vLLM's per-layer tensors; 4096 rows a layer at the default --rows): one
    submission for every layer (Mover.execute over the pairs) against a rebound plan per layer."""
    layers = 32
    rows = host.shape[0] // (2 * layers)
    host_views = list(host[: layers * 2 * rows].view(layers, 2 * rows, -1))
    dev_views = list(dev[: layers * 2 * rows].view(layers, 2 * rows, -1))
    scattered = torch.randperm(2 * rows, generator=gen)[:rows]
    pages = (torch.randperm(2 * rows // 16, generator=gen)[: rows // 16] * 16)[:, None]
    paged = (pages + torch.arange(16)).flatten()
    cases = {
        "h2d_gather": (host_views, dev_views, scattered, paged),
        "d2h_gather": (dev_views, host_views, paged, scattered),
        "h2d_batched_pages": (host_views, dev_views, paged, paged),
    }
    for name, (srcs, dsts, src_idx, dst_idx) in cases.items():
        force = TransferPath.BATCHED_RUNS if "batched" in name else None
        direction = Direction.H2D if name.startswith("h2d") else Direction.D2H
        chosen = plan(
            srcs[0],
            dsts[0],
            src_idx,
            dst_idx,
            direction=direction,
            policy=mover.policy,
            force=force,
        )
        pairs = layer_pairs(srcs, dsts)
        item(
            f"32_layers_{name}[{chosen.path.value}]_one_submission",
            functools.partial(mover.execute, chosen, pairs),
        )
        item(
            f"32_layers_{name}_per_layer",
            functools.partial(execute_per_layer, mover, chosen, srcs, dsts),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--row-bytes", type=int, default=1152)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    rows, row_bytes = args.rows, args.row_bytes
    words = row_bytes // 8
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)

    host_buffer = allocate_host_buffer(2 * rows * row_bytes, pin=True)
    host = host_buffer.tensor.view(torch.int64).view(2 * rows, words)
    host.copy_(torch.randint(-(2**62), 2**62, host.shape, dtype=torch.int64))
    dev = torch.empty(2 * rows, words, dtype=torch.int64, device=device)
    nbytes = rows * row_bytes
    cudart = _cudart()
    cudart.cudaMemcpyAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    cudart.cudaMemcpyAsync.restype = ctypes.c_int

    gen = torch.Generator().manual_seed(7)
    scattered = torch.randperm(2 * rows, generator=gen)[:rows]
    contiguous = torch.arange(rows, dtype=torch.int64)
    pages = (torch.randperm(2 * rows // 64, generator=gen)[: rows // 64] * 64)[:, None]
    paged = (pages + torch.arange(64)).flatten()
    scattered_dev = scattered.to(device)
    contiguous_dev = contiguous.to(device)
    uploader = IndexUploader(device)
    fresh = [
        (scattered.clone(), contiguous.clone())
        for _ in range(args.repeats + 2 * max(3, args.repeats // 4) + 4)
    ]
    fresh_iter = iter(fresh)

    results: dict[str, dict[str, Any]] = {}

    def item(name: str, fn: Callable[[], object]) -> None:
        # One failing item must not cost the others in this single device call.
        try:
            results[name] = measure(fn, device, args.repeats)
        except Exception as error:
            torch.cuda.synchronize()
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name:<44} FAILED {results[name]['error']}", flush=True)
            return
        busy, idle = results[name]["median_us"], results[name]["idle_median_us"]
        paused = results[name]["paused_median_us"]
        print(
            f"{name:<44} {busy:>9.1f} us busy {idle:>9.1f} us idle {paused:>9.1f} us paused",
            flush=True,
        )

    item("current_stream", lambda: torch.cuda.current_stream())
    item("event_record", lambda: torch.cuda.Event().record())
    event = torch.cuda.Event()
    event.record()
    item("wait_event", lambda: torch.cuda.current_stream().wait_event(event))
    item("is_pinned", host.is_pinned)
    mib = (1 << 20) // row_bytes
    item("torch_copy_1MiB", lambda: dev[:mib].copy_(host[:mib], non_blocking=True))
    item("torch_copy_layer", lambda: dev[:rows].copy_(host[:rows], non_blocking=True))
    item(
        "ctypes_memcpy_layer",
        lambda: cudart.cudaMemcpyAsync(
            dev.data_ptr(), host.data_ptr(), nbytes, 4, torch.cuda.current_stream().cuda_stream
        ),
    )
    item("upload_all_miss", lambda: uploader.upload_all(next(fresh_iter)))
    hit = (scattered, contiguous)
    uploader.upload_all(hit)
    item("upload_all_hit", lambda: uploader.upload_all(hit))
    item(
        "gather_rows_uva",
        lambda: gather_rows_uva(host, scattered_dev, dev, contiguous_dev, ctas=8),
    )
    grid = (8,)
    launch_args = (host, dev, scattered_dev, contiguous_dev, rows, words, words)
    rows_per_tile, block_w = default_tile(words, 8)
    constants = {"WORDS": words, "ROWS": rows_per_tile, "BLOCK_W": block_w, "ALIGN": 2}
    kernel = triton_kernels.gather_rows_kernel
    item("triton_jit_launch", lambda: kernel[grid](*launch_args, **constants, num_warps=8))
    pointers = tuple(t.data_ptr() for t in (host, dev, scattered_dev, contiguous_dev))
    every_arg = (*pointers, rows, words, words, *constants.values())
    # The JIT's launch returns the compiled kernel: launched again directly, without the
    # JIT's argument binding and cache lookup (its runner wants all three grid dimensions).
    compiled: list[Any] = []
    item(
        "triton_compiled_launch",
        lambda: (
            compiled[0][(grid[0], 1, 1)](*every_arg, stream=torch.cuda.current_stream().cuda_stream)
            if compiled
            else compiled.append(kernel[grid](*launch_args, **constants, num_warps=8))
        ),
    )
    staging = torch.empty(rows, words, dtype=torch.int64, device=device)
    item("index_copy_", lambda: dev.index_copy_(0, scattered_dev, staging))
    item("index_select_out", lambda: torch.index_select(dev, 0, scattered_dev, out=staging))

    mover = Mover()
    cases = {
        "h2d_single": (host, dev, contiguous, contiguous),
        "d2h_single": (dev, host, contiguous, contiguous),
        "h2d_staged_paged_dev": (host, dev, contiguous, paged),
        "d2h_staged_paged_dev": (dev, host, paged, contiguous),
        "h2d_gather_paged": (host, dev, paged, contiguous),
        "d2h_gather_paged": (dev, host, contiguous, paged),
        "h2d_gather_tokens": (host, dev, scattered, paged),
        "d2h_gather_tokens": (dev, host, paged, scattered),
    }
    for name, (src, dst, src_idx, dst_idx) in cases.items():
        chosen = plan(src, dst, src_idx, dst_idx, policy=mover.policy)
        item(f"execute_{name}[{chosen.path.value}]", functools.partial(mover.execute, chosen))
        item(
            f"rebind+execute_{name}",
            functools.partial(execute_per_layer, mover, chosen, [src], [dst]),
        )
    forced = plan(
        host, dev, paged, contiguous, policy=mover.policy, force=TransferPath.BATCHED_RUNS
    )
    item("execute_h2d_batched_paged", lambda: mover.execute(forced))
    two_pieces = Mover(dataclasses.replace(mover.policy, staged_pieces=2))
    for name in ("h2d_staged_paged_dev", "d2h_staged_paged_dev"):
        src, dst, src_idx, dst_idx = cases[name]
        chosen = plan(src, dst, src_idx, dst_idx, policy=two_pieces.policy)
        item(f"execute_{name}_two_pieces", functools.partial(two_pieces.execute, chosen))
    layered_items(item, mover, host, dev, gen)
    torch.cuda.synchronize()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "row_bytes": row_bytes,
        "repeats": args.repeats,
        "items": results,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    host_buffer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
