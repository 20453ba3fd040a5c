"""Where a staged vLLM load spends its time beyond the link: one load job at a time through
kvcore's handler, under torch's profiler, each request's host steps and GPU work laid on one
clock. Per request it reports, in ms from the first submission: when the submission
returned, when the first and last DMA ran, when the last scatter ended and when the wait
returned, and the DMAs' own GB/s. The profiler slows the host several times over, so
``--events`` times the ring with CUDA events instead: each piece's DMA, the gaps between
DMAs, whether a DMA began as soon as the host issued it, the host's time inside the
ring's DMA and scatter calls, and the last scatter's end; then one submission's host work
is profiled up to its first DMA, and one more whole (``prefix_profile``,
``submission_profile``).
``PIECE_CAP_MIB`` and ``RING_SLOTS`` set region staging's ring as ``scripts/ring_pieces.py``
does; ``KVCORE_ADDRESS_RING`` picks the ring by address or torch's.

    python3 scripts/region_tail_probe.py [--rows mla] [--sizes 8192,32768] [--requests 4]
        [--compute none,prefill-4096] [--events] [--json out.json]
        [--trace-dir DIR]

Measuring code only; needs CUDA and vLLM (the bench's own set-up).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The measuring code is in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.script_env import need_vllm

need_vllm("region_tail_probe")

from benchmarks.beside_rows import LINK_GBPS
from benchmarks.model_forward import COMPUTE_LOADS, measured_forward
from benchmarks.vllm.beside import LAYOUTS
from benchmarks.vllm.offload_handlers import stock_handler
from benchmarks.vllm.sweep import host_region, request_through
from benchmarks.vllm.sweep_plan import BLOCK_TOKENS
from benchmarks.vllm.sweep_pools import Pools, RequestDrawer, slice_blocks
from benchmarks.vllm.sweep_sides import kvcore_side
from kvcore import region_staging
from kvcore.kernels.overlap_ring import AddressRing, SlotRing
from kvcore.region_staging import RegionLoad, RegionStaging


@contextlib.contextmanager
def _annotated(owner: Any, name: str, label: str) -> Iterator[None]:
    """``owner.name`` wrapped so each call is a profiler range named ``label``, put back after."""
    inner = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, inner)


class RingClock:
    """CUDA events around each ring piece's DMA and scatter and at each submission's start,
    with the host's clock beside them: the profiler's own host cost left out."""

    def __init__(self) -> None:
        self.start: torch.cuda.Event | None = None
        self.host_start = 0.0
        self.fills: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self.drains: list[torch.cuda.Event] = []
        self.host_returned = 0.0
        self.host_begun = 0.0
        self.host_in_dmas = self.host_in_scatters = 0.0
        """Host seconds spent issuing the DMAs (near their busy time where each copy holds
        the host until it is done, as one from memory the driver does not take for pinned)
        and the scatters (with their slot's events)."""
        self.profile_next = False
        """Profile the next submission's host work until its first DMA is issued."""
        self.prefix: cProfile.Profile | None = None
        self.profile_whole_next = False
        """Profile the next submission's host work until it returns."""
        self.whole: cProfile.Profile | None = None

    @staticmethod
    def _event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def begin(self) -> None:
        self.fills, self.drains = [], []
        self.host_in_dmas = self.host_in_scatters = 0.0
        self.host_start = time.perf_counter()
        self.start = self._event()
        if self.profile_next:
            self.profile_next = False
            self.prefix = cProfile.Profile()
            self.prefix.enable()
        elif self.profile_whole_next:
            self.profile_whole_next = False
            self.whole = cProfile.Profile()
            self.whole.enable()

    @staticmethod
    def top(profile: cProfile.Profile | None, count: int = 20) -> list[str]:
        """A profile's functions by their own time, most first."""
        if profile is None:
            return []
        stats: dict[Any, tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:count]
        return [f"{v[2] * 1e6:9.1f} us {v[1]:5d}x {k[0]}:{k[1]}({k[2]})" for k, v in ranked]

    @contextlib.contextmanager
    def installed(self, handler: Any) -> Iterator[None]:
        """The clock on ``handler``'s submissions and on every slot ring's pieces."""
        clock, submit = self, handler.transfer_async
        filling, draining = SlotRing.filling, SlotRing.draining
        fill, address_draining = AddressRing.fill, AddressRing.draining
        begin = RegionStaging.begin

        def timed_begin(staging: RegionStaging, *args: Any, **kwargs: Any) -> Any:
            clock.host_begun = time.perf_counter()
            return begin(staging, *args, **kwargs)

        def transfer_async(*args: Any, **kwargs: Any) -> Any:
            clock.begin()
            result = submit(*args, **kwargs)
            clock.host_returned = time.perf_counter()
            if clock.whole is not None:
                clock.whole.disable()
            return result

        @contextlib.contextmanager
        def timed_filling(ring: SlotRing, slot: int, reused: bool) -> Iterator[None]:
            if not clock.fills and clock.prefix is not None:
                clock.prefix.disable()
            entered = time.perf_counter()
            with filling(ring, slot, reused):
                issued, began = time.perf_counter(), clock._event()
                yield
                clock.fills.append((began, clock._event(), issued))
            clock.host_in_dmas += time.perf_counter() - entered

        def timed_fill(ring: AddressRing, slot: int, reused: bool, copies: Any) -> None:
            # The slot's wait first, so that the events time the copies alone.
            if not clock.fills and clock.prefix is not None:
                clock.prefix.disable()
            entered = time.perf_counter()
            lanes = ring._lanes
            if reused:
                lanes.calls.wait(lanes.dma_handle, lanes.freed[slot])
            issued, began = time.perf_counter(), clock._event(lanes.dma)
            fill(ring, slot, False, copies)
            clock.fills.append((began, clock._event(lanes.dma), issued))
            clock.host_in_dmas += time.perf_counter() - entered

        def timed_draining(
            original: Callable[..., Any],
        ) -> Callable[[Any, int, bool], contextlib.AbstractContextManager[None]]:
            @contextlib.contextmanager
            def timed(ring: Any, slot: int, refilled: bool) -> Iterator[None]:
                issued = time.perf_counter()
                with original(ring, slot, refilled):
                    yield
                    clock.drains.append(clock._event())
                clock.host_in_scatters += time.perf_counter() - issued

            return timed

        handler.transfer_async = transfer_async
        RegionStaging.begin = timed_begin  # type: ignore[method-assign,assignment]
        SlotRing.filling = timed_filling  # type: ignore[method-assign,assignment]
        SlotRing.draining = timed_draining(draining)  # type: ignore[method-assign,assignment]
        AddressRing.fill = timed_fill  # type: ignore[method-assign,assignment]
        AddressRing.draining = timed_draining(address_draining)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            SlotRing.filling, SlotRing.draining = filling, draining  # type: ignore[method-assign]
            AddressRing.fill, AddressRing.draining = fill, address_draining  # type: ignore[method-assign]
            RegionStaging.begin = begin  # type: ignore[method-assign]
            handler.transfer_async = submit

    def steps(self) -> dict[str, float]:
        """The last request's steps in ms from its submission (call once it is synchronised)."""
        start = self.start
        if start is None or not self.fills:
            return {}

        def at(event: torch.cuda.Event) -> float:
            return float(start.elapsed_time(event))

        began = [at(b) for b, _, _ in self.fills]
        ended = [at(e) for _, e, _ in self.fills]
        gaps = [b - e for b, e in zip(began[1:], ended[:-1], strict=True)]
        host_late = [
            b - (issued - self.host_start) * 1e3
            for b, (_, _, issued) in zip(began, self.fills, strict=True)
        ]
        return {
            "pieces": float(len(began)),
            "first_dma_ms": began[0],
            "host_load_begun_ms": (self.host_begun - self.host_start) * 1e3,
            "host_first_dma_issued_ms": (self.fills[0][2] - self.host_start) * 1e3,
            "host_last_dma_issued_ms": (self.fills[-1][2] - self.host_start) * 1e3,
            "submit_returned_ms": (self.host_returned - self.host_start) * 1e3,
            "dma_busy_ms": sum(e - b for b, e in zip(began, ended, strict=True)),
            "host_in_dmas_ms": self.host_in_dmas * 1e3,
            "host_in_scatters_ms": self.host_in_scatters * 1e3,
            "dma_gaps_ms": sum(gaps),
            "widest_gap_ms": max(gaps, default=0.0),
            "gaps_dma_ran_at_issue": float(sum(1 for late in host_late[1:] if late < 0.05)),
            "last_dma_end_ms": ended[-1],
            "last_scatter_end_ms": at(self.drains[-1]) if self.drains else -1.0,
        }


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
            "scatters_returned_ms": ends("scatters"),
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
    layout_name: str,
    tokens: int,
    requests: int,
    compute: str,
    trace_dir: Path | None,
    events: bool,
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
        drawer = RequestDrawer(blocks, np.random.default_rng(11))
        link_ms = tokens // BLOCK_TOKENS * model.block_bytes / LINK_GBPS / 1e6
        forward = None
        if compute != "none":
            forward = measured_forward(model.page, compute, model.layers, device)
            forward.size_for(link_ms * 1.5)
        next_id = 0

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

        if events:
            clock = RingClock()
            with clock.installed(side.handler):
                for _ in range(3):
                    one(None)
                results, rows = [], []
                for _ in range(requests):
                    results.append(one(None))
                    rows.append({"wall_ms": results[-1][0], "link_ms": link_ms} | clock.steps())
                # One more, its host work profiled up to its first DMA, and not timed.
                clock.profile_next = True
                one(None)
                # And one more, its whole submission profiled.
                clock.profile_whole_next = True
                one(None)
            side.handler.shutdown()
            prefix, whole = clock.top(clock.prefix), clock.top(clock.whole, 30)
        else:
            prefix, whole = [], []
            with (
                _annotated(side.handler, "transfer_async", "submit"),
                _annotated(side.handler, "wait", "wait"),
                _annotated(RegionLoad, "finish", "scatters"),
            ):
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
            "events": events,
            "prefix_profile": prefix,
            "submission_profile": whole,
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
    parser.add_argument(
        "--events",
        action="store_true",
        help="CUDA events around each ring piece in place of the profiler (no host slowdown)",
    )
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

    ring_pieces.apply(dict(os.environ))
    out = []
    for tokens in map(int, sizes):
        for compute in computes:
            trace_dir = Path(args.trace_dir) if args.trace_dir else None
            result = _probe(args.rows, tokens, args.requests, compute, trace_dir, args.events)
            out.append(result)
            med = result["median"]
            print(
                f"{args.rows} {tokens} {compute}: "
                + " ".join(f"{k}={v:.3f}" for k, v in med.items())
                + f" identical={result['identical']}",
                flush=True,
            )
            for name in ("prefix_profile", "submission_profile"):
                print(f"  {name}:")
                for line in result[name]:
                    print("   ", line)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
