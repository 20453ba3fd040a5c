"""`kvcore bench`: GB/s of every transfer path beside the link ceiling, and allocator churn.

One run measures, on the same data: the plain contiguous copy (the ceiling), the
path kvcore's planner picks, every other kvcore path that is correct for the
layout, and the naive stock baselines (advanced indexing; one copy per page).
Every result is checked byte for byte against a per-index reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvcore.allocator import ContiguousSlotAllocator
from kvcore.bench import report as bench_report
from kvcore.bench.churn import make_trace, replay
from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.bench.stock_allocator import StockSlotAllocator
from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.kernels.reference import as_row_words
from kvcore.layers import layer_pairs
from kvcore.mover import Mover
from kvcore.path_policy import PathPolicy, TransferPath, policy_from_config
from kvcore.planning import TransferPlan, plan
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams

PAGE = 64

ROW_KINDS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "mla-1152B": ((1, 576), torch.bfloat16),
    "mha-4KiB": ((2, 8, 128), torch.bfloat16),
    "mha-16KiB": ((2, 8, 512), torch.bfloat16),
}

# Host-side layouts: the share of 64-token pages moved away from one contiguous
# run; "tokens" scatters every token, as a page_size-1 pool does under churn.
HOST_FRAGMENTATION = {
    "0%": (0.0, PAGE),
    "50%": (0.5, PAGE),
    "100%": (1.0, PAGE),
    "tokens": (1.0, 1),
}


@dataclass(frozen=True)
class BenchOptions:
    tokens: int
    row_kinds: tuple[str, ...]
    host_levels: tuple[str, ...]
    device_layouts: tuple[str, ...]
    repeats: int
    allocator_slots: int
    allocator_ops: int
    device: torch.device
    pin_measure_bytes: int = 8 << 30
    policy: PathPolicy = field(default_factory=PathPolicy)
    """kvcore's thresholds for every plan and the mover (the KVCORE_* settings in effect)."""


def options_for(args: argparse.Namespace) -> BenchOptions:
    device = _pick_device(args.device)
    quick = args.quick
    return BenchOptions(
        tokens=args.tokens or (16384 if quick else 131072),
        row_kinds=_choice(args.rows, ROW_KINDS, ("mla-1152B", "mha-4KiB") if quick else None),
        host_levels=_choice(
            args.host_levels, HOST_FRAGMENTATION, ("0%", "50%", "100%") if quick else None
        ),
        device_layouts=("contiguous", "scattered"),
        repeats=3 if quick else 5,
        allocator_slots=args.allocator_slots,
        allocator_ops=args.allocator_ops,
        device=device,
        pin_measure_bytes=(1 if quick else 8) << 30,
        policy=policy_from_config(KVCoreConfig.from_env()),
    )


def _choice(
    asked: str | None, known: dict[str, Any], default: tuple[str, ...] | None
) -> tuple[str, ...]:
    if not asked:
        return default if default is not None else tuple(known)
    names = tuple(name.strip() for name in asked.split(","))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"kvcore bench: unknown {unknown}; choose from {', '.join(known)}")
    return names


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvcore bench: --device cuda asked for, but CUDA is not available")
    return torch.device(name)


def scattered_layout(
    rows: int, fragmentation: float, unit: int, generator: torch.Generator
) -> torch.Tensor:
    """Slot ids for ``rows`` rows in a pool twice that size.

    ``fragmentation`` of the ``unit``-row chunks are moved to random places beyond
    the first run; the rest stay where a fresh pool would put them.
    """
    chunks = rows // unit
    moved = round(chunks * fragmentation)
    chunk_slots = torch.arange(chunks, dtype=torch.int64)
    if moved:
        which = torch.randperm(chunks, generator=generator)[:moved]
        elsewhere = torch.randperm(chunks, generator=generator)[:moved] + chunks
        chunk_slots[which] = elsewhere
    return (chunk_slots[:, None] * unit + torch.arange(unit)).flatten()


