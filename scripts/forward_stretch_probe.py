"""Why does another batch's forward stretch by a whole copy's time beside a CPU-tier load?

    python3 scripts/forward_stretch_probe.py [--kind mha] [--load decode-64] [--layers 32]
        [--copy-mib 1024] [--repeats 5] [--extra-streams 0,40] [--stream-gaps 1,2,8,32]
        [--host pinned|registered] [--one-call] [--json F]

``benchmarks/vllm/beside.py`` saw its forward (``ForwardGraph``) take its own time plus the
load's beside every copy side, DMA included. This times that forward beside plain copies,
no engine, one thing changed at a time (ms, medians of ``--repeats`` after a warm-up):

- ``graph`` (the harness's replay) or ``eager`` (the same layers launched one by one): a
  stretch in graph only is replay's (H2). ``memset``, one cudaMemsetAsync in place of the
  forward, waiting out the copy says any memset in the forward does too (H5; the closing
  ``census`` counts the forward's memsets and memcpys);
- ``one-copy`` (one pinned host-to-device ``copy_``) or ``batched`` (the same bytes as 32 KiB
  pages to shuffled device pages, cudaMemcpyBatchAsync per layer): a stretch beside batched
  only is the many small copy commands' (H3); ``copy-first`` (the harness's order) or not;
  ``--one-call`` issues every layer's pages in one call, as vLLM's copy op takes a job, and
  ``--host registered`` copies from memory mapped and registered as the bench's CPU tier is
  (H6: what is left between the bench and this probe's default, per-layer calls from
  torch's pinned memory, which stretched no forward in docs/lab/benchmarks.md, session 41);
- streams: ``torch.cuda.Stream()`` deals torch's pool of 32 streams round-robin, so
  ``--extra-streams`` K only shifts both in the pool; the forward's stream is drawn G
  (``--stream-gaps``) after the copy's. torch created the pool interleaving its priorities
  (4 on Hopper, ``stream_priority_range``), so pool neighbours are 4 creations apart: if the
  driver deals its CUDA_DEVICE_MAX_CONNECTIONS queues round-robin by creation, G=2 shares
  one of 8, G=8 one of 8 or 32, and G=32 is the copy's own stream (``same_stream``: what a
  real serialisation looks like here). A stretch that follows G and the setting is H1.

The forward's window is start, a one-element kernel, head, the layers, end. ``forward_head_ms``
near the copy's time: its stream could not start a kernel until the copy ended, yet the start
event went through, so ``forward_ms`` counts a wait (H4); near 0 with ``forward_stretch_ms``
(beside less alone, same streams) near the copy's time: the layers waited or slowed once
started. ``span_ms`` (first start to last end, both streams) near the sum of both alone
times: the GPU ran them one after the other; near the larger: they overlapped.
``forward_host_ms`` near the copy's time: queuing the forward held the host. The layers last
about as long as the one-copy alone (``sized_to_copy_ms``), as the harness sizes them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_forward import COMPUTE_LOADS, ForwardGraph, measured_forward
from kvcore.bench.host_buffers import HostBuffer, allocate_host_buffer
from kvcore.kernels.batch_copy import (
    MAX_COPIES_PER_CALL,
    batch_copy_available,
    batch_copy_pointers,
)
from kvcore.kernels.cudart import loaded_cudart

PAGE_BYTES = 32 * 1024  # an MHA block of vLLM's sweep (16 tokens x 8 heads x 128 x K,V x bf16)
MEMSET_BYTES = 64 * 1024
MODES = ("graph", "eager", "memset")
COPIES = ("one-copy", "batched")
ORDERS = ("copy-first", "forward-first")
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


@dataclass(frozen=True)
class Cell:
    """A forward (``mode``), a copy, or both in ``order``, on streams drawn after
    ``extra`` others, the forward's ``gap`` draws after the copy's."""

    mode: str | None
    copy: str | None
    order: str | None
    extra: int
    gap: int

    @property
    def name(self) -> str:
        what = "+".join(part for part in (self.mode, self.copy) if part)
        return f"{what}{f'/{self.order}' if self.order else ''}/extra={self.extra}/gap={self.gap}"

    def parts(self) -> list[str]:
        """What is queued, in order."""
        if self.mode is None or self.copy is None:
            return ["copy" if self.mode is None else "forward"]
        return ["copy", "forward"] if self.order == "copy-first" else ["forward", "copy"]


def build_cells(
    extras: Iterable[int], gaps: Iterable[int], modes: Sequence[str] = MODES
) -> list[Cell]:
    """Per stream setup, the alone cells first: each pairing's stretch is read against them."""
    cells = []
    for extra in extras:
        for gap in gaps:
            cells += [Cell(None, copy, None, extra, gap) for copy in COPIES]
            cells += [Cell(mode, None, None, extra, gap) for mode in modes]
            for mode in modes:
                for copy in COPIES:
                    cells += [Cell(mode, copy, order, extra, gap) for order in ORDERS]
    return cells


