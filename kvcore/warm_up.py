"""Every copy path run once on scratch rows when an adapter is installed, bytes checked.

An engine's first cache hits should not pay kvcore's first-use costs: allocating the
device staging buffer and the pinned index buffers, loading or compiling kernels (in a
live engine they made the first reloads many times slower than later ones;
docs/lab/benchmarks.md). So an adapter calls :func:`warm_up` while the engine sets up, with
the row sizes its KV pages have.

The same calls check kvcore's paths on this machine: every warm-up copy is compared with
its source, and a path that moves a wrong byte makes :func:`warm_up` report it, so that
the adapter leaves the engine's copies stock rather than trust that path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import TransferPath
from kvcore.planning.plans import plan

logger = logging.getLogger("kvcore.warm_up")

# Enough rows that a scattered index has several runs; few enough to cost nothing.
SCRATCH_ROWS = 8
# Every other row, in a shuffled order: no two rows adjacent on either side.
SCATTERED = (6, 0, 4, 2)
PATHS = (
    TransferPath.SINGLE_COPY,
    TransferPath.BATCHED_RUNS,
    TransferPath.STAGED,
    TransferPath.GATHER,
)


@dataclass
class WarmUp:
    """What :func:`warm_up` ran: each case named ``direction/path/row bytes``."""

    warmed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    """Cases whose copy moved a wrong byte: the adapter must not serve."""
    failed: dict[str, str] = field(default_factory=dict)
    """Cases that raised, with why: the engine call would pass to stock there."""

    @property
    def trustworthy(self) -> bool:
        return not self.wrong


def warm_up(mover: Mover, device: torch.device, row_bytes: Iterable[int]) -> WarmUp:
    """Run each path, both directions, one pair and two layers at once, on scratch rows of
    each size in ``row_bytes`` between ``device`` and pinned host memory; then wait for
    the device and compare every destination with its source."""
    result = WarmUp()
    pin = device.type == "cuda"
    # Warm-up copies are not the engine's: they stay out of its counters.
    metrics, mover.metrics = mover.metrics, None
    try:
        _run_cases(mover, device, row_bytes, pin, result)
    finally:
        mover.metrics = metrics
    if result.wrong:
        logger.error("kvcore: warm-up copies moved wrong bytes: %s", ", ".join(result.wrong))
    return result


def _run_cases(
    mover: Mover, device: torch.device, row_bytes: Iterable[int], pin: bool, result: WarmUp
) -> None:
    for size in sorted(set(row_bytes)):
        for direction in (Direction.H2D, Direction.D2H):
            for path in PATHS:
                for layers in (1, 2):
                    layered = "/layers" if layers > 1 else ""
                    name = f"{direction.value}/{path.value}/{size}B{layered}"
                    try:
                        checks = _one_case(mover, device, size, direction, path, layers, pin)
                    except Exception as exc:
                        result.failed[name] = f"{type(exc).__name__}: {exc}"
                        continue
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if all(torch.equal(got.cpu(), want.cpu()) for got, want in checks):
                        result.warmed.append(name)
                    else:
                        result.wrong.append(name)


def _one_case(
    mover: Mover,
    device: torch.device,
    size: int,
    direction: Direction,
    path: TransferPath,
    layers: int,
    pin: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Issue one warm-up copy; (destination rows, expected rows) to compare once done."""
    generator = torch.Generator().manual_seed(size * 31 + layers)

    def rows(on: torch.device) -> torch.Tensor:
        host = torch.randint(0, 256, (SCRATCH_ROWS, size), dtype=torch.uint8, generator=generator)
        if on.type == "cpu":
            return host.pin_memory() if pin else host
        return host.to(on)

    host = torch.device("cpu")
    src_on, dst_on = (host, device) if direction is Direction.H2D else (device, host)
    srcs = [rows(src_on) for _ in range(layers)]
    dsts = [rows(dst_on) for _ in range(layers)]
    if path is TransferPath.SINGLE_COPY:
        src_idx = torch.arange(2, 2 + len(SCATTERED))
        dst_idx = torch.arange(1, 1 + len(SCATTERED))
    else:
        src_idx = torch.tensor(SCATTERED)
        dst_idx = torch.tensor(SCATTERED[::-1])
    expected = []
    for src, dst in zip(srcs, dsts, strict=True):
        want = dst.cpu().clone()
        want[dst_idx] = src.cpu()[src_idx]
        expected.append(want)
    first = plan(
        srcs[0], dsts[0], src_idx, dst_idx, direction=direction, policy=mover.policy, force=path
    )
    mover.execute(first, None if layers == 1 else layer_pairs(srcs, dsts))
    return list(zip(dsts, expected, strict=True))
