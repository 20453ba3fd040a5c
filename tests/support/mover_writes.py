"""Where a :class:`kvcore.mover.Mover` call writes, for tests that wrap its methods."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.planning.plans import TransferPlan


def executed_into(plan: TransferPlan, pairs: Any = None, *_: Any) -> torch.Tensor:
    """Where :meth:`Mover.execute` wrote first: the plan's own buffer, or its first pair's."""
    return plan.dst if pairs is None else pairs.dsts[0]
