"""The two buffers of a row transfer, checked once for any number of plans between them.

An engine copies between the same buffers request after request (a layer's host view and
its device layer): their shapes, devices, direction and whether kvcore can copy their rows
at all do not change between requests, so :mod:`kvcore.planning.plans` takes them checked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvcore.direction import Direction
from kvcore.planning.pair_checks import fallback_reason
from kvcore.row_words import row_bytes


@dataclass(frozen=True)
class CheckedSides:
    """Two buffers checked as the sides of a transfer: what a plan needs from them alone.

    An engine copies between the same buffers request after request (a layer's host view
    and its device layer); checking them once and planning each request from this leaves
    only the indices to check (:func:`kvcore.planning.device_indexed.plan_device_indexed_for`).
    """

    src: torch.Tensor
    dst: torch.Tensor
    direction: Direction
    row_bytes: int
    """Bytes of one source row."""
    reason: str | None
    """Why copying rows between them must take the stock path (:func:`fallback_reason`)."""

    @functools.cached_property
    def stand_ins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`no_rows` of ``src`` and ``dst``, found once for every plan between them."""
        return no_rows(self.src), no_rows(self.dst)


def check_sides(src: torch.Tensor, dst: torch.Tensor, direction: Direction | None) -> CheckedSides:
    """``src`` and ``dst`` checked once for any number of plans between them."""
    return CheckedSides(
        src, dst, direction_between(src, dst, direction), row_bytes(src), fallback_reason(src, dst)
    )


def direction_between(
    src: torch.Tensor, dst: torch.Tensor, direction: Direction | None
) -> Direction:
    """Both sides have rows, and the direction their devices imply (or the one given)."""
    for name, tensor in (("src", src), ("dst", dst)):
        if tensor.dim() == 0:
            raise ValueError(f"{name} is a scalar; rows are indexed along dim 0")
    return _resolve_direction(src.device, dst.device, direction)


def _resolve_direction(
    src_device: torch.device, dst_device: torch.device, direction: Direction | None
) -> Direction:
    given = None if direction is None else Direction(direction)
    src_on_host = src_device.type == "cpu"
    if src_on_host != (dst_device.type == "cpu"):
        implied = Direction.H2D if src_on_host else Direction.D2H
        if given is not None and given is not implied:
            raise ValueError(
                f"{src_device} -> {dst_device} is {implied.value}, but direction={given.value}"
            )
        return implied
    if given is None:
        raise ValueError(
            f"src is on {src_device} and dst on {dst_device}: pass direction= to say which "
            "side is the host"
        )
    return given


_NO_ROWS: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], torch.Tensor] = {}


def no_rows(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``tensor`` (device, dtype, row shape) holding none of its memory;
    one per kind, shared (it has no element to write), because making a device tensor costs
    a request's first call microseconds on the engine's load path."""
    key = (tensor.device, tensor.dtype, tuple(tensor.shape[1:]))
    empty = _NO_ROWS.get(key)
    if empty is None:
        made = torch.empty((0, *key[2]), dtype=tensor.dtype, device=tensor.device)
        empty = _NO_ROWS.setdefault(key, made)
    return empty
