"""Whether the core suite's run fits in this machine's host memory, said before it starts.

The suite holds pools of 2 x ``--tokens`` rows of each row kind in turn; without this check
a run too large for the machine is killed by the kernel partway, with no word of why.
"""

from __future__ import annotations

from collections.abc import Mapping

# Host memory the suite holds at once, in pools of its largest row kind: on a CPU the
# "device" rows are host memory too, and each scenario keeps an expected and a poisoned copy
# of its destination (6.3 pools measured at 16384 tokens of 16 KiB rows); on a GPU, the
# pinned host pool and the host-side copies of page-outs.
POOLS_HELD = {"cpu": 7, "cuda": 4}


def host_bytes_needed(tokens: int, row_bytes: Mapping[str, int], device: str) -> int:
    """About the most host memory a run over ``row_bytes`` (kind -> bytes a row) holds."""
    return POOLS_HELD.get(device, POOLS_HELD["cuda"]) * 2 * tokens * max(row_bytes.values())


def memory_problem(
    tokens: int, row_bytes: Mapping[str, int], device: str, available: int | None, page: int
) -> str | None:
    """Why the run would not fit in ``available`` bytes of host memory (None: it fits, or
    the kernel does not say), naming a ``--tokens`` (a multiple of ``page``) that would."""
    need = host_bytes_needed(tokens, row_bytes, device)
    if available is None or need <= available:
        return None
    fit = max(page, tokens * available // need // page * page)
    gib = 1 << 30
    return (
        f"--tokens {tokens} over {', '.join(row_bytes)} rows needs about {need / gib:.1f} GiB "
        f"of host memory on {device}, and {available / gib:.1f} GiB is available: give "
        f"--tokens {fit} or less, fewer --rows, or --quick"
    )
