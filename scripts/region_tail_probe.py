"""Where a staged vLLM load spends its time beyond the link: one load job at a time through
kvcore's handler, under torch's profiler, each request's host steps and GPU work laid on one
clock. Per request it reports, in ms from the first submission: when the submission
returned, when the first and last DMA ran, when the last scatter ended and when the wait
returned, and the DMAs' own GB/s. ``PIECE_CAP_MIB`` and ``RING_SLOTS`` set region staging's
ring as ``scripts/ring_pieces.py`` does.

    python3 scripts/region_tail_probe.py [--rows mla] [--sizes 8192,32768] [--requests 4]
        [--compute none,prefill-4096] [--json out.json] [--trace-dir DIR]

Measuring code only; needs CUDA and vLLM (the bench's own set-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.model_forward import COMPUTE_LOADS, measured_forward
from benchmarks.vllm.beside import LAYOUTS
from benchmarks.vllm.offload_handlers import stock_handler
from benchmarks.vllm.sweep import host_region, request_through
from benchmarks.vllm.sweep_plan import BLOCK_TOKENS
from benchmarks.vllm.sweep_pools import Pools, RequestDrawer, slice_blocks
from benchmarks.vllm.sweep_sides import kvcore_side
from kvcore import region_staging
from kvcore.region_staging import RegionStaging

LINK_GBPS = 55.3
_GPU_KINDS = ("kernel", "gpu_memcpy")


def _annotated(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so each call is a profiler range named ``label``."""
    inner = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapped)


