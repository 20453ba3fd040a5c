"""Does torch's own pinned host allocator keep bytes "in use" after index uploads that
neither kvcore nor the engine keeps? A control for the soak's ``pinned_host_in_use``.

    python3 scripts/pinned_growth_probe.py [--uploads 2000] [--json FILE]

The soaks found the pinned bytes in use a few bytes a job higher after each phase, with
kvcore serving or passing alike. Their harness, like SGLang's controller, moves each
request's index tensor to the device with ``.to(device, non_blocking=True)`` from pageable
memory. This runs only such uploads (no kvcore, no engine), then the same from a pinned
source, and prints the allocator's ``active_bytes.current`` before and after each, read
the way the soak reads it (device synchronized, host cache emptied). Growth in the first
with none in the second puts the soak's residue on torch's staging of pageable uploads.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_state import pinned_in_use


def uploads(device: torch.device, count: int, pinned: bool, seed: int) -> int | None:
    """Bytes in use after ``count`` uploads of 16-4096 random indices, less before."""
    generator = torch.Generator().manual_seed(seed)
    before = pinned_in_use(device)
    for _ in range(count):
        length = int(torch.randint(16, 4097, (1,), generator=generator))
        host = torch.randint(0, 1 << 20, (length,), generator=generator, dtype=torch.int64)
        if pinned:
            host = host.pin_memory()
        uploaded = host.to(device, non_blocking=True)
        del uploaded
    after = pinned_in_use(device)
    if before is None or after is None:
        return None
    return after - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uploads", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pinned_growth_probe: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "uploads": args.uploads,
        "growth_bytes": {
            source: uploads(device, args.uploads, source == "pinned", seed)
            for seed, source in enumerate(("pageable", "pinned", "pageable_again"))
        },
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
