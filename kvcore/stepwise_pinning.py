"""A host pool pinned in steps of slots: the first steps before the engine starts, the rest
on a background thread.

Registering host memory with the GPU driver runs at one rate on one thread, and more
threads do not speed it up (docs/operations.md, "Pinned host memory"), so a pool of
hundreds of GiB costs the engine's start-up seconds to tens of seconds even once its pages
are in. Pinned in steps, the engine can start once a first share is in. A step registers
one range of slots in every part of the buffer (in SGLang's ``layer_first`` layout a slot
has a row in every layer), so once it is in, those slots are pinned wherever their rows
are. The caller hands out only slots below :attr:`StepwisePinning.ready_slots`, which grows
step by step: no copy may touch a slot above it.

Every step ends on a memory page of every part (two registrations never share a page) and
on the pool's own pages. A step that fails is taken back whole: the registered steps stay,
the rest of the pool is never handed out, and :attr:`StepwisePinning.failure` says why.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.host_pinning import PAGE, HostRegistrar, format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotLayout:
    """A contiguous buffer seen as ``parts`` blocks, each holding one row of every slot."""

    address: int
    parts: int
    part_stride: int
    """Bytes from one part to the next."""
    slots: int
    slot_bytes: int
    """Bytes of one slot's row in one part."""

    @property
    def nbytes(self) -> int:
        return self.parts * self.slots * self.slot_bytes


@dataclass(frozen=True)
class PinStep:
    """One registration step: its ranges ``(address, bytes)``, and the slots ready once it
    and every step before it are in."""

    ranges: tuple[tuple[int, int], ...]
    ready_slots: int

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.ranges)


def slot_layout(buffer: torch.Tensor, slots: int) -> SlotLayout | None:
    """``buffer`` as parts of slot rows, where exactly one of its dimensions has ``slots``
    entries and the buffer is contiguous; None otherwise."""
    dims = tuple(buffer.shape)
    found = [i for i, extent in enumerate(dims) if extent == slots]
    if len(found) != 1 or not buffer.is_contiguous() or buffer.numel() == 0:
        return None
    at = found[0]
    slot_bytes = math.prod(dims[at + 1 :]) * buffer.element_size()
    return SlotLayout(
        buffer.data_ptr(), math.prod(dims[:at]), slots * slot_bytes, slots, slot_bytes
    )