# About 10 ms of a spin kernel on an H200 (~2 GHz), longer than any submission measured.
_SUBMIT_COVER_CYCLES = 20_000_000


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median device seconds and median host seconds to issue ``fn``."""
    device_times, host_times = _timed_repeats(fn, device, repeats)
    return statistics.median(device_times), statistics.median(host_times)


def _timed_repeats(
    fn: Callable[[], object], device: torch.device, repeats: int
) -> tuple[list[float], list[float]]:
    """Device seconds and host seconds to issue ``fn``, one of each per repeat."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    device_times: list[float] = []
    host_times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the host submits, as an engine queuing layer after
            # layer does: device time is then the copy's own, host time is reported apart.
            torch.cuda._sleep(_SUBMIT_COVER_CYCLES)
            start.record()
            t0 = time.perf_counter()
            fn()
            host_times.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            device_times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            host_times.append(elapsed)
            device_times.append(elapsed)
    return device_times, host_times


def queued_host_seconds(
    fn: Callable[[], object],
    device: torch.device,
    calls: int = 16,
    spin_cycles: int = _SUBMIT_COVER_CYCLES,
) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn`` issued one after another behind a
    spin kernel of ``spin_cycles``, as an engine issues layer after layer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda._sleep(spin_cycles)
    host_times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host_times


def _random_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random bytes (NaN patterns included), never zeros."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def _host_rows(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, Any]:
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    buffer = allocate_host_buffer(nbytes, pin=pin)
    return buffer.tensor.view(dtype).view(shape), buffer


@dataclass
class Scenario:
    name: str
    direction: Direction
    src: torch.Tensor
    dst: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    expected: torch.Tensor
    poison: torch.Tensor


def _scenarios(opts: BenchOptions, pin: bool) -> Iterator[Scenario]:
    generator = torch.Generator().manual_seed(1234)
    for kind in opts.row_kinds:
        row_shape, dtype = ROW_KINDS[kind]
        pool = 2 * opts.tokens
        host, host_buffer = _host_rows((pool, *row_shape), dtype, pin)
        try:
            host.copy_(_random_rows((pool, *row_shape), dtype, torch.device("cpu")))
            device_rows = _random_rows((pool, *row_shape), dtype, opts.device)
            for level in opts.host_levels:
                fragmentation, unit = HOST_FRAGMENTATION[level]
                host_idx = scattered_layout(opts.tokens, fragmentation, unit, generator)
                for layout in opts.device_layouts:
                    device_idx = scattered_layout(
                        opts.tokens, 0.0 if layout == "contiguous" else 1.0, PAGE, generator
                    )
                    for direction in Direction:
                        yield _scenario(
                            f"{kind}/{direction.value}/host-{level}/device-{layout}",
                            direction,
                            host,
                            host_idx,
                            device_rows,
                            device_idx,
                        )
        finally:
            # Copies still queued read the host rows: finish them before unpinning.
            if opts.device.type == "cuda":
                torch.cuda.synchronize(opts.device)
            host_buffer.close()


def _scenario(
    name: str,
    direction: Direction,
    host: torch.Tensor,
    host_idx: torch.Tensor,
    device_rows: torch.Tensor,
    device_idx: torch.Tensor,
) -> Scenario:
    if direction is Direction.H2D:
        src, dst, src_idx, dst_idx = host, device_rows, host_idx, device_idx
    else:
        src, dst, src_idx, dst_idx = device_rows, host, device_idx, host_idx
    expected = dst.clone()
    expected[dst_idx.to(dst.device)] = src[src_idx.to(src.device)].to(dst.device)
    return Scenario(name, direction, src, dst, src_idx, dst_idx, expected, dst.clone())


def _identical(dst: torch.Tensor, expected: torch.Tensor) -> bool:
    a, b = as_row_words(dst), as_row_words(expected)
    if a is None or b is None:
        return False
    return bool(torch.equal(a, b))


def _result(
    scenario: str,
    path: str,
    nbytes: int,
    seconds: float,
    host_seconds: float,
    identical: bool,
    ceiling: float,
    kind: str,
) -> dict[str, Any]:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return {
        "scenario": scenario,
        "path": path,
        "bytes": nbytes,
        "gbps": gbps,
        "identical": identical,
        "kind": kind,
        "share_of_ceiling": gbps / ceiling if ceiling else 0.0,
        "submit_us": host_seconds * 1e6,
    }


