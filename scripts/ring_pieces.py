"""``kvcore bench`` with region staging's ring pieces of at most ``PIECE_CAP_MIB`` MiB (0: no
cap beyond a quarter of the lease) and ``RING_SLOTS`` slots, to compare them on one GPU
machine (either unset: the package's):

    PIECE_CAP_MIB=0 RING_SLOTS=8 python3 scripts/ring_pieces.py bench --engine vllm --sweep \\
        --beside-compute --rows mla --sizes 8192,32768 --json out.json
"""

from __future__ import annotations

import os
import sys

from kvcore import region_staging
from kvcore.cli import main


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


def apply(environ: dict[str, str]) -> None:
    """Set the package's ring as ``environ`` says, before any mover is made."""
    region_staging._MAX_PIECE_BYTES = piece_cap_bytes(environ)
    region_staging.RING_SLOTS = ring_slots(environ)


if __name__ == "__main__":
    apply(dict(os.environ))
    raise SystemExit(main(sys.argv[1:]))
