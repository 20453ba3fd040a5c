"""Issue 44's open question for vLLM's loads, asked before any product code: does a load
staged by whole chunks of vLLM's shared CPU region reach the link beside the model's
compute, where today's paths do not?

vLLM's CPU tier is one host region whose chunk holds every KV tensor's page of one block,
so one tensor's host rows lie a chunk apart and each block of each tensor is its own host
run. Today kvcore moves such a load by the layered UVA gather (MLA's 18 KiB blocks: 1.16-2.02x
the link beside compute, the other forward 1.04-1.19x its time alone) or by one DMA
descriptor a block and tensor (MHA's 32 KiB: 1.12-1.22x). Here the same load three ways,
on the same blocks, alone and beside another batch's forward (benchmarks/model_forward.py):

  gather  the mover's layered gather from the host region (the product path)
  dma     the mover's batched DMA straight into place, one descriptor a block and tensor
  staged  a request's chunks (one host run, as kvcore's allocator leaves them) in pieces of
          the staging size: each piece by one DMA into a device buffer, then its pages
          scattered to their tensors by one layered launch reading device memory

    python scripts/region_staging_probe.py [--kinds mla,mha] [--tokens 8192,32768]
        [--compute none,decode-64,prefill-4096] [--repeats 5] [--json FILE]

One line a cell; the JSON holds every request's times. Every way's first request in a cell
is byte-checked against the host rows. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINK_GBPS = 55.3
BLOCK_TOKENS = 16
WORD = torch.int64


@dataclass(frozen=True)
class RegionShape:
    """A model's CPU-tier chunk: ``tensors`` pages of ``page_bytes`` (a block of one KV tensor)."""

    tensors: int
    page_bytes: int
    forward_kind: str
    """The pool kind whose forward runs beside (benchmarks/model_forward.py)."""
    model_layers: int


SHAPES = {
    # DeepSeek-V3-shaped: 61 layers of one 576-wide bf16 row a token.
    "mla": RegionShape(tensors=61, page_bytes=18 << 10, forward_kind="mla", model_layers=61),
    # Llama-3-8B-shaped: 32 layers of a K and a V tensor, 8 heads x 128, bf16.
    "mha": RegionShape(tensors=64, page_bytes=32 << 10, forward_kind="mha", model_layers=32),
}