def _ceiling(sc: Scenario, nbytes: int, opts: BenchOptions) -> list[float]:
    """GB/s of a plain contiguous copy of ``nbytes``, one figure per repeat."""
    flat_src = sc.src.reshape(-1).view(torch.uint8)[:nbytes]
    flat_dst = sc.dst.reshape(-1).view(torch.uint8)[:nbytes]
    seconds, _ = _timed_repeats(
        lambda: flat_dst.copy_(flat_src, non_blocking=True), opts.device, opts.repeats
    )
    return [nbytes / s / 1e9 for s in seconds]


def _stock_paths(sc: Scenario) -> dict[str, Callable[[], None]]:
    src_idx = sc.src_idx.to(sc.src.device)
    dst_idx = sc.dst_idx.to(sc.dst.device)

    def advanced_indexing() -> None:
        sc.dst[dst_idx] = sc.src[src_idx].to(sc.dst.device, non_blocking=True)

    def per_page_copy() -> None:
        for start in range(0, sc.src_idx.numel(), PAGE):
            s, d = sc.src_idx[start : start + PAGE], sc.dst_idx[start : start + PAGE]
            sc.dst[int(d[0]) : int(d[0]) + PAGE].copy_(
                sc.src[int(s[0]) : int(s[0]) + PAGE], non_blocking=True
            )

    paths: dict[str, Callable[[], None]] = {"stock:advanced_indexing": advanced_indexing}
    # One copy per page is only correct where every page is one run on both sides.
    if (
        sc.src_idx.numel() % PAGE == 0
        and _pages_are_runs(sc.src_idx)
        and _pages_are_runs(sc.dst_idx)
    ):
        paths["stock:per_page_copy"] = per_page_copy
    return paths


def _pages_are_runs(index: torch.Tensor) -> bool:
    pages = index.view(-1, PAGE)
    return bool(torch.equal(pages - pages[:, :1], torch.arange(PAGE).expand_as(pages)))


@dataclass(frozen=True)
class TransferReport:
    ceiling_gbps: float
    results: list[dict[str, Any]]
    page_out_host_syncs: int | None
    """Synchronising calls over every auto-chosen page-out path (None where not countable)."""


def run_transfers(opts: BenchOptions, progress: bool = True) -> TransferReport:
    # A stream of our own, as the engines copy on: the batched copy API refuses the
    # legacy default stream.
    if opts.device.type == "cuda":
        with torch.cuda.stream(torch.cuda.Stream(opts.device)):
            return _run_transfers(opts, progress)
    return _run_transfers(opts, progress)