@contextlib.contextmanager
def _staging_annotated() -> Iterator[None]:
    original = RegionStaging.stage_in

    def stage_in(self: RegionStaging, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function("stage_in"):
            return original(self, *args, **kwargs)

    RegionStaging.stage_in = stage_in  # type: ignore[method-assign]
    try:
        yield
    finally:
        RegionStaging.stage_in = original  # type: ignore[method-assign]


def timelines(trace: dict[str, Any], link_ms: float) -> list[dict[str, float]]:
    """Each ``request-*`` range's steps, in ms from its start."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = sorted(
        (e for e in events if str(e.get("name", "")).startswith("request-")),
        key=lambda e: e["ts"],
    )
    rows = []
    for request in ranges:
        begin, end = request["ts"], request["ts"] + request["dur"]

        def inside(e: dict[str, Any], begin: float = begin, end: float = end) -> bool:
            return begin <= e["ts"] <= end

        def ends(name: str, begin: float = begin) -> float:
            found = [e for e in events if e.get("name") == name and inside(e)]
            return (max(e["ts"] + e["dur"] for e in found) - begin) / 1e3 if found else -1.0

        memcpy = [e for e in events if e.get("cat") == "gpu_memcpy" and inside(e)]
        kernels = [e for e in events if e.get("cat") == "kernel" and inside(e)]
        row = {
            "wall_ms": request["dur"] / 1e3,
            "link_ms": link_ms,
            "submit_returned_ms": ends("submit"),
            "stage_in_returned_ms": ends("stage_in"),
            "wait_returned_ms": ends("wait"),
        }
        if memcpy:
            first = min(e["ts"] for e in memcpy)
            last = max(e["ts"] + e["dur"] for e in memcpy)
            busy = sum(e["dur"] for e in memcpy)
            moved = sum(float(e.get("args", {}).get("bytes", 0)) for e in memcpy)
            row |= {
                "first_dma_ms": (first - begin) / 1e3,
                "last_dma_end_ms": (last - begin) / 1e3,
                "dma_busy_ms": busy / 1e3,
                "dma_gbps": moved / busy / 1e3 if busy else 0.0,
                "dma_count": float(len(memcpy)),
            }
            after = [e for e in kernels if e["ts"] + e["dur"] > last]
            row["kernels_after_last_dma"] = float(len(after))
        if kernels:
            row["last_kernel_end_ms"] = (max(e["ts"] + e["dur"] for e in kernels) - begin) / 1e3
            row["kernel_count"] = float(len(kernels))
        rows.append(row)
    return rows


def _probe(
    layout_name: str, tokens: int, requests: int, compute: str, trace_dir: Path | None
) -> dict[str, Any]:
    device = torch.device("cuda")
    model = LAYOUTS[layout_name]
    blocks = slice_blocks(tokens // BLOCK_TOKENS)
    host = host_region(model.layout(blocks).host_row_bytes * blocks, device)
    try:
        generator = torch.Generator().manual_seed(7)
        pools = Pools(model.layout(blocks), host.tensor.view(torch.int8), device, generator)
        stock = stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=False)
        side = kvcore_side(stock, device)
        _annotated(side.handler, "transfer_async", "submit")
        _annotated(side.handler, "wait", "wait")
        drawer = RequestDrawer(blocks, np.random.default_rng(11))
        forward = None
        if compute != "none":
            forward = measured_forward(model.page, compute, model.layers, device)
            forward.size_for(tokens // BLOCK_TOKENS * model.block_bytes / LINK_GBPS / 1e6 * 1.5)
        next_id = 0
        link_ms = tokens // BLOCK_TOKENS * model.block_bytes / LINK_GBPS / 1e6

        def one(label: str | None) -> tuple[float, bool]:
            nonlocal next_id
            request = drawer.draw(tokens // BLOCK_TOKENS, 0.0, 1, gpu_to_cpu=False)
            ids = list(range(next_id, next_id + len(request.jobs)))
            next_id += len(ids)
            between: Callable[[], object] | None = (
                None if forward is None else (lambda: forward.replay())
            )
            scope = torch.profiler.record_function(label) if label else contextlib.nullcontext()
            with scope:
                wall, _, errors = request_through(side, pools, request, ids, between)
            torch.cuda.synchronize()
            return wall * 1e3, not errors

        with _staging_annotated():
            for _ in range(3):
                one(None)
            activities = [
                torch.profiler.ProfilerActivity.CPU,
                torch.profiler.ProfilerActivity.CUDA,
            ]
            with torch.profiler.profile(activities=activities) as prof:
                results = [one(f"request-{i}") for i in range(requests)]
            side.handler.shutdown()
        path = Path(trace_dir or ".") / f"trace-{layout_name}-{tokens}-{compute}.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if trace_dir is None:
            path.unlink()
        rows = timelines(trace, link_ms)
        return {
            "case": layout_name,
            "tokens": tokens,
            "compute": compute,
            "link_ms": link_ms,
            "ring_slots": region_staging.RING_SLOTS,
            "piece_cap_bytes": region_staging._MAX_PIECE_BYTES,
            "bench_wall_ms": [ms for ms, _ in results],
            "identical": all(ok for _, ok in results),
            "timelines": rows,
            "median": {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {},
        }
    finally:
        host.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="mla", choices=sorted(LAYOUTS))
    parser.add_argument("--sizes", default="8192,32768")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--compute", default="none,prefill-4096")
    parser.add_argument("--json")
    parser.add_argument("--trace-dir")
    args = parser.parse_args(argv)
    computes = args.compute.split(",")
    sizes = args.sizes.split(",")
    if (
        any(c != "none" and c not in COMPUTE_LOADS for c in computes)
        or not all(s.isdigit() and int(s) >= BLOCK_TOKENS for s in sizes)
        or args.requests < 1
    ):
        print(
            f"region_tail_probe: --compute from none,{','.join(COMPUTE_LOADS)}; --sizes "
            f"token counts of {BLOCK_TOKENS} or more; --requests 1 or more",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("region_tail_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    import ring_pieces  # beside this script: PIECE_CAP_MIB and RING_SLOTS, as it reads them

    region_staging._MAX_PIECE_BYTES = ring_pieces.piece_cap_bytes(dict(os.environ))
    region_staging.RING_SLOTS = ring_pieces.ring_slots(dict(os.environ))
    out = []
    for tokens in map(int, sizes):
        for compute in computes:
            trace_dir = Path(args.trace_dir) if args.trace_dir else None
            result = _probe(args.rows, tokens, args.requests, compute, trace_dir)
            out.append(result)
            med = result["median"]
            print(
                f"{args.rows} {tokens} {compute}: "
                + " ".join(f"{k}={v:.3f}" for k, v in med.items())
                + f" identical={result['identical']}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
