"""The difference of two groups' medians, with a bootstrap interval, for unpaired times.

Where two copies share one process (an A/B inside one engine, each request drawn for one
copy), the groups are not paired request by request, so the medians are compared
directly: each group resampled with replacement, apart. Standard library only: the live
trace's client imports it beside a server that may lack numpy.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

RESAMPLES = 2000
TAIL = 0.025
"""Each end of the interval leaves out this share of the resamples: a 95% interval."""


def median_difference_interval(
    values: Sequence[float], reference: Sequence[float], seed: int = 0
) -> tuple[float, float]:
    """A bootstrap interval of median(values) - median(reference), both resampled
    independently with replacement."""
    rng = random.Random(seed)
    differences = sorted(
        statistics.median(rng.choices(values, k=len(values)))
        - statistics.median(rng.choices(reference, k=len(reference)))
        for _ in range(RESAMPLES)
    )
    low = int(TAIL * RESAMPLES)
    return differences[low], differences[RESAMPLES - 1 - low]
