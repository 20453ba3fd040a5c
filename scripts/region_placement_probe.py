"""Where the vLLM beside-compute bench's pinned host region lies, and how fast each part
of it copies to the GPU: NUMA nodes of its pages, its transparent huge pages, the GPU's
node, one contiguous host-to-device copy per slice of the region, and copies of spans
drawn at random across it (as a region-staged load reads MLA's chunk rows). A process
whose region is partly on the far node, or in small pages the GPU translates one by one,
could be slower in every cell of the bench; this says which of them varies. ``--shm`` maps
the region as vLLM 0.34's shared CPU tier does instead (a /dev/shm file, pre-faulted by one
thread, then registered), to tell the bench's region from the engine's.

    python scripts/region_placement_probe.py [--gib 2.5] [--slice-mib 256] [--shm] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.vllm.sweep import host_region
from kvcore import numa
from kvcore.host_pinning import CudaHostRegistrar

# madvise(2)'s MADV_POPULATE_WRITE, as vLLM pre-faults its region (Linux 5.14 and later).
_MADV_POPULATE_WRITE = 23


@contextlib.contextmanager
def _shm_region(nbytes: int) -> Iterator[torch.Tensor]:
    """``nbytes`` of a /dev/shm file, mapped shared, pre-faulted and registered."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="kvcore-probe-") as file:
        os.ftruncate(file.fileno(), nbytes)
        mapped = mmap.mmap(file.fileno(), nbytes, flags=mmap.MAP_SHARED)
        try:
            mapped.madvise(_MADV_POPULATE_WRITE, 0, nbytes)
        except OSError:
            view = memoryview(mapped)
            for page in range(0, nbytes, mmap.PAGESIZE):
                view[page] = 0
            view.release()
        host = torch.frombuffer(mapped, dtype=torch.uint8)
        registrar = CudaHostRegistrar()
        registrar.register(host.data_ptr(), nbytes)
        try:
            yield host
        finally:
            registrar.unregister(host.data_ptr())
            del host
            mapped.close()


@contextlib.contextmanager
def _bench_region(nbytes: int, device: torch.device) -> Iterator[torch.Tensor]:
    """The bench's own region (:func:`benchmarks.vllm.sweep.host_region`)."""
    region = host_region(nbytes, device)
    try:
        yield region.tensor
    finally:
        region.close()


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


def _span_gbps(host: torch.Tensor, device_buffer: torch.Tensor, span_bytes: int) -> float:
    """One copy a span, spans at random page-aligned places across the region."""
    spans = device_buffer.numel() // span_bytes
    starts = random.Random(0).sample(range(0, host.numel() - span_bytes, 4096), spans)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for i, start in enumerate(starts):
            device_buffer[i * span_bytes : (i + 1) * span_bytes].copy_(
                host[start : start + span_bytes], non_blocking=True
            )
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return round(spans * span_bytes / best / 1e9, 1)


def _huge_kib(address: int) -> int | None:
    """AnonHugePages of the mapping that starts at ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == address
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.5)
    parser.add_argument("--slice-mib", type=int, default=256)
    parser.add_argument("--shm", action="store_true", help="map the region as vLLM 0.34 does")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.slice_mib <= 0 or args.gib * 1024 < 2 * args.slice_mib:
        parser.error("--gib must hold at least two slices of --slice-mib (both positive)")
    if not torch.cuda.is_available():
        raise SystemExit("region_placement_probe: needs a CUDA GPU (the copies are to one)")
    device = torch.device("cuda")
    nbytes = int(args.gib * (1 << 30))
    slice_bytes = args.slice_mib << 20
    opened = _shm_region(nbytes) if args.shm else _bench_region(nbytes, device)
    with opened as host:
        found = {
            "region": "shm" if args.shm else "bench",
            "nodes": list(numa.online_nodes()),
            "gpu_node": numa.cuda_numa_node(device),
            "region_bytes": nbytes,
            "pages_by_node": numa.pages_by_node(host.data_ptr(), nbytes),
            "anon_huge_kib": _huge_kib(host.data_ptr()),
            "slice_bytes": slice_bytes,
        }
        device_buffer = torch.empty(slice_bytes, dtype=torch.uint8, device=device)
        found["slice_gbps"] = _slice_gbps(host, device_buffer, slice_bytes)
        found["span_gbps"] = {
            str(span): _span_gbps(host, device_buffer, span) for span in (1 << 20, 1_249_280)
        }
    print(json.dumps(found))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(found, fh, indent=2)


if __name__ == "__main__":
    main()
