"""Where the vLLM beside-compute bench's pinned host region lies, and how fast each part
of it copies to the GPU: NUMA nodes of its pages, its transparent huge pages, the GPU's
node, one contiguous host-to-device copy per slice of the region, and copies of spans
drawn at random across it (as a region-staged load reads MLA's chunk rows). A process
whose region is partly on the far node, or in small pages the GPU translates one by one,
could be slower in every cell of the bench; this says which of them varies.

``--region`` picks how the region is made: ``bench`` as the bench makes it
(:func:`benchmarks.vllm.sweep.host_region`: pre-faulted by eight threads, not placed);
``vllm`` as stock vLLM 0.34 with one GPU does (shared memory faulted in by one thread);
``kvcore`` as kvcore's host pool makes vLLM's region live (faulted in by every usable
CPU, on the GPU's NUMA node: :mod:`kvcore_vllm.region_faulting`). Each is then
registered with cudaHostRegister, as vLLM registers its region.

    python scripts/region_placement_probe.py [--gib 2.5] [--slice-mib 256]
        [--region bench|vllm|kvcore] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

# The measuring code is in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.script_env import need_vllm

need_vllm("region_placement_probe")

from benchmarks.vllm.sweep import host_region
from kvcore import numa
from kvcore.host_mapping import faulted_memory
from kvcore.host_pinning import CudaHostRegistrar


@contextlib.contextmanager
def _registered(
    nbytes: int, *, threads: int | None, placement: numa.Placement | None
) -> Iterator[torch.Tensor]:
    """``nbytes`` of shared memory faulted in by ``threads`` threads, placed as
    ``placement`` says (:func:`kvcore.host_mapping.faulted_memory`), then registered."""
    memory = faulted_memory(nbytes, placement=placement, threads=threads)
    host = torch.frombuffer(memory.buffer, dtype=torch.uint8)
    registrar = CudaHostRegistrar()
    registrar.register(memory.address, nbytes)
    try:
        yield host
    finally:
        registrar.unregister(memory.address)
        del host
        memory.close()


@contextlib.contextmanager
def _bench_region(nbytes: int, device: torch.device) -> Iterator[torch.Tensor]:
    """The bench's own region (:func:`benchmarks.vllm.sweep.host_region`)."""
    region = host_region(nbytes, device)
    try:
        yield region.tensor
    finally:
        region.close()


def _region(kind: str, nbytes: int, device: torch.device) -> contextlib.AbstractContextManager:
    if kind == "vllm":
        return _registered(nbytes, threads=1, placement=None)
    if kind == "kvcore":
        return _registered(nbytes, threads=None, placement=numa.current_gpu_placement())
    return _bench_region(nbytes, device)


def _slice_gbps(host: torch.Tensor, device_buffer: torch.Tensor, slice_bytes: int) -> list[float]:
    rates = []
    for start in range(0, host.numel() - slice_bytes + 1, slice_bytes):
        part = host[start : start + slice_bytes]
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            began = time.perf_counter()
            device_buffer.copy_(part, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
        rates.append(round(slice_bytes / best / 1e9, 1))
    return rates


def _span_gbps(
    host: torch.Tensor, device_buffer: torch.Tensor, span_bytes: int
) -> dict[str, float]:
    """One copy a span, spans at random page-aligned places across the region: GB/s of the
    fastest of three rounds, and the share of that round's time the host spent issuing the
    copies (near 1 where each copy held the host until its bytes were across, as a copy
    from memory the driver does not take for pinned does)."""
    spans = device_buffer.numel() // span_bytes
    starts = random.Random(0).sample(range(0, host.numel() - span_bytes, 4096), spans)
    best, issuing = float("inf"), 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for i, start in enumerate(starts):
            device_buffer[i * span_bytes : (i + 1) * span_bytes].copy_(
                host[start : start + span_bytes], non_blocking=True
            )
        issued = time.perf_counter() - began
        torch.cuda.synchronize()
        took = time.perf_counter() - began
        if took < best:
            best, issuing = took, issued / took
    return {"gbps": round(spans * span_bytes / best / 1e9, 1), "host_share": round(issuing, 2)}


def _huge_page_kib(address: int, nbytes: int) -> int:
    """KiB of ``[address, address + nbytes)`` in huge pages, anonymous or shared, over every
    mapping that starts inside it (from /proc/self/smaps)."""
    inside = False
    total = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = address <= int(head.split("-")[0], 16) < address + nbytes
        elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(line.split()[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.5)
    parser.add_argument("--slice-mib", type=int, default=256)
    parser.add_argument("--region", choices=("bench", "vllm", "kvcore"), default="bench")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.slice_mib <= 0 or args.gib * 1024 < 2 * args.slice_mib:
        parser.error("--gib must hold at least two slices of --slice-mib (both positive)")
    if not torch.cuda.is_available():
        raise SystemExit("region_placement_probe: needs a CUDA GPU (the copies are to one)")
    device = torch.device("cuda")
    nbytes = int(args.gib * (1 << 30))
    slice_bytes = args.slice_mib << 20
    with _region(args.region, nbytes, device) as host:
        found = {
            "region": args.region,
            "nodes": list(numa.online_nodes()),
            "gpu_node": numa.cuda_numa_node(device),
            "region_bytes": nbytes,
            "pages_by_node": numa.pages_by_node(host.data_ptr(), nbytes),
            "huge_page_kib": _huge_page_kib(host.data_ptr(), nbytes),
            "slice_bytes": slice_bytes,
            "torch_takes_pinned": bool(host.is_pinned()),
        }
        device_buffer = torch.empty(slice_bytes, dtype=torch.uint8, device=device)
        found["slice_gbps"] = _slice_gbps(host, device_buffer, slice_bytes)
        found["spans"] = {
            str(span): _span_gbps(host, device_buffer, span) for span in (1 << 20, 1_249_280)
        }
    print(json.dumps(found))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(found, fh, indent=2)


if __name__ == "__main__":
    main()
