"""A seeded host-slot churn trace, replayable on any slot allocator.

The trace imitates a prefix cache in front of a host pool: fill the pool with
request prefixes, evict random ones (whole, or their newest pages, the way a
radix tree drops leaves first), refill, then a long stretch of mixed
allocations and evictions that keeps occupancy at or under a ceiling. The same
trace drives the benchmark and the adapters' tests, so the stock allocator and
kvcore's can be compared step by step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcore.runs import find_runs


class SlotAllocator(Protocol):
    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


@dataclass(frozen=True)
class Alloc:
    key: int
    size: int


@dataclass(frozen=True)
class Evict:
    """Free allocation ``key`` from slot ``keep`` on (0 frees all of it)."""

    key: int
    keep: int


Op = Alloc | Evict


@dataclass(frozen=True)
class ChurnTrace:
    slots: int
    page_size: int
    ops: tuple[Op, ...]


def make_trace(
    slots: int = 1 << 20,
    *,
    page_size: int = 1,
    mixed_ops: int = 10_000,
    max_occupancy: float = 0.9,
    max_request_pages: int = 4096,
    seed: int = 0,
) -> ChurnTrace:
    """Fill, evict random prefixes, refill, then ``mixed_ops`` mixed operations.

    Allocation succeeds exactly when enough slots are free, whatever the
    allocator, so occupancy can be tracked here without one. A few allocations
    are sized to fail, to check that both allocators refuse them alike.
    """
    if slots % page_size:
        raise ValueError(f"slots {slots} is not a multiple of page_size {page_size}")
    rng = random.Random(seed)
    total_pages = slots // page_size
    ceiling = int(total_pages * max_occupancy)
    max_pages = max(1, min(max_request_pages, total_pages // 8))
    live: dict[int, int] = {}
    ops: list[Op] = []
    used = 0
    next_key = 0

    def request_pages() -> int:
        # Mostly short prefixes, some long: a log-uniform size.
        return max(1, min(max_pages, int(2 ** rng.uniform(0, max_pages.bit_length()))))

    def alloc(pages: int) -> None:
        nonlocal used, next_key
        ops.append(Alloc(next_key, pages * page_size))
        if used + pages <= total_pages:
            live[next_key] = pages
            used += pages
        next_key += 1

    def evict_one() -> None:
        nonlocal used
        key = rng.choice(list(live))
        pages = live[key]
        keep = rng.randrange(pages) if rng.random() < 0.3 else 0
        ops.append(Evict(key, keep * page_size))
        used -= pages - keep
        if keep:
            live[key] = keep
        else:
            del live[key]

    def fill() -> None:
        while True:
            pages = request_pages()
            if used + pages > ceiling:
                return
            alloc(pages)

    fill()
    while live and used > ceiling // 2:
        evict_one()
    fill()
    for _ in range(mixed_ops):
        if rng.random() < 0.01:
            alloc(total_pages - used + 1)
            continue
        pages = request_pages()
        if used + pages <= ceiling and (not live or rng.random() < 0.5):
            alloc(pages)
        elif live:
            evict_one()
    return ChurnTrace(slots, page_size, tuple(ops))


@dataclass(frozen=True)
class ReplayResult:
    outcomes: tuple[bool, ...]
    available: tuple[int, ...]
    allocations: int
    one_run_allocations: int
    seconds: float

    @property
    def one_run_fraction(self) -> float:
        return self.one_run_allocations / self.allocations if self.allocations else 1.0

    @property
    def ops_per_s(self) -> float:
        return len(self.outcomes) / self.seconds if self.seconds > 0 else float("inf")


def replay(
    trace: ChurnTrace,
    allocator: SlotAllocator,
    *,
    after_each: Callable[[int, SlotAllocator], None] | None = None,
) -> ReplayResult:
    """Run ``trace`` on ``allocator``; only the allocator's own calls are timed.

    ``outcomes[i]`` is whether op ``i`` succeeded (evictions always do);
    ``available[i]`` is ``available_size()`` right after it.
    """
    live: dict[int, torch.Tensor] = {}
    outcomes: list[bool] = []
    available: list[int] = []
    allocations = one_run = 0
    seconds = 0.0
    for step, op in enumerate(trace.ops):
        if isinstance(op, Alloc):
            start = time.perf_counter()
            slots = allocator.alloc(op.size)
            seconds += time.perf_counter() - start
            outcomes.append(slots is not None)
            if slots is not None:
                live[op.key] = slots
                allocations += 1
                one_run += find_runs(slots).count <= 1
        else:
            slots = live.pop(op.key, None)
            if slots is None:
                # The allocation this eviction refers to failed here: a divergence the
                # caller sees in ``outcomes``.
                outcomes.append(False)
                available.append(allocator.available_size())
                continue
            if op.keep:
                live[op.key] = slots[: op.keep]
            start = time.perf_counter()
            allocator.free(slots[op.keep :])
            seconds += time.perf_counter() - start
            outcomes.append(True)
        available.append(allocator.available_size())
        if after_each is not None:
            after_each(step, allocator)
    return ReplayResult(tuple(outcomes), tuple(available), allocations, one_run, seconds)
