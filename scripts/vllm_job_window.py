"""What vLLM's reload counter sees of one load job, stock's handler against kvcore's.

    python scripts/vllm_job_window.py [--tokens 2048,4096] [--jobs 20] [--trace DIR]
        [--idle-ms 0] [--json FILE]

A live vLLM 0.25.1 engine with its CPU tier times each reload from an event recorded
before the job's copies to one after them (``kv_offload_load_time``). This script builds
the live run's layout (an 8B-shaped Llama: 32 per-layer KV tensors, 16-token blocks of
64 KiB, GPU blocks scattered, host chunks in one run as kvcore's manager hands them out),
runs ``--jobs`` load jobs of each size through each handler, each with new block ids and
waited for before the next, and reports per handler the medians of that event window, of
the job's wall-clock (from ``transfer_async`` until it is collected), of the host time in
``transfer_async``, and the window over the link-bound time (bytes at 55 GB/s).
kvcore's paths and stock passes are counted. ``--idle-ms`` leaves the GPU idle that long
before each job, as the gaps between a sequential trace's requests do (the clocks may
drop in them). ``--trace DIR`` also writes a torch profiler
trace of three jobs of the first size per handler, and prints each job's device activity
against its host calls. Needs vLLM importable and ``integrations`` on the path.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.script_env import need_vllm

need_vllm("vllm_job_window")

from benchmarks.vllm.offload_handlers import (
    kvcore_handler,
    runnable_stock,
    stock_handler,
    submit_and_collect,
)
from benchmarks.vllm.offload_layout import Layout, job_specs
from kvcore.bench.measure import sync_device

LINK_BYTES_PER_S = 55e9


def _job_ids(
    tokens: int, block_tokens: int, layout: Layout, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Scattered GPU blocks, as a busy engine's free queue gives them; one host run."""
    pages = -(-tokens // block_tokens)
    gpu = rng.choice(layout.gpu_blocks, size=pages, replace=False)
    start = int(rng.integers(0, layout.cpu_chunks - pages + 1))
    return gpu.astype(np.int64), np.arange(start, start + pages, dtype=np.int64)


def _run(handler: Any, specs: tuple[Any, Any], job_id: int) -> tuple[float, float, float | None]:
    """(wall seconds, host seconds in transfer_async, event-window seconds) of one job,
    driven as vLLM's worker drives it (:func:`submit_and_collect`)."""
    host: list[float] = []
    started = time.perf_counter()
    results = submit_and_collect(handler, [(job_id, specs)], host)
    return time.perf_counter() - started, host[0], results[0].transfer_time


def _poisoned(gpu: list[torch.Tensor], gpu_ids: np.ndarray) -> None:
    """The job's destination pages overwritten, so that each handler's copy is seen."""
    rows = torch.from_numpy(gpu_ids).to(gpu[0].device)
    for tensor in gpu:
        tensor[rows] = -1
    sync_device(gpu[0].device)


def _copied(gpu: list[torch.Tensor], host: list[torch.Tensor], ids: tuple[np.ndarray, ...]) -> bool:
    """Every tensor's destination pages equal their host pages."""
    gpu_rows = torch.from_numpy(ids[0]).to(gpu[0].device)
    host_rows = torch.from_numpy(ids[1])
    return all(torch.equal(g[gpu_rows].cpu(), h[host_rows]) for g, h in zip(gpu, host, strict=True))


def _medians(runs: list[tuple[float, float, float | None]], nbytes: int) -> dict[str, Any]:
    walls, hosts, windows = zip(*runs, strict=True)
    timed = [w for w in windows if w is not None]
    link_s = nbytes / LINK_BYTES_PER_S
    window = statistics.median(timed) if timed else None
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "host_ms": statistics.median(hosts) * 1e3,
        "window_ms": None if window is None else window * 1e3,
        "window_over_link": None if window is None else window / link_s,
        "link_ms": link_s * 1e3,
    }


def _paths_taken(handler: Any) -> collections.Counter[str]:
    """Count the path of every submission kvcore's handler makes."""
    taken: collections.Counter[str] = collections.Counter()
    execute = handler._mover.execute

    def counted(plan: Any, pairs: Any = None, **kwargs: Any) -> None:
        taken[plan.path.value] += 1
        execute(plan, pairs, **kwargs)

    handler._mover.execute = counted
    return taken


def _trace(handlers: dict[str, Any], specs: list[tuple[Any, Any]], folder: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    for name, handler in handlers.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for job_id, each in enumerate(specs):
                _run(handler, each, 10_000 + job_id)
        prof.export_chrome_trace(str(folder / f"trace-{name}.json"))
        print(f"--- {name}")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=2560)
    parser.add_argument("--own", action="store_true", help="rules off: kvcore copies every job")
    parser.add_argument("--idle-ms", type=float, default=0.0, help="GPU idle before each job")
    parser.add_argument("--trace", type=Path, help="folder for profiler traces")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(t) for t in args.tokens.split(",")]
    pages = max(-(-t // args.block_tokens) for t in sizes)
    layout = Layout(
        page_bytes=args.page_kib << 10,
        tensors=args.tensors,
        gpu_blocks=max(args.gpu_blocks, pages),
        cpu_chunks=4 * pages,
        shared_region=True,
    )
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(0))
    stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=False), device)
    kvcore = kvcore_handler(
        runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=False), device),
        stock_rules=not args.own,
    )
    handlers = {"stock": stock, "kvcore": kvcore}
    taken = _paths_taken(kvcore)
    rng = np.random.default_rng(0)
    rows = []
    for tokens in sizes:
        nbytes = -(-tokens // args.block_tokens) * layout.page_bytes * layout.tensors
        runs: dict[str, list[tuple[float, float, float | None]]] = {n: [] for n in handlers}
        wrong = {name: 0 for name in handlers}
        taken.clear()
        for job_id in range(args.jobs):
            gpu_ids, cpu_ids = _job_ids(tokens, args.block_tokens, layout, rng)
            specs = job_specs(gpu_ids, cpu_ids, gpu_to_cpu=False)
            # Alternated job by job, so that both see the same machine.
            for name, handler in handlers.items():
                _poisoned(gpu, gpu_ids)
                time.sleep(args.idle_ms / 1e3)
                runs[name].append(_run(handler, specs, job_id))
                wrong[name] += not _copied(gpu, host, (gpu_ids, cpu_ids))
        row = {"tokens": tokens, "bytes": nbytes, "idle_ms": args.idle_ms}
        row["kvcore_paths"] = dict(taken)
        row["jobs_with_wrong_bytes"] = wrong
        row |= {name: _medians(r[len(r) // 5 :], nbytes) for name, r in runs.items()}
        row["kvcore_passes"] = dict(kvcore._passes)
        rows.append(row)
        print(json.dumps(row))
    if args.trace is not None:
        traced = job_specs(*_job_ids(sizes[0], args.block_tokens, layout, rng), gpu_to_cpu=False)
        _trace(handlers, [traced] * 3, args.trace)
    if args.json is not None:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
    kvcore.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
