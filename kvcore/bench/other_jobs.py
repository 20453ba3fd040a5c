"""The core suite's jobs outside its layout grid: a reload and a page-out at once, 32 layers
in one submission against one per layer, and a view the planner hands to the stock path."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvcore.bench.measure import (
    SUBMIT_COVER_CYCLES,
    bytes_identical,
    host_rows,
    random_rows,
    result_row,
    scattered_layout,
    timed,
)
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.plans import TransferPlan, plan
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams

if TYPE_CHECKING:
    from kvcore.bench.suite import BenchOptions


def duplex_results(opts: BenchOptions, mover: Mover, ceiling: float) -> list[dict[str, Any]]:
    """A reload and a page-out at once, each on its own copy stream, timed together on the GPU."""
    rows, row_shape, dtype = opts.tokens, (2, 8, 128), torch.bfloat16
    pin = opts.device.type == "cuda"
    host_in, in_buffer = host_rows((rows, *row_shape), dtype, pin)
    host_out, out_buffer = host_rows((rows, *row_shape), dtype, pin)
    host_in.copy_(random_rows((rows, *row_shape), dtype, torch.device("cpu")))
    device_in = random_rows((rows, *row_shape), dtype, opts.device)
    device_out = random_rows((rows, *row_shape), dtype, opts.device)
    every = torch.arange(rows)
    reload = plan(host_in, device_in, every, every, direction=Direction.H2D, policy=mover.policy)
    page_out = plan(
        device_out, host_out, every, every, direction=Direction.D2H, policy=mover.policy
    )
    on_cuda = opts.device.type == "cuda"
    streams: NamedStreams = CudaStreams(opts.device) if on_cuda else CpuSyncStreams()

    def both() -> float:
        """Seconds from the moment both streams may start to the later one's end."""
        start = None
        if on_cuda:
            # Both copy streams wait for a gate held by a spin kernel while the host
            # submits, so the time is the copies' own, not the submissions'.
            torch.cuda._sleep(SUBMIT_COVER_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        ends = []
        for p in (reload, page_out):
            stream = streams.stream(p.direction.value)
            if start is not None:
                streams.wait_event(stream, start)
            streams.run_on(stream, functools.partial(mover.execute, p))
            ends.append(streams.record(stream))
        for end in ends:
            streams.synchronize(end)
        seconds = (
            time.perf_counter() - started
            if start is None
            else max(start.elapsed_time(end) for end in ends) / 1e3
        )
        for end in ends:
            streams.release(end)
        return seconds

    both()
    times = [both() for _ in range(opts.repeats)]
    identical = bytes_identical(device_in, host_in.to(opts.device)) and bytes_identical(
        host_out, device_out.cpu()
    )
    nbytes = reload.nbytes + page_out.nbytes
    result = result_row(
        "mha-4KiB/h2d+d2h/one-run/both-directions-at-once",
        "kvcore:single_copy x2",
        nbytes,
        statistics.median(times),
        0.0,
        identical,
        ceiling,
        "kvcore",
    )
    in_buffer.close()
    out_buffer.close()
    return [result]


# A job over every layer at once, as vLLM's offload handler gives one: 32 KV tensors.
_LAYERS = 32


def layers_results(opts: BenchOptions, mover: Mover, ceiling: float) -> list[dict[str, Any]]:
    """One transfer over 32 layers (``tokens`` rows in all, 4 KiB each, host half scattered
    by 16-row pages, device fully): one submission for every layer against a plan rebound
    and executed per layer, both directions, beside the same run's ceiling."""
    rows, row_shape, dtype = max(opts.tokens // _LAYERS, 16), (2, 8, 128), torch.bfloat16
    pin = opts.device.type == "cuda"
    host, host_buffer = host_rows((_LAYERS, 2 * rows, *row_shape), dtype, pin)
    host.copy_(random_rows(tuple(host.shape), dtype, torch.device("cpu")))
    device = random_rows((_LAYERS, 2 * rows, *row_shape), dtype, opts.device)
    generator = torch.Generator().manual_seed(11)
    host_idx = scattered_layout(rows, 0.5, 16, generator)
    device_idx = scattered_layout(rows, 1.0, 16, generator)
    results = []
    for direction in Direction:
        page_in = direction is Direction.H2D
        src, dst = (host, device) if page_in else (device, host)
        src_idx, dst_idx = (host_idx, device_idx) if page_in else (device_idx, host_idx)
        srcs, dsts = list(src), list(dst)
        expected = dst.clone()
        expected[:, dst_idx.to(dst.device)] = src[:, src_idx.to(src.device)].to(dst.device)
        poison = dst.clone()
        first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=direction, policy=mover.policy)
        pairs = layer_pairs(srcs, dsts)

        ways: dict[str, Callable[[], None]] = {
            f"kvcore:{first.path.value} x{_LAYERS} in one submission": functools.partial(
                mover.execute, first, pairs
            ),
            f"kvcore:{first.path.value} x{_LAYERS} one per layer": functools.partial(
                execute_per_layer, mover, first, srcs, dsts
            ),
        }
        for label, fn in ways.items():
            dst.copy_(poison)
            seconds, host_seconds = timed(fn, opts.device, opts.repeats)
            if opts.device.type == "cuda":
                torch.cuda.synchronize(opts.device)
            results.append(
                result_row(
                    f"mha-4KiB/{direction.value}/{_LAYERS}-layers-host-50%/device-100%",
                    label,
                    first.nbytes * _LAYERS,
                    seconds,
                    host_seconds,
                    bytes_identical(dst, expected),
                    ceiling,
                    "kvcore",
                )
            )
    host_buffer.close()
    return results


def execute_per_layer(
    mover: Mover, first: TransferPlan, srcs: list[torch.Tensor], dsts: list[torch.Tensor]
) -> None:
    """``first`` rebound to each (src, dst) layer and executed, one submission per layer."""
    for src, dst in zip(srcs, dsts, strict=True):
        mover.execute(first.rebind(src, dst))


def fallback_results(opts: BenchOptions, mover: Mover) -> list[dict[str, Any]]:
    """A strided host view: the planner must hand it to the stock path, still exact."""
    rows = min(opts.tokens, 4096)
    wide = random_rows((rows, 2, 576), torch.bfloat16, torch.device("cpu"))
    src = wide[:, 0]
    dst = random_rows((rows, 576), torch.bfloat16, opts.device)
    generator = torch.Generator().manual_seed(7)
    src_idx = torch.randperm(rows, generator=generator)
    dst_idx = torch.randperm(rows, generator=generator)
    expected = dst.clone()
    expected[dst_idx.to(dst.device)] = src[src_idx].to(dst.device)
    fallback = plan(src, dst, src_idx, dst_idx, direction=Direction.H2D, policy=mover.policy)
    seconds, host_seconds = timed(lambda: mover.execute(fallback), opts.device, 1)
    nbytes = fallback.nbytes
    return [
        result_row(
            f"mla-1152B/strided-host-view ({fallback.reason})",
            f"kvcore:{fallback.path.value}",
            nbytes,
            seconds,
            host_seconds,
            bytes_identical(dst, expected),
            0.0,
            "kvcore",
        )
    ]
