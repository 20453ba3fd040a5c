"""Where the vLLM beside-compute bench's pinned host region lies, and how fast each part
of it copies to the GPU: NUMA nodes of its pages, the GPU's node, and one contiguous
host-to-device copy per slice of the region. A process whose region is partly on the far
node is slower in every cell of the bench; this says whether that is what varies.

    python scripts/region_placement_probe.py [--gib 2.5] [--slice-mib 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.vllm.sweep import host_region
from kvcore import numa


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.5)
    parser.add_argument("--slice-mib", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    nbytes = int(args.gib * (1 << 30))
    slice_bytes = args.slice_mib << 20
    region = host_region(nbytes, device)
    try:
        host = region.tensor
        found = {
            "nodes": list(numa.online_nodes()),
            "gpu_node": numa.cuda_numa_node(device),
            "region_bytes": nbytes,
            "pages_by_node": numa.pages_by_node(host.data_ptr(), nbytes),
            "slice_bytes": slice_bytes,
            "slice_gbps": _slice_gbps(
                host, torch.empty(slice_bytes, dtype=torch.uint8, device=device), slice_bytes
            ),
        }
    finally:
        region.close()
    print(json.dumps(found))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(found, fh, indent=2)


if __name__ == "__main__":
    main()
