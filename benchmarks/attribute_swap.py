"""Attributes set for the length of a block and then put back as they were: a bench's
stand-ins on modules and classes it does not own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_ABSENT = object()
"""What an owner's own namespace held for a name it did not hold (inherited or absent)."""


@contextmanager
def swapped_attributes() -> Iterator[Callable[[Any, str, Any], None]]:
    """A ``swap(owner, name, value)`` for the block: each name's own value before its first
    swap is put back at the end (a name the owner did not hold itself is deleted again, so
    an inherited attribute shows through as before)."""
    before: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        before.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    try:
        yield swap
    finally:
        for owner, name, own in reversed(before):
            if own is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