def _run_transfers(opts: BenchOptions, progress: bool) -> TransferReport:
    mover = Mover(opts.policy)
    policy = opts.policy
    pin = opts.device.type == "cuda"
    results: list[dict[str, Any]] = []
    page_out_syncs: list[int | None] = []
    ceilings: list[float] = []
    total = len(opts.row_kinds) * len(opts.host_levels) * len(opts.device_layouts) * len(Direction)
    bar = tqdm(
        total=total, desc="kvcore bench", unit="scenario", disable=not progress, file=sys.stderr
    )
    for sc in _scenarios(opts, pin):
        plan_started = time.perf_counter()
        auto = plan(sc.src, sc.dst, sc.src_idx, sc.dst_idx, direction=sc.direction, policy=policy)
        # Engines plan once per transfer and rebind the plan for every layer.
        plan_us = (time.perf_counter() - plan_started) * 1e6
        # The first call pays for first-touch allocations that an engine's later
        # transfers do not: the same plan again is the steady state.
        warm_us = []
        for _ in range(3):
            plan_started = time.perf_counter()
            plan(sc.src, sc.dst, sc.src_idx, sc.dst_idx, direction=sc.direction, policy=policy)
            warm_us.append((time.perf_counter() - plan_started) * 1e6)
        nbytes = auto.nbytes
        ceiling_repeats = _ceiling(sc, nbytes, opts)
        ceiling = statistics.median(ceiling_repeats)
        ceilings.append(ceiling)
        ceiling_result = _result(
            sc.name,
            "ceiling:contiguous_copy",
            nbytes,
            nbytes / ceiling / 1e9,
            0.0,
            True,
            ceiling,
            "ceiling",
        )
        # The spread of the ceiling's own repeats: how far any share of it can be trusted.
        ceiling_result["repeats_gbps"] = ceiling_repeats
        results.append(ceiling_result)
        candidates: list[tuple[str, str, Callable[[], None]]] = []
        for path in TransferPath:
            if path is TransferPath.FALLBACK:
                continue
            try:
                forced = plan(
                    sc.src,
                    sc.dst,
                    sc.src_idx,
                    sc.dst_idx,
                    direction=sc.direction,
                    force=path,
                    policy=policy,
                )
            except ValueError:
                continue
            label = f"kvcore:{path.value}" + (" (auto)" if path is auto.path else "")
            if path is auto.path and sc.direction is Direction.D2H:
                page_out_syncs.append(
                    count_host_syncs(functools.partial(mover.execute, forced), opts.device)
                )
            candidates.append((label, "kvcore", functools.partial(mover.execute, forced)))
        candidates += [(name, "stock", fn) for name, fn in _stock_paths(sc).items()]
        first_result = len(results)
        for label, kind, fn in candidates:
            sc.dst.copy_(sc.poison)
            # The naive baselines are slow by two orders of magnitude: fewer repeats suffice.
            repeats = opts.repeats if kind == "kvcore" else 2
            seconds, host_seconds = timed(fn, opts.device, repeats)
            if opts.device.type == "cuda":
                torch.cuda.synchronize(opts.device)
            results.append(
                _result(
                    sc.name,
                    label,
                    nbytes,
                    seconds,
                    host_seconds,
                    _identical(sc.dst, sc.expected),
                    ceiling,
                    kind,
                )
            )
        for result, (_, _, fn) in zip(results[first_result:], candidates, strict=True):
            if result["path"].endswith("(auto)"):
                result["plan_us"] = plan_us
                result["plan_warm_us"] = statistics.median(warm_us)
                queued_us = [t * 1e6 for t in queued_host_seconds(fn, opts.device)]
                # The first call pays for the pause before it, as a lone transfer does.
                result["submit_queued_us"] = statistics.median(queued_us[1:])
                result["submit_queued_calls_us"] = queued_us
        bar.update()
    bar.close()
    results += _fallback_results(opts, mover)
    results += _duplex_results(opts, mover, statistics.median(ceilings))
    results += _layers_results(opts, mover, statistics.median(ceilings))
    syncs = [n for n in page_out_syncs if n is not None]
    return TransferReport(statistics.median(ceilings), results, sum(syncs) if syncs else None)


