"""`kvcore bench --engine sglang`: SGLang 0.5.23's stock HiCache transfers against kvcore's hooks.

One SGLang host pool and device pool per (pool kind, layout, page size), built the way
SGLang builds them. For each host fragmentation level the same index pairs go to
every path: the stock method, with the indices where SGLang's cache controller puts
them (``move_indices``); the kvcore AROUND hook, called as SGLang's ``HookRegistry``
calls it, with CPU indices and, on CUDA for the ``kernel`` backend, with the indices on
the GPU as that backend hands them (``kvcore:kernel-gpu-indices``); and a pinned
contiguous copy of the same bytes (the ceiling). Every result is compared byte for byte
with a copy computed from SGLang's layout definition, and rows outside the copy must keep
their poison.

Without sgl-kernel (its 373 MB wheel cannot be carried to the GPU machine) SGLang's
``direct`` backend and its AOT ``kernel`` ops are absent: those paths report ``not
runnable`` with the reason, and ``model:direct`` issues the copies ``direct`` would make
(one ``copy_`` per run or page) from Python instead. The JIT kernels
(``sglang.kernels.ops.kvcache.hicache``, compiled by nvcc through apache-tvm-ffi) serve
``kernel`` for ``layer_first`` and ``page_first`` on CUDA.

This module holds the run and its options; the pools are
:mod:`benchmarks.sglang.pool_case`, the byte checks :mod:`benchmarks.sglang.pool_rows`,
the paths :mod:`benchmarks.sglang.ab_paths`, their timing
:mod:`benchmarks.sglang.ab_measure`, the report :mod:`benchmarks.sglang.ab_report`, the
``sgl_kernel`` stand-in :mod:`benchmarks.sglang.sgl_kernel_stub` and the JIT builds
:mod:`benchmarks.sglang.jit_kernels`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.sglang.ab_measure import prefix_round_trip, run_case
from benchmarks.sglang.ab_paths import LOAD_LAYER
from benchmarks.sglang.ab_report import failures, format_table, speedups
from benchmarks.sglang.jit_kernels import on_stream, warm_jit
from benchmarks.sglang.pool_case import Options, pool_case
from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub
from kvcore.config import KVCoreConfig
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore_sglang.hook_mover import sglang_policy


def options_for(args: argparse.Namespace) -> Options:
    cuda = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu"
    quick = bool(getattr(args, "quick", False))
    default_tokens = (16384 if quick else 131072) if cuda else 1024
    return Options(
        tokens=getattr(args, "tokens", 0) or default_tokens,
        layers=2,
        device=torch.device("cuda" if cuda else "cpu"),
        repeats=3 if quick or not cuda else 5,
    )


@contextmanager
def bench_mover(*, serve_rule: bool = False) -> Iterator[Mover]:
    """The hooks' process-wide mover replaced by one with its own metrics, for the run.

    The A/B measures kvcore's own paths, so the serve-or-pass rule is off unless asked for.
    """
    from benchmarks.sglang.hook_adapter import using_mover

    mover = Mover(sglang_policy(KVCoreConfig.from_env()), metrics=Metrics())
    with using_mover(mover, rule=serve_rule):
        yield mover


def run(opts: Options, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    stub = install_sgl_kernel_stub()
    import sglang

    jit = warm_jit(opts)
    results: list[dict[str, Any]] = []
    prefix: list[dict[str, Any]] = []
    stream = torch.cuda.Stream(opts.device) if opts.device.type == "cuda" else None
    with bench_mover() as mover, on_stream(stream):
        for kind in opts.kinds:
            for layout in opts.layouts:
                for page_size in opts.page_sizes:
                    progress(f"-- {kind} {layout} page_size {page_size}")
                    try:
                        with pool_case(kind, layout, page_size, opts) as case:
                            results += run_case(case, mover, progress)
                            if opts.prefix and page_size == 64 and layout != "page_first_direct":
                                for level in ("0%", "100%"):
                                    prefix += prefix_round_trip(case, mover, level)
                    except Exception as exc:  # one pool SGLang cannot build here: say so, go on
                        why = f"pool not built: {type(exc).__name__}: {exc}".splitlines()[0]
                        progress(why)
                        results.append(
                            {
                                "pool": kind,
                                "layout": layout,
                                "page_size": page_size,
                                "op": "",
                                "path": "",
                                "not_runnable": why[:300],
                            }
                        )
    device = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "sglang": getattr(sglang, "__version__", "unknown"),
        "sgl_kernel": "stub (not installed)" if stub else "installed",
        "torch_dlpack_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "jit_modules": jit,
        "tokens": opts.tokens,
        "layers": opts.layers,
        "load_layer": LOAD_LAYER,
        "gather_ctas": mover.policy.gather_ctas,
        "gather_ctas_to_host": mover.policy.gather_ctas_to_host,
        "results": results,
        "prefix_reload": prefix,
    }


def main(args: argparse.Namespace) -> int:
    opts = options_for(args)
    quiet = bool(getattr(args, "no_progress", False))
    report = run(opts, progress=(lambda line: None) if quiet else _print_err)
    report["speedups"] = speedups(report["results"])
    print(format_table(report))
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return 1 if failures(report) else 0


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["bench_mover", "main", "options_for", "run"]
