"""Where the host time of one vLLM offload job goes, in kvcore's handler and in stock's.

    python scripts/vllm_host_profile.py [--page-kib 4] [--tensors 1] [--frag 0.5] [--load]
        [--own] [--job-mib 64] [--jobs 30] [--profile 25]

Needs vLLM importable and ``integrations`` on the path (on the GPU machine, carry
``.vllm-tree`` and ``OUT=... source scripts/vllm_device_env.sh`` first). Builds one job as the
A/B does (benchmarks.vllm.ab), runs it ``--jobs`` times through each handler, each job
waited for before the next, and prints the median host microseconds of
``transfer_async`` and of kvcore's steps in it (planning, the mover's submission,
the stream and event calls around it), then the top of a cProfile of kvcore's
``transfer_async``. ``--own`` turns off the rules that leave jobs to stock.
On a CPU the stock handler cannot run (it pins its descriptors); kvcore's is timed alone.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.script_env import need_vllm

need_vllm("vllm_host_profile")

from benchmarks.vllm.offload_handlers import (
    kvcore_handler,
    runnable_stock,
    stock_handler,
    through_handler,
)
from benchmarks.vllm.offload_layout import Layout, fragmented_ids, job_specs


def _timed_steps(handler: Any, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Wrap the handler's methods ``names`` so that each call's seconds are recorded."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        method: Callable[..., Any] = getattr(handler, name)

        def timed(
            *args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any
        ) -> Any:
            started = time.perf_counter()
            result = _method(*args, **kwargs)
            seconds[_name].append(time.perf_counter() - started)
            return result

        setattr(handler, name, timed)
    return seconds


def _run_jobs(handler: Any, specs: tuple[Any, Any], jobs: int) -> list[float]:
    """Seconds in ``transfer_async`` of ``jobs`` jobs, each waited for before the next."""
    submit: list[float] = []
    for _ in range(jobs):
        through_handler(handler, specs, submit)
    return submit


def _median_us(values: list[float], skip: int) -> str:
    kept = values[skip:] or values
    return f"{statistics.median(kept) * 1e6:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--frag", type=float, default=0.5)
    parser.add_argument("--job-mib", type=int, default=64, help="bytes a job moves, as the A/B")
    parser.add_argument("--load", action="store_true", help="host to GPU (default: page-out)")
    parser.add_argument("--own", action="store_true", help="kvcore's paths for every job")
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--profile", type=int, default=25, help="cProfile lines (0: none)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where present")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    page_bytes = args.page_kib << 10
    pages = max(16, min(4096, (args.job_mib << 20) // (page_bytes * args.tensors)))
    layout = Layout(
        page_bytes=page_bytes,
        tensors=args.tensors,
        gpu_blocks=5 * pages,
        cpu_chunks=5 * pages,
        shared_region=args.tensors > 1,
    )
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    gpu_to_cpu = not args.load
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
    kvcore = kvcore_handler(runnable_stock(stock, device), stock_rules=not args.own)
    specs = job_specs(
        fragmented_ids(pages, args.frag, rng) + 3,
        fragmented_ids(pages, args.frag, rng) + 5,
        gpu_to_cpu=gpu_to_cpu,
    )
    skip = min(5, args.jobs // 3)
    print(
        f"{device}: {pages} pages of {args.page_kib} KiB x {args.tensors} tensors, "
        f"{args.frag:.0%} fragmented, {'load' if args.load else 'page-out'}"
    )
    if device.type == "cuda":
        stock_submit = _run_jobs(runnable_stock(stock, device), specs, args.jobs)
        print(f"stock transfer_async: {_median_us(stock_submit, skip)} us")
    steps = _timed_steps(kvcore, ("_stock_is_cheaper", "_execute"))
    steps |= _timed_steps(kvcore._planner, ("plan",))
    # The job's queueing on kvcore's stream, its _execute included.
    steps |= _timed_steps(kvcore._jobs, ("submit",))
    submit = _run_jobs(kvcore, specs, args.jobs)
    print(
        f"kvcore transfer_async: {_median_us(submit, skip)} us; "
        + ", ".join(f"{name} {_median_us(v, skip)} us" for name, v in steps.items() if v)
    )
    if args.profile:
        profile = cProfile.Profile(time.perf_counter)
        for _ in range(args.jobs):
            profile.enable()
            kvcore.transfer_async(0, *specs)
            profile.disable()
            kvcore.wait({0})
            while not kvcore.get_finished():
                pass
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.profile)
            print(text.getvalue())
    kvcore.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
