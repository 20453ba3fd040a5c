"""Whether an index's values repeat, by the cheapest exact test for how they lie.

Planning refuses a copy whose destinations repeat (which copy lands last is undefined),
and the test runs on every engine call: a dense span is marked in a mask, a sparse one
stamped into a table of positions, a huge one sorted; an ascending index needs no more
than the pass that finds its steps.
"""

from __future__ import annotations

import numpy as np

from kvcore.index_scratch import SCRATCH


def duplicates_below(values: np.ndarray, span: int) -> bool:
    """Whether ``values`` (a checked index's values, each in ``[0, span)``) repeat any."""
    if values.size < 2:
        return False
    if span <= _DENSE_SLOTS_PER_ENTRY * values.size:
        # Marking a span this dense costs less than the pass that finds an ascending index.
        return _repeats(values, span)
    steps = SCRATCH.arrays(values.size - 1)[0]
    np.subtract(values[1:], values[:-1], out=steps)
    return stepped_duplicates(values, steps, span)


# Slots per entry up to which duplicates are marked in a mask of the span straight away.
_DENSE_SLOTS_PER_ENTRY = 8
# Past this many slots per entry, clearing and counting a mask of the span costs more than
# stamping each entry's position into a table of it, which is never cleared.
_MASK_SLOTS_PER_ENTRY = 64
# The largest span stamped (its table, 4 bytes a slot, is kept per thread); past it, sort.
_MAX_STAMP_SLOTS = 1 << 24


def stepped_duplicates(values: np.ndarray, steps: np.ndarray, span: int) -> bool:
    """Duplicates in ``values`` (non-negative, below ``span``) whose ``np.diff`` is ``steps``."""
    if values.size < 2 or bool((steps > 0).all()):
        return False
    return _repeats(values, span)


def _repeats(values: np.ndarray, span: int) -> bool:
    """Duplicates in ``values`` (two or more, non-negative, below ``span``), by the cheapest
    exact test for how sparse they lie."""
    if span <= _MASK_SLOTS_PER_ENTRY * values.size:
        seen = SCRATCH.mask(span)
        seen[values] = True
        return int(np.count_nonzero(seen)) != values.size
    if span <= _MAX_STAMP_SLOTS:
        # A slot named twice keeps one of the positions that named it (NumPy does not say
        # which), so the other position reads back a value not its own.
        stamps, positions = SCRATCH.stamps(span, values.size)
        stamps[values] = positions
        return not np.array_equal(stamps[values], positions)
    return sorted_duplicates(values)


def sorted_duplicates(values: np.ndarray) -> bool:
    """Whether ``values`` repeat any, by sorting (any values, negative ones too)."""
    # np.sort and one comparison: np.unique costs several times that.
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())