class Region:
    """The host region (``[chunks * tensors, page_words]``: chunk c's page of tensor t is
    row ``c * tensors + t``) and one device tensor per KV tensor."""

    def __init__(
        self, shape: RegionShape, chunks: int, gpu_blocks: int, device: torch.device
    ) -> None:
        words = shape.page_bytes // WORD.itemsize
        rows = chunks * shape.tensors
        self.host = torch.empty(rows, words, dtype=WORD, pin_memory=device.type == "cuda")
        # Random bytes drawn where they are cheapest: gigabytes on the GPU, then copied.
        gen = torch.Generator(device).manual_seed(44)
        step = max(1, (256 << 20) // shape.page_bytes)
        for begin in range(0, rows, step):
            end = min(begin + step, rows)
            drawn = torch.randint(
                -(2**62), 2**62, (end - begin, words), dtype=WORD, device=device, generator=gen
            )
            self.host[begin:end].copy_(drawn)
        self.gpus = [
            torch.empty(gpu_blocks, words, dtype=WORD, device=device) for _ in range(shape.tensors)
        ]
        self.shape = shape
        self.chunks = chunks

    def host_views(self) -> list[torch.Tensor]:
        """Each tensor's rows as the vLLM handler sees them: row ``c * tensors`` is chunk c's."""
        return [self.host[t:] for t in range(self.shape.tensors)]

    def expected(self, first_chunk: int, gpu_ids: torch.Tensor, t: int) -> torch.Tensor:
        rows = torch.arange(first_chunk, first_chunk + gpu_ids.numel()) * self.shape.tensors + t
        return self.host[rows]


def pieces(chunks: int, staging_chunks: int) -> list[tuple[int, int]]:
    """A request's chunks cut into runs of at most ``staging_chunks``."""
    if staging_chunks < 1:
        raise ValueError(f"a staging buffer must hold at least one chunk, got {staging_chunks}")
    return [(b, min(b + staging_chunks, chunks)) for b in range(0, chunks, staging_chunks)]


Scatter = Callable[[torch.Tensor, torch.Tensor], None]
"""(staging positions, device block ids): each tensor's page at each position to its block."""


def load_staged(
    region: Region,
    first_chunk: int,
    gpu_ids: torch.Tensor,
    staging: torch.Tensor,
    positions: torch.Tensor,
    scatter: Scatter,
) -> None:
    """The staged load of chunks ``first_chunk ..`` into blocks ``gpu_ids`` of every tensor,
    on the current stream: per piece one copy of whole chunks into ``staging``, then
    ``scatter(positions[:n], gpu_ids[piece])`` (``positions[k]`` = ``k * tensors``)."""
    tensors = region.shape.tensors
    staging_chunks = staging.shape[0] // tensors
    for begin, end in pieces(gpu_ids.numel(), staging_chunks):
        rows = (end - begin) * tensors
        host_begin = (first_chunk + begin) * tensors
        staging[:rows].copy_(region.host[host_begin : host_begin + rows], non_blocking=True)
        scatter(positions[: end - begin], gpu_ids[begin:end])


def reference_scatter(staging: torch.Tensor, gpus: list[torch.Tensor]) -> Scatter:
    """The scatter in torch ops: the CPU equivalent of the layered launch."""

    def scatter(positions: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        for t, gpu in enumerate(gpus):
            gpu[gpu_ids.to(gpu.device)] = staging[positions.to(staging.device) + t]

    return scatter


def layered_scatter(staging: torch.Tensor, gpus: list[torch.Tensor], ctas: int) -> Scatter:
    """The scatter as one launch of kvcore's layered gather kernel over every tensor, its
    sources the staging buffer's rows offset by the tensor (device memory, not host)."""
    from kvcore.kernels.triton_layers import LayeredLaunch, layer_table

    tensors = len(gpus)
    views = [staging[t : staging.shape[0] - tensors + t + 1] for t in range(tensors)]
    table = layer_table(views, gpus)
    return LayeredLaunch(table, table.offsets.to(staging.device), ctas)


Way = Callable[[int, torch.Tensor], None]
"""One way of a load: (first chunk, device block ids), issued on the current stream."""


def product_ways(region: Region, staging_bytes: int, ctas: int) -> dict[str, Way]:
    """The three ways over ``region``: the mover's gather and batched DMA, and the staged
    prototype with a staging buffer of ``staging_bytes`` and a scatter of ``ctas`` CTAs."""
    from kvcore.mover import Mover
    from kvcore.planning.layers import layer_pairs
    from kvcore.planning.path_policy import PathPolicy, TransferPath
    from kvcore.planning.plans import plan

    device = region.gpus[0].device
    tensors = region.shape.tensors
    pairs = layer_pairs(region.host_views(), region.gpus)
    gather_mover = Mover(PathPolicy())
    dma_mover = Mover(PathPolicy(long_run_bytes=16 << 10, max_batched_runs=1 << 16))
    chunk_rows = max(1, staging_bytes // (tensors * region.shape.page_bytes)) * tensors
    staging = torch.empty(chunk_rows, region.host.shape[1], dtype=WORD, device=device)
    positions = (torch.arange(chunk_rows // tensors) * tensors).to(device)
    scatter = layered_scatter(staging, region.gpus, ctas)

    def through(mover: Mover, path: TransferPath) -> Way:
        def load(first_chunk: int, gpu_ids: torch.Tensor) -> None:
            src_idx = torch.arange(first_chunk, first_chunk + gpu_ids.numel()) * tensors
            chosen = plan(region.host_views()[0], region.gpus[0], src_idx, gpu_ids, force=path)
            mover.execute(chosen, pairs)

        return load

    def staged(first_chunk: int, gpu_ids: torch.Tensor) -> None:
        on_device = gpu_ids.pin_memory().to(device, non_blocking=True)
        load_staged(region, first_chunk, on_device, staging, positions, scatter)

    return {
        "gather": through(gather_mover, TransferPath.GATHER),
        "dma": through(dma_mover, TransferPath.BATCHED_RUNS),
        "staged": staged,
    }


def identical(region: Region, first_chunk: int, gpu_ids: torch.Tensor) -> bool:
    on_device = gpu_ids.to(region.gpus[0].device)
    return all(
        torch.equal(gpu[on_device].cpu(), region.expected(first_chunk, gpu_ids, t))
        for t, gpu in enumerate(region.gpus)
    )


def run_cell(
    region: Region,
    ways: dict[str, Way],
    blocks: int,
    compute: str,
    repeats: int,
    forward: Any,
) -> list[dict[str, Any]]:
    """Every way ``repeats`` times, ways alternating, each request on new blocks."""
    device = region.gpus[0].device
    stream = torch.cuda.Stream(device)
    gen = torch.Generator().manual_seed(blocks)
    names = list(ways)
    times: dict[str, list[float]] = {n: [] for n in names}
    forwards: dict[str, list[float]] = {n: [] for n in names}
    checked: dict[str, bool] = {}
    alone: list[float] = []
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            first_chunk = int(torch.randint(0, region.chunks - blocks + 1, (1,), generator=gen))
            gpu_ids = torch.randperm(region.gpus[0].shape[0], generator=gen)[:blocks]
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            with torch.cuda.stream(stream):
                ways[name](first_chunk, gpu_ids)
            events = forward.replay() if forward is not None else None
            stream.synchronize()
            times[name].append((time.perf_counter() - began) * 1e3)
            if events is not None:
                events[1].synchronize()
                forwards[name].append(events[0].elapsed_time(events[1]))
            if name not in checked:
                checked[name] = identical(region, first_chunk, gpu_ids)
        if forward is not None:
            start, end = forward.replay()
            end.synchronize()
            alone.append(start.elapsed_time(end))
    nbytes = blocks * region.shape.tensors * region.shape.page_bytes
    rows = []
    for name in names:
        row: dict[str, Any] = {
            "way": name,
            "blocks": blocks,
            "tokens": blocks * BLOCK_TOKENS,
            "compute": compute,
            "load_ms": statistics.median(times[name]),
            "link_ms": nbytes / LINK_GBPS / 1e6,
            "load_ms_each": times[name],
            "identical": checked[name],
        }
        if forward is not None:
            row["forward_alone_ms"] = statistics.median(alone)
            row["forward_with_ms"] = statistics.median(forwards[name])
        rows.append(row)
    return rows


def probe_kind(
    shape: RegionShape, tokens: list[int], computes: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every cell of one model shape, on one region sized for the largest request."""
    from benchmarks.model_forward import measured_forward

    device = torch.device("cuda")
    most = max(tokens) // BLOCK_TOKENS
    region = Region(shape, chunks=2 * most, gpu_blocks=2 * most, device=device)
    ways = product_ways(region, args.staging_mib << 20, args.scatter_ctas)
    rows = []
    for count in tokens:
        blocks = count // BLOCK_TOKENS
        for compute in computes:
            forward = None
            if compute != "none":
                forward = measured_forward(shape.forward_kind, compute, shape.model_layers, device)
                forward.size_for(blocks * shape.tensors * shape.page_bytes / LINK_GBPS / 1e6)
            for row in run_cell(region, ways, blocks, compute, args.repeats, forward):
                row["kind"] = shape.forward_kind
                rows.append(row)
                print(describe(row), flush=True)
    del region, ways
    torch.cuda.empty_cache()
    return rows


def describe(row: dict[str, Any]) -> str:
    with_ms = row.get("forward_with_ms")
    beside = (
        ""
        if with_ms is None
        else f" forward {row['forward_alone_ms']:.1f} alone, {with_ms:.1f} beside"
    )
    return (
        f"{row['kind']} {row['tokens']} {row['compute']} {row['way']}: {row['load_ms']:.1f} ms "
        f"({row['load_ms'] / row['link_ms']:.2f}x link){beside} identical={row['identical']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="mla,mha")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--compute", default="none,decode-64,prefill-4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--staging-mib", type=int, default=256)
    parser.add_argument("--scatter-ctas", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from benchmarks.model_forward import COMPUTE_LOADS

    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in SHAPES]
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {sorted(SHAPES)}")
    computes = args.compute.split(",")
    unknown = [c for c in computes if c != "none" and c not in COMPUTE_LOADS]
    if unknown:
        parser.error(f"--compute: unknown {unknown}; choose from none, {', '.join(COMPUTE_LOADS)}")
    tokens = [t for t in args.tokens.split(",")]
    if not all(
        t.isdigit() and int(t) >= BLOCK_TOKENS and int(t) % BLOCK_TOKENS == 0 for t in tokens
    ):
        parser.error(f"--tokens: each a positive multiple of {BLOCK_TOKENS}, got {args.tokens}")
    for name in ("repeats", "staging_mib", "scatter_ctas"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: no folder {args.json.parent} to write {args.json.name} into")
    if not torch.cuda.is_available():
        print("region_staging_probe: needs a CUDA device", file=sys.stderr)
        return 2
    out = [
        row
        for kind in kinds
        for row in probe_kind(SHAPES[kind], [int(t) for t in tokens], computes, args)
    ]
    if args.json is not None:
        document = {"device": torch.cuda.get_device_name(), "command": sys.argv, "rows": out}
        args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