def slot_unit(layout: SlotLayout, page_size: int) -> int | None:
    """The fewest slots a step may end on: whole pool pages of ``page_size`` slots whose
    rows end on a memory page in every part; None where the parts themselves do not start
    on memory pages (a step could then share a page with another)."""
    if layout.address % PAGE or layout.part_stride % PAGE:
        return None
    return math.lcm(page_size, PAGE // math.gcd(PAGE, layout.slot_bytes))


def slot_steps(
    layout: SlotLayout, page_size: int, first_bytes: int, step_bytes: int
) -> tuple[PinStep, ...] | None:
    """The pool's registration steps: the first holds at least ``first_bytes`` of the pool,
    each later one about ``step_bytes``, the last ends at the pool's end; None where no step
    can end on a memory page (:func:`slot_unit`)."""
    unit = slot_unit(layout, page_size)
    if unit is None:
        return None
    per_slot = layout.parts * layout.slot_bytes
    first = round_up(max(1, -(-first_bytes // per_slot)), unit)
    step = round_up(max(1, step_bytes // per_slot), unit)
    ends = [min(first, layout.slots)]
    while ends[-1] < layout.slots:
        ends.append(min(ends[-1] + step, layout.slots))
    begins = [0, *ends[:-1]]
    return tuple(
        PinStep(_step_ranges(layout, begin, end), end)
        for begin, end in zip(begins, ends, strict=True)
    )


def range_steps(
    slot_ranges: Sequence[tuple[int, int]], first_bytes: int, step_bytes: int
) -> tuple[PinStep, ...]:
    """Registration steps over slots that each have a range of their own (``(address,
    bytes)`` of slot i, in slot order, no two sharing a memory page): the first step holds
    at least ``first_bytes``, each later one about ``step_bytes``, whole slots each."""
    if not slot_ranges:
        raise ValueError("nothing to pin: no slots")
    steps: list[PinStep] = []
    begin, held, goal = 0, 0, first_bytes
    for end, (_, nbytes) in enumerate(slot_ranges, start=1):
        held += nbytes
        if held >= goal or end == len(slot_ranges):
            steps.append(PinStep(tuple(slot_ranges[begin:end]), end))
            begin, held, goal = end, 0, step_bytes
    return tuple(steps)


def round_up(value: int, unit: int) -> int:
    """``value`` rounded up to a multiple of ``unit``."""
    return -(-value // unit) * unit


def _step_ranges(layout: SlotLayout, begin: int, end: int) -> tuple[tuple[int, int], ...]:
    """Slots ``[begin, end)`` in every part, neighbouring ranges joined."""
    size = (end - begin) * layout.slot_bytes
    ranges: list[tuple[int, int]] = []
    for part in range(layout.parts):
        address = layout.address + part * layout.part_stride + begin * layout.slot_bytes
        if ranges and ranges[-1][0] + ranges[-1][1] == address:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + size)
        else:
            ranges.append((address, size))
    return tuple(ranges)


def crosses_step(slots: np.ndarray, ends: np.ndarray) -> bool:
    """Whether two neighbouring entries of ``slots`` are neighbouring slots on either side
    of a step's end (``ends``, sorted): a copy of that run would cross two registrations."""
    if len(slots) < 2 or not len(ends):
        return False
    after = slots[1:]
    joined = after[after == slots[:-1] + 1]
    return bool(np.isin(joined, ends).any())


class StepwisePinning:
    """Registers ``steps`` in order: :meth:`pin_first` on the caller's thread, :meth:`start`
    the rest on a daemon thread, calling ``on_ready`` after each of those with no lock
    held; ``memory``, what owns the ranges, is kept alive with it.

    ``prepare(step, at_once)`` readies a step's memory (faults its pages in) before its
    registration; a failure there fails the step. :meth:`pin_first` prepares each step just
    before registering it (``at_once`` 1). The thread prepares up to ``prepare_ahead``
    steps at once, ahead of the one it registers (``at_once`` that many, so that the
    callee can share its threads among them): faulting one step's pages is capped where
    they lie in one file (a ``/dev/shm`` file's page-cache inserts are serialised), and
    registering a step goes on while later ones fault."""

    def __init__(
        self,
        steps: Sequence[PinStep],
        registrar: HostRegistrar,
        *,
        on_ready: Callable[[], None] | None = None,
        name: str = "host pool",
        memory: object = None,
        prepare: Callable[[PinStep, int], None] | None = None,
        prepare_ahead: int = 1,
    ) -> None:
        if not steps:
            raise ValueError("nothing to pin: no steps")
        if prepare_ahead < 1:
            raise ValueError(f"prepare_ahead must be at least 1, not {prepare_ahead}")
        self.steps = tuple(steps)
        self.step_ends = np.array([step.ready_slots for step in self.steps[:-1]], dtype=np.int64)
        """Where one registration ends and the next begins, in slots, sorted."""
        self.registered: list[tuple[int, int]] = []
        """Every range registered and not taken back, in order (what unregistering needs)."""
        self.lock = threading.Lock()
        """Held by callers that read :attr:`ready_slots` and act on it as one step."""
        self.failure: str | None = None
        self._registrar = registrar
        # What owns the memory (a tensor, a mapping): it must outlive every registration.
        self._memory = memory
        self._on_ready = on_ready
        self._prepare = prepare
        self._prepare_ahead = prepare_ahead
        self._name = name
        self._next = 0
        self._ready = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()

    @property
    def ready_slots(self) -> int:
        """Slots ``[0, ready_slots)`` are pinned in every part."""
        return self._ready

    @property
    def done(self) -> bool:
        """Whether every step is in."""
        return self._next == len(self.steps)

    def pin_first(self, count: int = 1) -> None:
        """Register the first ``count`` steps now; on a failure take back what this call
        registered and raise it."""
        if self._next:
            raise RuntimeError("pin_first runs once, before start")
        try:
            for _ in range(min(count, len(self.steps))):
                self._pin_next()
        except Exception:
            self.unpin()
            raise

    def start(self) -> None:
        """Register the remaining steps on a daemon thread."""
        if self.done:
            self._finished.set()
            return
        self._thread = threading.Thread(
            target=self._run, name=f"kvcore-pin-{self._name}", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has ended; whether it has."""
        return self._thread is None or self._finished.wait(timeout)

    def stop(self) -> None:
        """Stop after the step in progress and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def unpin(self) -> None:
        """Unregister every range registered (the thread stopped first), last first."""
        self.stop()
        while self.registered:
            address, _ = self.registered.pop()
            self._registrar.unregister(address)
        self._ready = self._next = 0

    def _run(self) -> None:
        pool = None
        if self._prepare is not None:
            pool = ThreadPoolExecutor(self._prepare_ahead, f"kvcore-prepare-{self._name}")
        prepared: dict[int, Future[None]] = {}
        try:
            while not self.done and not self._stop.is_set():
                try:
                    self._pin_next(self._prepared_ahead(pool, prepared))
                except Exception as exc:
                    self.failure = self._failed(exc)
                    logger.error("kvcore: %s", self.failure)
                    return
                if self._on_ready is not None:
                    try:
                        self._on_ready()
                    except Exception as exc:
                        # The step is pinned, its slots not handed out: stop here.
                        self.failure = f"handing out the {self._name}'s pinned slots failed: {exc}"
                        logger.exception("kvcore: %s", self.failure)
                        return
        finally:
            # No preparation may outlive the thread: stop() is followed by freeing the memory.
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self._finished.set()

    def _prepared_ahead(
        self, pool: ThreadPoolExecutor | None, prepared: dict[int, Future[None]]
    ) -> Future[None] | None:
        """The next step's preparation, running or done, with the following ones started
        on ``pool`` up to ``prepare_ahead`` in all; None where there is no pool."""
        if pool is None or self._prepare is None:
            return None
        for index in range(self._next, min(self._next + self._prepare_ahead, len(self.steps))):
            if index not in prepared:
                prepared[index] = pool.submit(self._prepare, self.steps[index], self._prepare_ahead)
        return prepared.pop(self._next)

    def _pin_next(self, prepared: Future[None] | None = None) -> None:
        """Register the next step whole (once ``prepared``, its preparation, is done; else
        prepared here), or take back the part of it that got in."""
        step = self.steps[self._next]
        done = len(self.registered)
        if prepared is not None:
            prepared.result()
        elif self._prepare is not None:
            self._prepare(step, 1)
        try:
            for address, size in step.ranges:
                self._registrar.register(address, size)
                self.registered.append((address, size))
        except Exception:
            while len(self.registered) > done:
                self._registrar.unregister(self.registered.pop()[0])
            raise
        self._next += 1
        with self.lock:
            self._ready = step.ready_slots

    def _failed(self, exc: Exception) -> str:
        pinned = sum(size for _, size in self.registered)
        total = sum(step.nbytes for step in self.steps)
        return (
            f"pinning the {self._name} stopped at {format_bytes(pinned)} of "
            f"{format_bytes(total)} ({exc}); it keeps the {self._ready} slots pinned so far "
            "and never hands out the rest. Raise the locked-memory limit (`ulimit -l "
            "unlimited`, docker's --ulimit memlock=-1) or ask for a smaller pool"
        )
