"""Can MHA's per-layer 32 KiB pages go by DMA nearer the link beside the model's compute?

    python3 scripts/dma_order_probe.py [--tokens 8192,32768] [--loads none,prefill-4096]
        [--repeats 7] [--json F]

vLLM's MHA blocks (32 layers of 32 KiB pages a block) go by DMA into place, one
cudaMemcpyBatchAsync descriptor a page, and took 1.17-1.26x the link beside compute
(docs/performance.md). Each variant copies one request's blocks from a pinned host region
(a block's 32 pages side by side, the request's blocks in one host run, as kvcore's
allocator hands them out) into new, scattered device blocks of 32 per-layer tensors:

- ``layer-major``: every block of layer 0, then of layer 1, ... (kvcore's order today);
- ``block-major``: every layer of block 0, then of block 1, ...: the host is read in order;
- ``...-any``: the sources read in any order (``cudaMemcpySrcAccessOrderAny``);
- ``...-2streams``: the descriptors split in halves over two streams (two copy engines?);
- ``one-run``: the same bytes as one long copy into one device buffer: the link here.

Each beside a model-shaped forward (``benchmarks.model_forward``, MHA's) queued right after
the copies, sized to last about as long as the one-run copy. Reports per variant the
copy's wall-clock ms (submission to completion), the link's multiple, the forward's time
over its time alone, and each variant's paired speed over ``layer-major``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_forward import COMPUTE_LOADS, measured_forward
from benchmarks.paired_speed import paired_speed
from kvcore.kernels.batch_copy import batch_copy_pointers

LAYERS = 32
PAGE_BYTES = 32 << 10
BLOCK_TOKENS = 16
LINK_GBPS = 55.3
VARIANTS = (
    "layer-major",
    "block-major",
    "layer-major-any",
    "block-major-any",
    "layer-major-2streams",
    "block-major-2streams",
    "one-run",
)


class Pools:
    """A pinned host region of ``host_blocks`` chunks of random bytes and ``LAYERS`` device
    tensors of ``gpu_blocks`` blocks."""

    def __init__(self, host_blocks: int, gpu_blocks: int, device: torch.device) -> None:
        self.host_blocks, self.gpu_blocks = host_blocks, gpu_blocks
        self.host = torch.randint(
            -128, 127, (host_blocks, LAYERS * PAGE_BYTES), dtype=torch.int8
        ).pin_memory()
        self.gpu = [
            torch.empty((gpu_blocks, PAGE_BYTES), dtype=torch.int8, device=device)
            for _ in range(LAYERS)
        ]
        self.flat = torch.empty(self.host.numel(), dtype=torch.int8, device=device)
        self.gpu_bases = np.array([t.data_ptr() for t in self.gpu], dtype=np.uint64)

    def descriptors(
        self, host_start: int, gpu_ids: np.ndarray, block_major: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dsts, srcs, sizes) of one request's pages in the order asked."""
        blocks = np.arange(host_start, host_start + gpu_ids.size, dtype=np.uint64)
        layer = np.arange(LAYERS, dtype=np.uint64)
        page = np.uint64(PAGE_BYTES)
        src = (
            np.uint64(self.host.data_ptr())
            + (blocks[None, :] * np.uint64(LAYERS) + layer[:, None]) * page
        )
        dst = self.gpu_bases[:, None] + gpu_ids.astype(np.uint64)[None, :] * page
        if block_major:
            src, dst = src.T, dst.T
        dst, src = np.ascontiguousarray(dst).ravel(), np.ascontiguousarray(src).ravel()
        return dst, src, np.full(dst.size, PAGE_BYTES, dtype=np.uint64)

    def check(self, host_start: int, gpu_ids: np.ndarray) -> bool:
        ids = torch.from_numpy(gpu_ids).to(self.gpu[0].device)
        want = self.host[host_start : host_start + gpu_ids.size].view(gpu_ids.size, LAYERS, -1)
        return all(
            torch.equal(self.gpu[layer].index_select(0, ids).cpu(), want[:, layer])
            for layer in (0, LAYERS // 2, LAYERS - 1)
        )


def submit(
    variant: str, pools: Pools, host_start: int, gpu_ids: np.ndarray, streams: list[Any]
) -> None:
    if variant == "one-run":
        nbytes = gpu_ids.size * LAYERS * PAGE_BYTES
        with torch.cuda.stream(streams[0]):
            run = pools.host[host_start : host_start + gpu_ids.size].view(-1)
            pools.flat[:nbytes].copy_(run, non_blocking=True)
        return
    dst, src, sizes = pools.descriptors(host_start, gpu_ids, variant.startswith("block"))
    in_order = "-any" not in variant
    parts = 2 if variant.endswith("2streams") else 1
    half = -(-dst.size // parts)
    for part in range(parts):
        cut = slice(part * half, (part + 1) * half)
        batch_copy_pointers(
            np.ascontiguousarray(dst[cut]),
            np.ascontiguousarray(src[cut]),
            np.ascontiguousarray(sizes[cut]),
            streams[part],
            source_in_stream_order=in_order,
        )


def timed(
    variant: str,
    pools: Pools,
    request: tuple[int, np.ndarray],
    streams: list[Any],
    forward: Any | None,
) -> tuple[float, float | None]:
    """(copy ms, forward ms or None) of one request, the forward queued after the copies."""
    for stream in streams:
        stream.synchronize()
    began = time.perf_counter()
    submit(variant, pools, *request, streams)
    events = forward.replay() if forward is not None else None
    for stream in streams:
        stream.synchronize()
    copy_ms = (time.perf_counter() - began) * 1e3
    if events is None:
        return copy_ms, None
    events[1].synchronize()
    return copy_ms, float(events[0].elapsed_time(events[1]))


def cell(
    pools: Pools,
    blocks: int,
    forward: Any | None,
    repeats: int,
    rng: np.random.Generator,
    streams: list[Any],
) -> dict[str, Any]:
    copy: dict[str, list[float]] = {v: [] for v in VARIANTS}
    beside: dict[str, list[float]] = {v: [] for v in VARIANTS}
    alone: list[float] = []
    ok = True
    for i in range(repeats + 1):
        if forward is not None:
            start, end = forward.replay()
            end.synchronize()
            if i:
                alone.append(float(start.elapsed_time(end)))
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            request = (
                int(rng.integers(0, pools.host_blocks - blocks + 1)),
                rng.permutation(pools.gpu_blocks)[:blocks].astype(np.int64),
            )
            ms, forward_ms = timed(variant, pools, request, streams, forward)
            if variant != "one-run":
                ok &= pools.check(*request)
            if i:
                copy[variant].append(ms)
                if forward_ms is not None:
                    beside[variant].append(forward_ms)
    link_ms = blocks * LAYERS * PAGE_BYTES / LINK_GBPS / 1e6
    out: dict[str, Any] = {"link_ms": link_ms, "identical": ok, "variants": {}}
    if alone:
        out["forward_alone_ms"] = statistics.median(alone)
    for variant in VARIANTS:
        speed = paired_speed(copy["layer-major"], copy[variant])
        row: dict[str, Any] = {
            "copy_ms": statistics.median(copy[variant]),
            "over_link": statistics.median(copy[variant]) / link_ms,
            "speed_over_layer_major": [speed.median, speed.low, speed.high] if speed else None,
        }
        if alone:
            row["forward_over_alone"] = statistics.median(beside[variant]) / out["forward_alone_ms"]
        out["variants"][variant] = row
    return out


def token_counts(text: str) -> list[int]:
    """``--tokens``: whole blocks of 16 tokens, comma-separated."""
    counts = [int(t) for t in text.split(",") if t.strip().isdigit()]
    if len(counts) != len(text.split(",")) or any(c < BLOCK_TOKENS for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts of 16 and more, e.g. 8192")
    return counts


def compute_loads(text: str) -> list[str]:
    """``--loads``: ``none`` or forwards of :data:`benchmarks.model_forward.COMPUTE_LOADS`."""
    loads = text.split(",")
    unknown = [load for load in loads if load != "none" and load not in COMPUTE_LOADS]
    if unknown:
        known = ", ".join(["none", *COMPUTE_LOADS])
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: give some of {known}")
    return loads


def repeat_count(text: str) -> int:
    """``--repeats``: at least two, so that each variant's speed has a paired interval."""
    count = int(text) if text.strip().isdigit() else 0
    if count < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give 2 or more")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_counts, default="8192,32768")
    parser.add_argument("--loads", type=compute_loads, default="none,decode-256,prefill-4096")
    parser.add_argument("--repeats", type=repeat_count, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("dma_order_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    tokens = args.tokens
    most = max(tokens) // BLOCK_TOKENS
    pools = Pools(most + 256, 2 * most, device)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    rng = np.random.default_rng(7)
    results = []
    for load in args.loads:
        forward = None if load == "none" else measured_forward("mha", load, LAYERS, device)
        for count in tokens:
            blocks = count // BLOCK_TOKENS
            if forward is not None:
                forward.size_for(blocks * LAYERS * PAGE_BYTES / LINK_GBPS / 1e6)
            result = cell(pools, blocks, forward, args.repeats, rng, streams)
            result.update(tokens=count, compute=load)
            results.append(result)
            line = " ".join(
                f"{v}={r['over_link']:.2f}"
                + (f"/{r['forward_over_alone']:.3f}" if "forward_over_alone" in r else "")
                for v, r in result["variants"].items()
            )
            print(f"{load} {count}: {line} identical={result['identical']}", flush=True)
    doc = {
        "device": torch.cuda.get_device_name(device),
        "command": "python3 scripts/dma_order_probe.py " + " ".join(argv or sys.argv[1:]),
        "layers": LAYERS,
        "page_bytes": PAGE_BYTES,
        "cells": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
