"""``kvcore bench`` with region staging's ring pieces of at most ``PIECE_CAP_MIB`` MiB (0: no
cap beyond a quarter of the lease) and ``RING_SLOTS`` slots, to compare them on one GPU
machine (either unset: the package's); ``PIECE_SCATTER=sliced`` scatters each piece from
slices of its rows (as before ``KernelSet.gather_range``) instead of in place:

    PIECE_CAP_MIB=0 RING_SLOTS=8 python3 scripts/ring_pieces.py bench --engine vllm --sweep \\
        --beside-compute --rows mla --sizes 8192,32768 --json out.json
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from kvcore import region_staging
from kvcore.cli import main
from kvcore.kernels import KernelSet


def piece_cap_bytes(environ: dict[str, str]) -> int:
    """The cap ``PIECE_CAP_MIB`` names, in bytes (the package's where unset)."""
    text = environ.get("PIECE_CAP_MIB")
    if text is None:
        return region_staging._MAX_PIECE_BYTES
    mib = int(text) if text.strip().isdigit() else -1
    if mib < 0:
        raise SystemExit(f"PIECE_CAP_MIB={text}: give 0 (no cap) or a size in MiB")
    return mib << 20 if mib else 1 << 62


def ring_slots(environ: dict[str, str]) -> int:
    """The slot count ``RING_SLOTS`` names (the package's where unset)."""
    text = environ.get("RING_SLOTS")
    if text is None:
        return region_staging.RING_SLOTS
    slots = int(text) if text.strip().isdigit() else 0
    if not 1 <= slots <= 64:
        raise SystemExit(f"RING_SLOTS={text}: give a slot count from 1 to 64")
    return slots


def sliced_scatters(environ: dict[str, str]) -> bool:
    """Whether ``PIECE_SCATTER`` asks for each piece's rows sliced (``sliced``) rather than
    read in place (``in-place``, the package's; unset: the package's)."""
    text = environ.get("PIECE_SCATTER", "in-place")
    if text not in ("sliced", "in-place"):
        raise SystemExit(f"PIECE_SCATTER={text}: give sliced or in-place")
    return text == "sliced"


def apply(environ: dict[str, str]) -> None:
    """Set the package's ring as ``environ`` says, before any mover is made."""
    region_staging._MAX_PIECE_BYTES = piece_cap_bytes(environ)
    region_staging.RING_SLOTS = ring_slots(environ)
    if sliced_scatters(environ):
        in_place = region_staging._piece_scatter

        def sliced(kernels: KernelSet, *args: Any) -> Callable[[int, int], str | None]:
            return in_place(dataclasses.replace(kernels, gather_range=None), *args)

        region_staging._piece_scatter = sliced  # type: ignore[assignment]


if __name__ == "__main__":
    apply(dict(os.environ))
    raise SystemExit(main(sys.argv[1:]))
