"""kvcore's speed over stock's from requests timed in pairs, with how sure it is.

A sweep times each repeat's request on both sides back to back (the order alternating),
so the two times of one repeat share whatever the lent machine was doing then. The ratio
of the two sides' medians mixes requests from different moments: on a host-bound cell of
under a millisecond, where both sides run the very same stock call, it has come out
anywhere from 0.78x to 1.08x. The median of the per-repeat ratios, with a bootstrap
interval, says whether a difference is resolved at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DRAWS = 2000
"""Bootstrap resamples: the interval's ends move by well under 1% between seeds."""


@dataclass(frozen=True)
class PairedSpeed:
    median: float
    """Median over repeats of stock's time over kvcore's: above 1 is faster."""
    low: float
    high: float
    """The 95% bootstrap interval of that median."""
    pairs: int


def paired_speed(
    stock_s: Sequence[float], kvcore_s: Sequence[float], *, seed: int = 0
) -> PairedSpeed | None:
    """Stock's over kvcore's time per repeat (the two sequences aligned by repeat); None
    where there are fewer than two pairs or a time is not positive."""
    if len(stock_s) != len(kvcore_s):
        raise ValueError(f"{len(stock_s)} stock times against {len(kvcore_s)} of kvcore's")
    stock, kvcore = np.asarray(stock_s, dtype=float), np.asarray(kvcore_s, dtype=float)
    if stock.size < 2 or not (stock > 0).all() or not (kvcore > 0).all():
        return None
    ratios = stock / kvcore
    draws = np.random.default_rng(seed).integers(0, ratios.size, size=(DRAWS, ratios.size))
    medians = np.median(ratios[draws], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return PairedSpeed(float(np.median(ratios)), float(low), float(high), int(ratios.size))
