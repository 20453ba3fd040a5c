"""``kvcore bench``'s core suite: its options (row kinds, host layouts, sizes) and the
arguments that set them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.planning.path_policy import PathPolicy, policy_from_config

PAGE = 64

ROW_KINDS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "mla-1152B": ((1, 576), torch.bfloat16),
    "mha-4KiB": ((2, 8, 128), torch.bfloat16),
    "mha-16KiB": ((2, 8, 512), torch.bfloat16),
}

# Host-side layouts: the share of 64-token pages moved away from one contiguous
# run; "tokens" scatters every token, as a page_size-1 pool does under churn.
HOST_FRAGMENTATION = {
    "0%": (0.0, PAGE),
    "50%": (0.5, PAGE),
    "100%": (1.0, PAGE),
    "tokens": (1.0, 1),
}
PAGE_LEVELS = {name: share for name, (share, unit) in HOST_FRAGMENTATION.items() if unit == PAGE}
"""The layouts that move whole pages, by name: the share of pages moved (the engine benches'
host levels)."""


@dataclass(frozen=True)
class BenchOptions:
    tokens: int
    row_kinds: tuple[str, ...]
    host_levels: tuple[str, ...]
    device_layouts: tuple[str, ...]
    repeats: int
    allocator_slots: int
    allocator_ops: int
    device: torch.device
    pin_measure_bytes: int = 8 << 30
    policy: PathPolicy = field(default_factory=PathPolicy)
    """kvcore's thresholds for every plan and the mover (the KVCORE_* settings in effect)."""


def options_for(args: argparse.Namespace) -> BenchOptions:
    device = _pick_device(args.device)
    quick = args.quick
    return BenchOptions(
        tokens=args.tokens if args.tokens is not None else (16384 if quick else 131072),
        row_kinds=_choice(args.rows, ROW_KINDS, ("mla-1152B", "mha-4KiB") if quick else None),
        host_levels=_choice(
            args.host_levels, HOST_FRAGMENTATION, ("0%", "50%", "100%") if quick else None
        ),
        device_layouts=("contiguous", "scattered"),
        repeats=3 if quick else 5,
        allocator_slots=args.allocator_slots,
        allocator_ops=args.allocator_ops,
        device=device,
        pin_measure_bytes=(1 if quick else 8) << 30,
        policy=policy_from_config(KVCoreConfig.from_env()),
    )


def _choice(
    asked: str | None, known: dict[str, Any], default: tuple[str, ...] | None
) -> tuple[str, ...]:
    if not asked:
        return default if default is not None else tuple(known)
    names = tuple(name.strip() for name in asked.split(","))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"kvcore bench: unknown {unknown}; choose from {', '.join(known)}")
    return names


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvcore bench: --device cuda asked for, but CUDA is not available")
    return torch.device(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument(
        "--full", action="store_true", help="print every path of every scenario after the summary"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a chart, one panel per row kind and direction (needs matplotlib)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--tokens",
        type=int,
        help=f"rows per transfer, a multiple of {PAGE} (default 131072; --quick: 16384)",
    )
    parser.add_argument("--rows", help=f"comma list of row kinds: {', '.join(ROW_KINDS)}")
    # argparse expands % in help strings: the levels' own % signs are doubled.
    levels = ", ".join(HOST_FRAGMENTATION).replace("%", "%%")
    parser.add_argument("--host-levels", help=f"comma list of host layouts: {levels}")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--allocator-slots", type=int, default=1 << 20, help="slots of the allocator churn's pool"
    )
    parser.add_argument(
        "--allocator-ops",
        type=int,
        default=10_000,
        help="mixed operations of the allocator churn, after its fill",
    )
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="print (and with --plot, chart) a report saved by --json instead of measuring",
    )


def row_bytes(opts: BenchOptions) -> dict[str, int]:
    """Bytes of one row of each row kind ``opts`` runs."""
    return {
        kind: math.prod(ROW_KINDS[kind][0]) * ROW_KINDS[kind][1].itemsize for kind in opts.row_kinds
    }
