"""`kvcore bench --engine sglang --sweep`: whole SGLang requests, stock against kvcore's hooks.

A request is what SGLang's transfer engine does for one prefix: a reload is one
``load_to_device_per_layer`` call per layer, back to back on the load stream; a backup is
one ``backup_from_device_all_layer`` call. Every request gets new index tensors (same
values for both sides, never the same tensor objects), so nothing planned for one request
serves the next. Each side is timed wall-clock from its first call until its copies are
complete, host and device together, with the calls' host time alone beside it; the two
sides alternate request by request in one process on the same pools. kvcore runs as
SGLang's ``HookRegistry`` calls an AROUND hook, with the stock method as ``original``, and
its serve-or-pass rule on (``--no-rule``: off, kvcore's own paths everywhere it can).

Pools are built the way SGLang builds them (:mod:`benchmarks.sglang.pool_case`), filled
with random bytes; after timing, each side's result is checked byte for byte against
SGLang's layout definition, rows outside the copy keeping their poison. Where stock's
``direct`` ops are absent (no sgl-kernel), the ``direct`` cells compare against the same
copies issued one ``copy_`` each from Python (``extra["stock"] == "model:direct"``), which
bounds stock's host time from above.

The options are in :mod:`benchmarks.sglang.sweep_options`, the sides of a request in
:mod:`benchmarks.sglang.sweep_sides`, one cell's timing and checks in
:mod:`benchmarks.sglang.sweep_cells`; this module runs every pool's cells and reports.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks import sweep_report
from benchmarks.gemm_share import gemm_summary
from benchmarks.sglang.ab import bench_mover
from benchmarks.sglang.jit_kernels import on_stream, warm_jit
from benchmarks.sglang.pool_case import Options, PoolCase, pool_case
from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub
from benchmarks.sglang.sweep_cells import measure_cell, sync_device
from benchmarks.sglang.sweep_options import SweepOptions, options_for
from benchmarks.sweep_report import SweepRow
from kvcore.metrics import Metrics


@contextmanager
def _pool(kind: str, layout: str, page: int, opts: SweepOptions) -> Iterator[PoolCase]:
    base = Options(
        tokens=max(opts.tokens),
        layers=opts.layer_count(kind),
        device=opts.device,
        repeats=opts.repeats,
        seed=opts.seed,
    )
    with pool_case(kind, layout, page, base) as case:
        yield case


def _pool_cells(
    case: PoolCase,
    backend: str,
    opts: SweepOptions,
    metrics: Metrics,
    progress: Callable[[str], None],
) -> Iterator[SweepRow | dict[str, Any]]:
    """Every cell of one pool: ops x host levels x request sizes."""
    for op in opts.ops:
        for level in opts.host_levels:
            for tokens in (t for t in opts.tokens if t % case.page_size == 0):
                try:
                    cell = measure_cell(case, op, backend, tokens, level, opts, metrics)
                except Exception as exc:  # one cell failing says why; the others still run
                    sync_device(opts.device)
                    where = f"{case.kind}/{case.layout}/{backend}/p{case.page_size}/{level}/{op}"
                    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    cell = {"case": where, "tokens": tokens, "not_runnable": why}
                if isinstance(cell, SweepRow):
                    progress(sweep_report.format_table([cell]).split("\n")[-1])
                else:
                    progress(f"{cell['case']} {tokens}: {cell['not_runnable']}")
                yield cell


def _one_pool(
    kind: str,
    layout: str,
    backend: str,
    page: int,
    opts: SweepOptions,
    mover: Any,
    progress: Callable[[str], None],
) -> tuple[list[SweepRow], list[dict[str, Any]]]:
    """Every cell of one pool; the pool (tens of GB on both sides) is gone on return."""
    rows: list[SweepRow] = []
    skipped: list[dict[str, Any]] = []
    try:
        with _pool(kind, layout, page, opts) as case:
            for cell in _pool_cells(case, backend, opts, mover.metrics, progress):
                if isinstance(cell, SweepRow):
                    rows.append(cell)
                else:
                    skipped.append(cell)
    except Exception as exc:  # a pool SGLang cannot build here: say so, go on
        why = f"pool not built: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        progress(why)
        skipped.append({"case": f"{kind}/{layout}/{backend}/p{page}", "not_runnable": why})
    finally:
        release_pools()
    return rows, skipped


def release_pools() -> None:
    """Drop what kvcore keeps of a pool's requests, then the memory itself."""
    from benchmarks.sglang.hook_adapter import bench_adapter

    adapter = bench_adapter()
    adapter.load_requests.clear()
    adapter.pool_layers.clear()
    adapter.bindings.restore()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(opts: SweepOptions, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    stub = install_sgl_kernel_stub()
    import sglang

    jit = warm_jit(Options(device=opts.device))
    rows: list[SweepRow] = []
    skipped: list[dict[str, Any]] = []
    stream = torch.cuda.Stream(opts.device) if opts.device.type == "cuda" else None
    with bench_mover(serve_rule=opts.serve_rule) as mover, on_stream(stream):
        assert mover.metrics is not None
        for kind, (layout, backend, pages) in itertools.product(opts.kinds, opts.layouts):
            for page in pages:
                progress(f"-- {kind} {layout} {backend} page {page}")
                pool_rows, pool_skipped = _one_pool(
                    kind, layout, backend, page, opts, mover, progress
                )
                rows += pool_rows
                skipped += pool_skipped
                if opts.partial_json:
                    partial = _result(opts, rows, skipped, sglang, stub, jit)
                    sweep_report.write_json(opts.partial_json, partial["document"])
    return _result(opts, rows, skipped, sglang, stub, jit)


def _result(
    opts: SweepOptions,
    rows: list[SweepRow],
    skipped: list[dict[str, Any]],
    sglang: Any,
    stub: bool,
    jit: dict[str, str],
) -> dict[str, Any]:
    device = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "cpu"
    return {
        "document": sweep_report.report(
            device,
            rows,
            engine="sglang",
            version=getattr(sglang, "__version__", "unknown"),
            torch=torch.__version__,
            sgl_kernel="stub (not installed)" if stub else "installed",
            jit_modules=jit,
            serve_rule=opts.serve_rule,
            repeats=opts.repeats,
            not_runnable=skipped,
        ),
        "rows": rows,
    }


def main(args: argparse.Namespace) -> int:
    opts = options_for(args)
    quiet = bool(getattr(args, "no_progress", False))
    result = run(opts, progress=(lambda line: None) if quiet else _print_err)
    rows: Sequence[SweepRow] = result["rows"]
    print(sweep_report.format_table(rows))
    print()
    print(sweep_report.LEGEND)
    print(sweep_report.summary(rows))
    for line in gemm_summary(rows):
        print(line)
    if getattr(args, "json", None):
        sweep_report.write_json(args.json, result["document"])
    if getattr(args, "plot", None):
        sweep_report.plot(rows, args.plot, title="SGLang: kvcore / stock, whole requests")
    return 1 if any(not row.identical for row in rows) else 0


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
