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
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from kvcore.allocator import ContiguousSlotAllocator
from kvcore.bench import report as bench_report
from kvcore.bench.churn import make_trace, replay
from kvcore.bench.measure import (
    bytes_identical,
    count_host_syncs,
    host_rows,
    measure_pinning,
    queued_host_seconds,
    random_rows,
    result_row,
    scattered_layout,
    timed,
    timed_repeats,
)
from kvcore.bench.memory_budget import memory_problem
from kvcore.bench.other_jobs import duplex_results, fallback_results, layers_results
from kvcore.bench.stock_allocator import StockSlotAllocator
from kvcore.bench.suite_options import (
    HOST_FRAGMENTATION,
    PAGE,
    ROW_KINDS,
    BenchOptions,
    options_for,
)
from kvcore.direction import Direction
from kvcore.host_report import available_bytes
from kvcore.mover import Mover
from kvcore.planning.path_policy import TransferPath
from kvcore.planning.plans import plan


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
        host, host_buffer = host_rows((pool, *row_shape), dtype, pin)
        try:
            host.copy_(random_rows((pool, *row_shape), dtype, torch.device("cpu")))
            device_rows = random_rows((pool, *row_shape), dtype, opts.device)
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


def _ceiling(sc: Scenario, nbytes: int, opts: BenchOptions) -> list[float]:
    """GB/s of a plain contiguous copy of ``nbytes``, one figure per repeat."""
    flat_src = sc.src.reshape(-1).view(torch.uint8)[:nbytes]
    flat_dst = sc.dst.reshape(-1).view(torch.uint8)[:nbytes]
    seconds, _ = timed_repeats(
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
        ceiling_result = result_row(
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
                result_row(
                    sc.name,
                    label,
                    nbytes,
                    seconds,
                    host_seconds,
                    bytes_identical(sc.dst, sc.expected),
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
    results += fallback_results(opts, mover)
    results += duplex_results(opts, mover, statistics.median(ceilings))
    results += layers_results(opts, mover, statistics.median(ceilings))
    syncs = [n for n in page_out_syncs if n is not None]
    return TransferReport(statistics.median(ceilings), results, sum(syncs) if syncs else None)


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


class ReportError(ValueError):
    """A file given to ``--from-json`` is not a report ``--json`` wrote; the message says why."""


# What format_table reads of a report; reports older than these keys do not exist.
REPORT_KEYS = ("device", "ceiling_gbps", "page_out_host_syncs", "results", "allocator")


def load_report(path: str) -> dict[str, Any]:
    """The report ``--json`` saved at ``path``; ReportError names the file and the problem."""
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except OSError as exc:
        raise ReportError(f"--from-json {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ReportError(f"--from-json {path}: not JSON ({exc})") from None
    if not isinstance(report, dict):
        problem = f"it holds a JSON {type(report).__name__}, not an object"
    elif missing := [key for key in REPORT_KEYS if key not in report]:
        problem = f"it lacks {', '.join(missing)}"
    elif not isinstance(report["results"], list):
        problem = "its results are not a list"
    else:
        return report
    raise ReportError(
        f"--from-json {path}: not a report of kvcore bench --json ({problem}); give a file "
        "that kvcore bench --json wrote"
    )


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        try:
            report = load_report(args.from_json)
        except ReportError as exc:
            print(f"kvcore bench: {exc}", file=sys.stderr)
            return 2
    else:
        opts = options_for(args)
        rows = {
            kind: math.prod(ROW_KINDS[kind][0]) * ROW_KINDS[kind][1].itemsize
            for kind in opts.row_kinds
        }
        problem = memory_problem(opts.tokens, rows, opts.device.type, available_bytes(), PAGE)
        if problem is not None:
            print(f"kvcore bench: {problem}", file=sys.stderr)
            return 2
        report = run(opts, progress=not args.no_progress)
    print(format_table(report, full=args.full))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    if args.plot and not write_plot(report, args.plot):
        print("kvcore bench: matplotlib is not installed; no plot written", file=sys.stderr)
    bad = [r for r in report["results"] if not r["identical"]]
    return 1 if bad else 0
