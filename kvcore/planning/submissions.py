"""A plan spread over the buffer pairs of one engine call.

An engine's call moves the same rows between several buffer pairs (a layer's K and V, or
every layer of a backup). :func:`submissions` makes one :class:`Submission` of them where
one launch may take every pair (:func:`layers_mismatch` finds nothing against it), else
the plan rebound to each pair; :meth:`kvcore.mover.Mover.execute` runs each
(``mover.execute(work.plan, work.pairs)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.direction import Direction
from kvcore.planning.layers import LayerPairs
from kvcore.planning.plans import TransferPlan
from kvcore.runs import Runs


@dataclass(frozen=True)
class Submission:
    """One submission of an engine's call: ``plan`` over its own buffers, or over every
    pair of ``pairs`` (:meth:`kvcore.mover.Mover.execute`)."""

    plan: TransferPlan
    pairs: LayerPairs | None = None


def submissions(
    first: TransferPlan,
    buffers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layered: LayerPairs | None,
) -> list[Submission] | str:
    """``first`` (planned for ``buffers[0]``) for every (src, dst) pair of ``buffers``.

    One submission where ``layered`` (the same pairs, checked) takes them all, else the
    plan rebound to each pair (pairs of other row sizes, or with no ``layered``); or the
    fallback reason of the first pair that must take the engine's stock path. Rebinding
    raises ValueError where a pair is too short for the indices.
    """
    if layered is not None and layered.reason is None and layers_mismatch(first, layered) is None:
        return [Submission(first, layered)]
    # The pair ``first`` was planned on needs no second look.
    plans = [
        first if src is first.src and dst is first.dst else first.rebind(src, dst)
        for src, dst in buffers
    ]
    reason = next((each.reason for each in plans if each.reason is not None), None)
    return reason if reason is not None else [Submission(each) for each in plans]


def layers_mismatch(plan: TransferPlan, pairs: LayerPairs) -> str | None:
    """Why :meth:`kvcore.mover.Mover.execute` would refuse ``plan`` over ``pairs``, or None."""
    if plan.reason is not None:
        return f"the plan falls back ({plan.reason}); run the stock path"
    if pairs.reason is not None:
        return f"the pairs cannot move in one submission ({pairs.reason}); rebind the plan to each"
    if pairs.srcs[0].device != plan.src.device or pairs.dsts[0].device != plan.dst.device:
        return (
            f"the plan copies {plan.src.device} -> {plan.dst.device}, the pairs "
            f"{pairs.srcs[0].device} -> {pairs.dsts[0].device}"
        )
    if pairs.row_bytes != plan.row_bytes:
        return f"the plan copies rows of {plan.row_bytes} B, the pairs have {pairs.row_bytes} B"
    if pairs.src_rows < plan.src_span or pairs.dst_rows < plan.dst_span:
        return (
            f"the plan needs {plan.src_span} source and {plan.dst_span} destination rows, the "
            f"shortest pair has {pairs.src_rows} and {pairs.dst_rows}"
        )
    if pairs.shared_dsts:
        written = _destination_runs(plan)
        if written is None:
            return (
                "the pairs' destinations share memory and the plan's destination rows are "
                "on the device, unread: one submission could write a byte twice"
            )
        if pairs.rows_collide(written):
            return (
                "the plan's destination rows meet in the memory the pairs' destinations "
                "share: one submission would write a byte twice"
            )
    return None


def _destination_runs(plan: TransferPlan) -> Runs | None:
    """The rows ``plan`` writes, as runs; None where they are a device index never read."""
    if plan.direction is Direction.D2H:
        return plan.host_runs
    return None if plan.device_index_opaque else plan.runs.dst_runs()