def stretch(beside: float | None, alone: float | None) -> float | None:
    """How much longer beside than alone; None if either is missing."""
    return None if beside is None or alone is None else beside - alone


def span(windows: Iterable[tuple[float, float]]) -> float:
    """First start to last end of (start, end) windows on one clock."""
    starts, ends = zip(*windows, strict=True)
    return max(ends) - min(starts)


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


def page_runs(
    host_base: int, device_base: int, nbytes: int, layers: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(dsts, srcs, sizes) per layer: host pages in order to device pages in a shuffled
    order, as a load's blocks land wherever the engine had free blocks."""
    pages = nbytes // PAGE_BYTES
    if pages < 1:
        raise ValueError(f"{nbytes} bytes hold no {PAGE_BYTES}-byte page")
    order = np.random.default_rng(seed).permutation(pages).astype(np.uint64)
    dsts = np.uint64(device_base) + order * np.uint64(PAGE_BYTES)
    srcs = np.uint64(host_base) + np.arange(pages, dtype=np.uint64) * np.uint64(PAGE_BYTES)
    sizes = np.full(pages, PAGE_BYTES, dtype=np.uint64)
    # Indexing with an array copies: each layer's arrays are contiguous, as the driver reads.
    chunks = np.array_split(np.arange(pages), min(layers, pages))
    return [(dsts[chunk], srcs[chunk], sizes[chunk]) for chunk in chunks]


def one_call_runs(
    runs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every layer's (dsts, srcs, sizes) as one call's, in layer order."""
    dsts, srcs, sizes = (np.concatenate(parts) for parts in zip(*runs, strict=True))
    return [(dsts, srcs, sizes)]


def cuda_refusal() -> str | None:
    """Why this process cannot run the probe, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA build without a device warns; one line will do
        if torch.cuda.is_available():
            return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"no CUDA device visible to torch {torch.__version__}{hint}"


def _memset_call() -> Callable[[int, int, int], int] | None:
    # torch's zero_() is a fill kernel; cuBLAS and the driver's memsets go through here.
    lib = loaded_cudart()
    if lib is None:
        return None
    call = lib.cudaMemsetAsync
    call.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
    call.restype = ctypes.c_int
    return lambda pointer, nbytes, stream: int(call(pointer, 0, nbytes, stream))


class Window(NamedTuple):
    """One piece of queued work: its events and the host seconds queuing it took."""

    start: Any
    end: Any
    head: Any | None
    host_s: float


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class Rig:
    """The buffers, page runs and forward that every cell queues."""

    def __init__(
        self,
        fg: ForwardGraph,
        nbytes: int,
        layers: int,
        device: torch.device,
        host: str = "pinned",
        one_call: bool = False,
    ):
        self.fg = fg
        self.registered: HostBuffer | None = None
        if host == "registered":
            # As the vLLM bench's tier: mapped, faulted, then registered as one range.
            self.registered = allocate_host_buffer(nbytes, pin=True, register_chunk_bytes=nbytes)
            self.host = self.registered.tensor.view(torch.uint8)
        else:
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.runs = page_runs(self.host.data_ptr(), self.target.data_ptr(), nbytes, layers)
        # One call for every layer's pages (as vLLM's copy op takes a job), else a call a layer.
        self.max_per_call: int | None = MAX_COPIES_PER_CALL
        if one_call:
            self.runs = one_call_runs(self.runs)
            self.max_per_call = None
        self.marker = torch.zeros(1, device=device)
        self.scratch = torch.empty(MEMSET_BYTES, dtype=torch.uint8, device=device)
        self.memset = _memset_call()

    def copy(self, kind: str, stream: Any) -> Window:
        start, end = _event(), _event()
        began = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record()
            if kind == "one-copy":
                self.target.copy_(self.host, non_blocking=True)
            else:
                for dsts, srcs, sizes in self.runs:
                    # No stream writes the host pages: any read order, as vLLM's loads.
                    batch_copy_pointers(
                        dsts,
                        srcs,
                        sizes,
                        stream,
                        source_in_stream_order=False,
                        max_copies_per_call=self.max_per_call,
                    )
            end.record()
        return Window(start, end, None, time.perf_counter() - began)

    def forward(self, mode: str, stream: Any) -> Window:
        start, head, end = _event(), _event(), _event()
        began = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record()
            self.marker.add_(1)  # when this can run says whether the stream could start at all
            head.record()
            if mode == "graph":
                assert self.fg.graph is not None
                self.fg.graph.replay()
            elif mode == "eager":
                self.fg.model.queue(stream, count=self.fg.count)
            else:
                assert self.memset is not None
                if err := self.memset(self.scratch.data_ptr(), MEMSET_BYTES, stream.cuda_stream):
                    raise RuntimeError(f"cudaMemsetAsync failed with CUDA error {err}")
            end.record()
        return Window(start, end, head, time.perf_counter() - began)


def measure(cell: Cell, rig: Rig, streams: dict[str, Any], repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` runs of ``cell``, after one warm-up run."""
    samples: dict[str, list[float]] = {}
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        windows: dict[str, Window] = {}
        for part in cell.parts():
            what = cell.copy if part == "copy" else cell.mode
            assert what is not None
            windows[part] = (rig.copy if part == "copy" else rig.forward)(what, streams[part])
        torch.cuda.synchronize()
        if i == 0:
            continue
        first = windows[cell.parts()[0]].start
        offsets = [
            (first.elapsed_time(w.start), first.elapsed_time(w.end)) for w in windows.values()
        ]
        taken = {"span_ms": span(offsets)}
        for part, w in windows.items():
            taken[f"{part}_ms"] = w.start.elapsed_time(w.end)
            taken[f"{part}_host_ms"] = w.host_s * 1e3
            if w.head is not None:
                taken[f"{part}_head_ms"] = w.start.elapsed_time(w.head)
        for key, value in taken.items():
            samples.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in samples.items()}


def census(rig: Rig) -> dict[str, Any]:
    """GPU activities of one forward per mode, by kind: memsets and memcpys need an engine
    that a load may hold. Run last: a profiler can leave launches slower."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        counts: dict[str, Any] = {}
        for mode in ("graph", "eager"):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                rig.forward(mode, rig.fg.stream)
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
            kinds = {kind: sum(kind in n.lower() for n in names) for kind in ("memset", "memcpy")}
            counts[mode] = {"gpu_activities": len(names), **kinds}
        return counts
    except Exception as exc:  # the census is a hint; the cells stand without it
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}


def run(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> int:
    device = torch.device("cuda")
    connections = os.environ.get(CONNECTIONS, "unset")
    fg = measured_forward(args.kind, args.load, args.layers, device)
    rig = Rig(fg, args.copy_mib << 20, args.layers, device, args.host, args.one_call)
    once = torch.cuda.Stream(device)
    sized_to = measure(Cell(None, "one-copy", None, 0, 1), rig, {"copy": once}, 3)["copy_ms"]
    fg.size_for(sized_to)
    missing: dict[str, str] = {}
    if not batch_copy_available():
        missing["batched"] = "cudaMemcpyBatchAsync unavailable (cuda-bindings, CUDA >= 12.8)"
    if rig.memset is None:
        missing["memset"] = "no CUDA runtime loaded by torch to call cudaMemsetAsync"
    env: dict[str, Any] = {"device": torch.cuda.get_device_name(device), CONNECTIONS: connections}
    env.update(torch=torch.__version__, cuda=torch.version.cuda, kind=args.kind, load=args.load)
    env.update(layer_ms=fg.layer_ms, forward_layers=fg.count, sized_to_copy_ms=sized_to)
    env.update(copy_mib=args.copy_mib, page_calls=len(rig.runs), repeats=args.repeats)
    env.update(host=args.host, one_call=args.one_call)
    env["stream_priority_range"] = fg.stream.priority_range()
    emit({"env": {**env, "missing": missing}})
    rc = 0
    keep: list[Any] = []  # the extra streams live as long as the cells, as an engine's would
    alone: dict[tuple[int, int, str], float | None] = {}
    setups: dict[tuple[int, int], dict[str, Any]] = {}
    for cell in build_cells(args.extra_streams, args.stream_gaps):
        row: dict[str, Any] = {"cell": cell.name, "mode": cell.mode, "copy": cell.copy}
        row.update(order=cell.order, extra_streams=cell.extra, stream_gap=cell.gap)
        row[CONNECTIONS] = connections  # as this process saw it: a row read alone says it
        why = missing.get(cell.copy or "") or missing.get(cell.mode or "")
        if why:
            emit({**row, "skipped": why})
            continue
        setup = (cell.extra, cell.gap)
        if setup not in setups:
            keep += [torch.cuda.Stream(device) for _ in range(cell.extra)]
            copy_stream = torch.cuda.Stream(device)
            keep += [torch.cuda.Stream(device) for _ in range(cell.gap - 1)]
            setups[setup] = {"copy": copy_stream, "forward": torch.cuda.Stream(device)}
        streams = setups[setup]
        row.update(copy_stream_id=streams["copy"].stream_id)
        row.update(forward_stream_id=streams["forward"].stream_id)
        row["same_stream"] = streams["copy"].cuda_stream == streams["forward"].cuda_stream
        try:
            got = measure(cell, rig, streams, args.repeats)
        except RuntimeError as exc:  # BatchCopyError, a CUDA error: this cell says which
            emit({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
            rc = 1
            continue
        row.update(got)
        for part, what in (("forward", cell.mode), ("copy", cell.copy)):
            if what is not None and len(cell.parts()) == 1:
                alone[(cell.extra, cell.gap, what)] = got[f"{part}_ms"]
            elif what is not None:
                row[f"{part}_alone_ms"] = before = alone.get((cell.extra, cell.gap, what))
                row[f"{part}_stretch_ms"] = stretch(got[f"{part}_ms"], before)
        emit(row)
    emit({"census": census(rig)})
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--kind", choices=("mha", "mla"), default="mha")
    parser.add_argument("--load", choices=tuple(COMPUTE_LOADS), default="decode-64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--extra-streams", type=parse_ints, default=(0, 40))
    parser.add_argument("--stream-gaps", type=parse_ints, default=(1, 2, 8, 32))
    parser.add_argument(
        "--host",
        choices=("pinned", "registered"),
        default="pinned",
        help="the copy's host memory: torch's pinned allocation, or mapped and registered "
        "with cudaHostRegister as one range (as the vLLM bench's CPU tier)",
    )
    parser.add_argument(
        "--one-call",
        action="store_true",
        help="batched: every layer's pages in one cudaMemcpyBatchAsync, as vLLM's copy op "
        "takes a job (default: one call a layer, at most 256 copies each)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    positive = (args.layers, args.copy_mib, args.repeats, *args.stream_gaps)
    if not args.extra_streams or not args.stream_gaps or min(args.extra_streams) < 0:
        parser.error("--extra-streams needs values >= 0, --stream-gaps at least one value")
    if min(positive) < 1:
        parser.error("--layers, --copy-mib, --repeats and --stream-gaps must be positive")
    why = cuda_refusal()
    if why is not None:
        print(f"forward_stretch_probe: needs a CUDA device: {why}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # rewritten after every cell: a run cut short keeps what it measured
            doc = {"env": rows[0]["env"], "cells": [r for r in rows[1:] if "cell" in r]}
            doc["census"] = next((r["census"] for r in rows if "census" in r), None)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")

    return run(args, emit)


if __name__ == "__main__":
    sys.exit(main())