def _duplex_results(opts: BenchOptions, mover: Mover, ceiling: float) -> list[dict[str, Any]]:
    """A reload and a page-out at once, each on its own copy stream, timed together on the GPU."""
    rows, row_shape, dtype = opts.tokens, (2, 8, 128), torch.bfloat16
    pin = opts.device.type == "cuda"
    host_in, in_buffer = _host_rows((rows, *row_shape), dtype, pin)
    host_out, out_buffer = _host_rows((rows, *row_shape), dtype, pin)
    host_in.copy_(_random_rows((rows, *row_shape), dtype, torch.device("cpu")))
    device_in = _random_rows((rows, *row_shape), dtype, opts.device)
    device_out = _random_rows((rows, *row_shape), dtype, opts.device)
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
            torch.cuda._sleep(_SUBMIT_COVER_CYCLES)
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
    identical = _identical(device_in, host_in.to(opts.device)) and _identical(
        host_out, device_out.cpu()
    )
    nbytes = reload.nbytes + page_out.nbytes
    result = _result(
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


def _layers_results(opts: BenchOptions, mover: Mover, ceiling: float) -> list[dict[str, Any]]:
    """One transfer over 32 layers (``tokens`` rows in all, 4 KiB each, host half scattered
    by 16-row pages, device fully): one submission for every layer against a plan rebound
    and executed per layer, both directions, beside the same run's ceiling."""
    rows, row_shape, dtype = max(opts.tokens // _LAYERS, 16), (2, 8, 128), torch.bfloat16
    pin = opts.device.type == "cuda"
    host, host_buffer = _host_rows((_LAYERS, 2 * rows, *row_shape), dtype, pin)
    host.copy_(_random_rows(tuple(host.shape), dtype, torch.device("cpu")))
    device = _random_rows((_LAYERS, 2 * rows, *row_shape), dtype, opts.device)
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
                mover.execute_layers, first, pairs
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
                _result(
                    f"mha-4KiB/{direction.value}/{_LAYERS}-layers-host-50%/device-100%",
                    label,
                    first.nbytes * _LAYERS,
                    seconds,
                    host_seconds,
                    _identical(dst, expected),
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


def count_host_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """Synchronising CUDA calls that a warm ``fn`` makes, by torch's sync debugger (None on CPU).

    The first call is left out: it may allocate the staging buffer and the index ring once.
    """
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    # The debugger also warns that it is a prototype; only its per-call warnings count.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _fallback_results(opts: BenchOptions, mover: Mover) -> list[dict[str, Any]]:
    """A strided host view: the planner must hand it to the stock path, still exact."""
    rows = min(opts.tokens, 4096)
    wide = _random_rows((rows, 2, 576), torch.bfloat16, torch.device("cpu"))
    src = wide[:, 0]
    dst = _random_rows((rows, 576), torch.bfloat16, opts.device)
    generator = torch.Generator().manual_seed(7)
    src_idx = torch.randperm(rows, generator=generator)
    dst_idx = torch.randperm(rows, generator=generator)
    expected = dst.clone()
    expected[dst_idx.to(dst.device)] = src[src_idx].to(dst.device)
    fallback = plan(src, dst, src_idx, dst_idx, direction=Direction.H2D, policy=mover.policy)
    seconds, host_seconds = timed(lambda: mover.execute(fallback), opts.device, 1)
    nbytes = fallback.nbytes
    return [
        _result(
            f"mla-1152B/strided-host-view ({fallback.reason})",
            f"kvcore:{fallback.path.value}",
            nbytes,
            seconds,
            host_seconds,
            _identical(dst, expected),
            0.0,
            "kvcore",
        )
    ]


def run_allocator(opts: BenchOptions) -> dict[str, dict[str, float]]:
    trace = make_trace(opts.allocator_slots, page_size=1, mixed_ops=opts.allocator_ops)
    out: dict[str, dict[str, float]] = {}
    outcomes = {}
    for name, allocator in (
        ("kvcore", ContiguousSlotAllocator(opts.allocator_slots)),
        ("stock", StockSlotAllocator(opts.allocator_slots)),
    ):
        result = replay(trace, allocator)
        outcomes[name] = result.outcomes
        out[name] = {
            "one_run_fraction": result.one_run_fraction,
            "ops_per_s": result.ops_per_s,
            "allocations": result.allocations,
            "operations": len(trace.ops),
            "slots": opts.allocator_slots,
        }
    out["same_outcomes"] = {"value": float(outcomes["kvcore"] == outcomes["stock"])}
    return out


def format_table(report: dict[str, Any], full: bool = False) -> str:
    """What `kvcore bench` prints: the summary first, every row only when ``full``, the
    legend last."""
    tokens = report.get("tokens")
    lines = [
        f"kvcore bench on {report['device']}"
        + (f", {tokens} rows per transfer" if tokens else "")
        + f"; median ceiling {report['ceiling_gbps']:.2f} GB/s",
        *bench_report.format_noise(report),
        "",
        *bench_report.format_summary(report),
        "",
        *bench_report.format_other_jobs(report),
    ]
    if full:
        lines += ["", *bench_report.format_full_table(report)]
    syncs = report["page_out_host_syncs"]
    pinning = report.get("pinning")
    if pinning is not None:
        lines.append("")
        lines.append(
            f"pinning {pinning['gib']:.0f} GiB (pre-fault + cudaHostRegister): "
            f"{pinning['pin_s_per_gib']:.3f} s/GiB, "
            f"release {pinning['release_s_per_gib']:.3f} s/GiB"
        )
    lines.append("")
    lines.append(
        "host synchronisations on the page-out paths: "
        + ("not countable on this device" if syncs is None else str(syncs))
    )
    alloc = report["allocator"]
    lines.append("")
    slots = alloc["kvcore"].get("slots", 1 << 20)
    lines.append(
        f"allocator churn ({alloc['kvcore']['operations']:.0f} ops, {slots:,.0f} slots, "
        "<= 90% full):"
    )
    for name in ("kvcore", "stock"):
        a = alloc[name]
        lines.append(
            f"  {name:<7} one-run share {a['one_run_fraction']:.3f}   {a['ops_per_s']:,.0f} ops/s"
        )
    lines.append(f"  same success/failure sequence: {bool(alloc['same_outcomes']['value'])}")
    lines += ["", *bench_report.format_legend(report, full)]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> bool:
    """A chart of every row kind and direction (False where matplotlib is missing)."""
    try:
        from kvcore.bench import plot as bench_plot
    except ImportError:
        return False
    bench_plot.write(report, path)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument(
        "--full", action="store_true", help="print every path of every scenario after the summary"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a chart, one panel per row kind and direction (needs matplotlib)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokens", type=int, default=0, help="rows per transfer")
    parser.add_argument("--rows", help=f"comma list of row kinds: {', '.join(ROW_KINDS)}")
    # argparse expands % in help strings: the levels' own % signs are doubled.
    levels = ", ".join(HOST_FRAGMENTATION).replace("%", "%%")
    parser.add_argument("--host-levels", help=f"comma list of host layouts: {levels}")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--allocator-slots", type=int, default=1 << 20, help="slots of the allocator churn's pool"
    )
    parser.add_argument(
        "--allocator-ops",
        type=int,
        default=10_000,
        help="mixed operations of the allocator churn, after its fill",
    )
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="print (and with --plot, chart) a report saved by --json instead of measuring",
    )


def measure_pinning(nbytes: int) -> dict[str, float] | None:
    """Seconds per GiB to make (pre-fault and register) and to release pinned host memory."""
    if not torch.cuda.is_available():
        return None
    started = time.perf_counter()
    buffer = allocate_host_buffer(nbytes, pin=True)
    pinned = time.perf_counter()
    buffer.close()
    released = time.perf_counter()
    gib = nbytes / 2**30
    return {
        "gib": gib,
        "pin_s_per_gib": (pinned - started) / gib,
        "release_s_per_gib": (released - pinned) / gib,
    }


def run(opts: BenchOptions, progress: bool = True) -> dict[str, Any]:
    transfers = run_transfers(opts, progress)
    pinning = measure_pinning(opts.pin_measure_bytes) if opts.device.type == "cuda" else None
    name = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "cpu"
    report = {
        "device": name,
        "ceiling_gbps": transfers.ceiling_gbps,
        "page_out_host_syncs": transfers.page_out_host_syncs,
        "pinning": pinning,
        "tokens": opts.tokens,
        "policy": dataclasses.asdict(opts.policy),
        "torch": torch.__version__,
        "results": transfers.results,
        "allocator": run_allocator(opts),
    }
    report["summary"] = bench_report.summarize(report)
    report["noise"] = bench_report.noise(report)
    return report


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        with open(args.from_json) as fh:
            report = json.load(fh)
    else:
        report = run(options_for(args), progress=not args.no_progress)
    print(format_table(report, full=args.full))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    if args.plot and not write_plot(report, args.plot):
        print("kvcore bench: matplotlib is not installed; no plot written", file=sys.stderr)
    bad = [r for r in report["results"] if not r["identical"]]
    return 1 if bad else 0
