"""Wall-clock time inside chosen functions while a switch is on: where one call's host time
goes, on the machine that runs it.

cProfile hooks every Python call, which inflates a path of many small calls several times
over and shifts the shares towards Python; this times only the functions named, each with
two ``perf_counter`` reads, so the rest runs at full speed and the total stays close to
the unprofiled one. Times are inclusive: a named function called from another named one
counts in both.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from benchmarks.attribute_swap import swapped_attributes


@dataclass
class PhaseTimes:
    """Seconds and calls per target, gathered while :attr:`on` is set."""

    on: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, target: str, seconds: float) -> None:
        """One call of ``target`` that took ``seconds``."""
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds
        self.calls[target] = self.calls.get(target, 0) + 1

    def table(self, per: int, targets: Sequence[str]) -> str:
        """The targets in the order given, as microseconds and calls per ``per`` (requests)."""
        lines = [f"{'incl us':>9} {'calls':>7}  function"]
        for target in targets:
            seconds = self.seconds.get(target, 0.0)
            calls = self.calls.get(target, 0)
            lines.append(f"{seconds * 1e6 / per:9.1f} {calls / per:7.1f}  {target}")
        return "\n".join(lines) + "\n"


def _owner_and_name(target: str) -> tuple[Any, str]:
    """The object whose attribute ``target`` ("package.module:Name" or
    "package.module:Class.name") names, and the attribute."""
    module_name, _, path = target.partition(":")
    if not path:
        raise ValueError(f"a target is 'module:attribute', got {target!r}")
    owner: Any = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise ValueError(f"{target}: {module_name} has no {path}")
    return owner, name


def _timed(function: Callable[..., Any], target: str, times: PhaseTimes) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not times.on:
            return function(*args, **kwargs)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            times.add(target, time.perf_counter() - started)

    return timed


@contextmanager
def timing(targets: Sequence[str]) -> Iterator[PhaseTimes]:
    """Each target wrapped for as long as the block runs, then restored. A target is looked
    up where its callers find it: a function imported by name into another module is
    named there. Set ``on`` around what should count."""
    times = PhaseTimes()
    with swapped_attributes() as swap:
        for target in targets:
            owner, name = _owner_and_name(target)
            own = vars(owner).get(name)
            if isinstance(own, (staticmethod, classmethod)):
                raise ValueError(f"{target}: static and class methods are not timed")
            swap(owner, name, _timed(getattr(owner, name), target, times))
        yield times
