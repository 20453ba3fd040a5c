"""Copy streams and tickets: one H2D and one D2H stream, ordered by events.

Every submission returns a :class:`Ticket`. Ordering against the engine's compute
stream uses events only: page-out makes its stream wait on the producer's event
before reading, page-in consumers wait on the ticket's event. The host blocks only
in :meth:`CopyStreams.wait` and :meth:`CopyStreams.drain`.

Leases handed to a ticket belong to it until its copy has really finished, even
when it was cancelled earlier (the ticket is then a CANCELLING tombstone), so
host memory is never reused under a running DMA.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from kvcore.direction import Direction
from kvcore.pinned import Lease


class TicketState(str, Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    # Cancelled while its copy still runs: its leases stay owned until it finishes.
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


_FINISHED = (TicketState.DONE, TicketState.CANCELLED)


@dataclass(eq=False)
class Ticket:
    """One submitted copy. ``error`` holds the exception of a work callable that raised."""

    id: int
    generation: int
    direction: Direction
    nbytes: int
    state: TicketState
    event: Any = None
    leases: list[Lease] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        """The copy finished and was not cancelled: its result may be used."""
        return self.state is TicketState.DONE


class StaleTicketError(RuntimeError):
    """A ticket from a generation that :meth:`CopyStreams.drain` has closed."""


@dataclass(frozen=True)
class DrainReport:
    completed: int
    cancelled: int
    leases_released: int
    bytes: int


class CopyBackend(Protocol):
    """Streams and events of one kind of device."""

    name: str

    def stream(self, direction: Direction) -> Any: ...

    def record(self, stream: Any) -> Any:
        """A new event, recorded on ``stream`` after the work issued so far."""
        ...

    def query(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work issued later on ``stream`` starts only after ``event``; the host does not block."""
        ...

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        """Call ``fn`` so that the copies it issues go to ``stream``."""
        ...


@dataclass(frozen=True)
class CpuStream:
    name: str


class _CompletedEvent:
    def __repr__(self) -> str:
        return "CompletedEvent"


COMPLETED = _CompletedEvent()


class CpuSyncBackend:
    """Runs work at once; every event is complete when recorded."""

    name = "cpu-sync"

    def __init__(self) -> None:
        self._streams: dict[Hashable, CpuStream] = {}

    def stream(self, direction: Hashable) -> CpuStream:
        key = str(direction.value if isinstance(direction, Direction) else direction)
        return self._streams.setdefault(key, CpuStream(key))

    def record(self, stream: Any) -> _CompletedEvent:
        return COMPLETED

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def release(self, event: Any) -> None:
        """Its events are one shared constant: nothing to reuse."""


class ManualEvent:
    """Completes when its stream's queue reaches it."""

    __slots__ = ("done", "stream")

    def __init__(self, stream: ManualStream) -> None:
        self.stream = stream
        self.done = False

    def __repr__(self) -> str:
        return f"ManualEvent({self.stream.name}, done={self.done})"


@dataclass
class _Op:
    seq: int
    fn: Callable[[], None] | None = None
    records: ManualEvent | None = None
    waits_for: ManualEvent | None = None


class ManualStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[_Op] = deque()

    def __repr__(self) -> str:
        return f"ManualStream({self.name}, {len(self.queue)} queued)"


class ManualCpuBackend:
    """A CPU stand-in for a GPU, for tests of in-flight states.

    Work is queued per stream and runs only when the test calls :meth:`complete`,
    FIFO per stream; a stream that waits on an unfinished event runs nothing.
    Events complete when their stream reaches them. Any hashable names a stream,
    so a test can model the engine's compute stream next to the copy streams. An
    exception from a work callable propagates from the call that ran it.
    """

    name = "manual-cpu"

    def __init__(self) -> None:
        self._streams: dict[Hashable, ManualStream] = {}
        self._seq = itertools.count()

    def stream(self, direction: Hashable) -> ManualStream:
        key = str(direction.value if isinstance(direction, Direction) else direction)
        if key not in self._streams:
            self._streams[key] = ManualStream(key)
        return self._streams[key]

    def record(self, stream: ManualStream) -> ManualEvent:
        event = ManualEvent(stream)
        stream.queue.append(_Op(next(self._seq), records=event))
        self._settle()
        return event

    def query(self, event: ManualEvent) -> bool:
        return event.done

    def synchronize(self, event: ManualEvent) -> None:
        """Run exactly the queued work that ``event`` depends on."""
        while not event.done:
            stream = event.stream
            while (head := stream.queue[0]).waits_for is not None:
                stream = head.waits_for.stream
            self._run_head(stream)

    def wait_event(self, stream: ManualStream, event: Any) -> None:
        if not isinstance(event, ManualEvent):
            raise TypeError(f"ManualCpuBackend cannot wait on {event!r}")
        stream.queue.append(_Op(next(self._seq), waits_for=event))
        self._settle()

    def run_on(self, stream: ManualStream, fn: Callable[[], None]) -> None:
        stream.queue.append(_Op(next(self._seq), fn=fn))

    def release(self, event: ManualEvent) -> None:
        """Each record makes a new event here: nothing to reuse."""

    def pending(self, stream: ManualStream | None = None) -> int:
        """Work items queued on ``stream`` (all streams if None) that have not run."""
        streams = self._streams.values() if stream is None else [stream]
        return sum(op.fn is not None for s in streams for op in s.queue)

    def complete(self, n: int = 1, *, stream: ManualStream | None = None) -> int:
        """Run up to ``n`` work items, oldest runnable first; returns how many ran."""
        ran = 0
        while ran < n:
            candidates = self._streams.values() if stream is None else [stream]
            ready = [s for s in candidates if s.queue and s.queue[0].fn is not None]
            if not ready:
                break
            self._run_head(min(ready, key=lambda s: s.queue[0].seq))
            ran += 1
        return ran

    def complete_all(self) -> int:
        return self.complete(n=self.pending())

    def _run_head(self, stream: ManualStream) -> None:
        fn = stream.queue.popleft().fn
        assert fn is not None
        try:
            fn()
        finally:
            self._settle()

    def _settle(self) -> None:
        """Pass every event record and satisfied wait at the head of a queue."""
        progress = True
        while progress:
            progress = False
            for stream in self._streams.values():
                while stream.queue:
                    head = stream.queue[0]
                    if head.records is not None:
                        head.records.done = True
                    elif head.waits_for is None or not head.waits_for.done:
                        break
                    stream.queue.popleft()
                    progress = True


class CudaEventOps:
    """The event and stream calls that kvcore's CUDA stream backends share."""

    timing_events = False
    """Whether recorded events can time the work between them (costs a little)."""

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=self.timing_events)
        event.record(stream)
        return event

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def run_on(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()


class CudaBackend(CudaEventOps):
    """One torch.cuda.Stream per direction on ``device``; one torch.cuda.Event per ticket."""

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if device is None:
            device = torch.cuda.current_device()
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device)
        self._streams = {d: torch.cuda.Stream(device=self.device) for d in Direction}

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        return self._streams[Direction(direction)]


class CopyStreams:
    """Submits copies to per-direction streams and tracks them as tickets. Thread-safe."""

    def __init__(self, backend: CopyBackend | None = None) -> None:
        if backend is None:
            backend = CudaBackend() if torch.cuda.is_available() else CpuSyncBackend()
        self.backend: CopyBackend = backend
        self.generation = 0
        # Re-entrant: ManualCpuBackend may run work callables while drain holds it.
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._outstanding: dict[int, Ticket] = {}
        self._owned: set[Lease] = set()

    @property
    def outstanding(self) -> list[Ticket]:
        """Tickets whose copy has not been seen to finish (in flight or tombstones)."""
        with self._lock:
            return list(self._outstanding.values())

    @property
    def in_flight_bytes(self) -> int:
        with self._lock:
            return sum(t.nbytes for t in self._outstanding.values())

    def submit(
        self,
        direction: Direction | str,
        work: Callable[[], None],
        *,
        nbytes: int,
        leases: Iterable[Lease] = (),
        wait_for: Any = None,
    ) -> Ticket:
        """Run ``work`` on the direction's stream after ``wait_for``; the ticket owns ``leases``.

        If ``work`` raises, the leases are released once whatever it issued has
        finished, the ticket ends CANCELLED, and the exception propagates.
        """
        direction = Direction(direction)
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        owned = list(leases)
        stream = self.backend.stream(direction)
        if wait_for is not None:
            self.backend.wait_event(stream, wait_for)
        self._claim(owned)
        ticket = Ticket(next(self._ids), -1, direction, nbytes, TicketState.IN_FLIGHT, leases=owned)
        try:
            self.backend.run_on(stream, lambda: self._run(ticket, work))
        except BaseException as exc:
            if ticket.error is None:
                ticket.error = exc
            ticket.state = TicketState.CANCELLING
            self._register(ticket, self.backend.record(stream))
            self.poll(ticket)
            raise
        self._register(ticket, self.backend.record(stream))
        return ticket

    def poll(self, ticket: Ticket) -> bool:
        """True once the copy finished; then its leases are released."""
        with self._lock:
            self._check_generation(ticket)
            if ticket.state in _FINISHED:
                return True
            if not self.backend.query(ticket.event):
                return False
            self._finish(ticket)
            return True

    def wait(self, ticket: Ticket) -> None:
        """Block the host until the copy finished (for page-in consumers that need it now)."""
        with self._lock:
            self._check_generation(ticket)
            if ticket.state in _FINISHED:
                return
            event = ticket.event
        self.backend.synchronize(event)
        self.poll(ticket)

    def make_stream_wait(self, ticket: Ticket, stream: Any) -> None:
        """Work issued later on ``stream`` sees the copy's result; the host does not block."""
        with self._lock:
            self._check_generation(ticket)
            if ticket.state in (TicketState.CANCELLING, TicketState.CANCELLED):
                raise RuntimeError(f"ticket {ticket.id} was cancelled; nothing to wait for")
            event = ticket.event
        self.backend.wait_event(stream, event)

    def cancel(self, ticket: Ticket) -> None:
        """Drop interest in the copy; its leases are released once it really finished."""
        with self._lock:
            self._check_generation(ticket)
            if ticket.state is TicketState.DONE:
                ticket.state = TicketState.CANCELLED
            elif ticket.state is TicketState.IN_FLIGHT:
                ticket.state = TicketState.CANCELLING
                if self.backend.query(ticket.event):
                    self._finish(ticket)

    def reap(self) -> int:
        """Finish every outstanding ticket whose copy completed; returns how many."""
        with self._lock:
            finished = [t for t in self._outstanding.values() if self.backend.query(t.event)]
            for ticket in finished:
                self._finish(ticket)
            return len(finished)

    def drain(self, *, cancel: bool = False) -> DrainReport:
        """Wait for every outstanding copy, release every lease, start a new generation.

        ``cancel`` marks in-flight tickets cancelled first. Tickets from before the
        drain raise StaleTicketError afterwards.
        """
        completed = cancelled = leases_released = drained_bytes = 0
        errors: list[BaseException] = []
        with self._lock:
            tickets = list(self._outstanding.values())
            if cancel:
                for ticket in tickets:
                    if ticket.state is TicketState.IN_FLIGHT:
                        ticket.state = TicketState.CANCELLING
            for ticket in tickets:
                self._synchronize_collecting(ticket, tickets, errors)
                leases_released += self._finish(ticket)
                drained_bytes += ticket.nbytes
                if ticket.state is TicketState.DONE:
                    completed += 1
                else:
                    cancelled += 1
            self.generation += 1
        if errors:
            raise errors[0]
        return DrainReport(completed, cancelled, leases_released, drained_bytes)

    def _synchronize_collecting(
        self, ticket: Ticket, tickets: list[Ticket], errors: list[BaseException]
    ) -> None:
        """Synchronize on ``ticket``; a failing work callable of ``tickets`` is noted, not fatal."""
        while True:
            try:
                self.backend.synchronize(ticket.event)
                return
            except Exception as exc:
                if not any(t.error is exc for t in tickets):
                    raise
                errors.append(exc)

    def _run(self, ticket: Ticket, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:
            ticket.error = exc
            raise

    def _claim(self, leases: list[Lease]) -> None:
        with self._lock:
            for lease in leases:
                if lease.released:
                    raise ValueError(f"{lease!r} cannot back a copy")
                if lease in self._owned:
                    raise ValueError(f"{lease!r} already backs an outstanding copy")
            if len(set(leases)) != len(leases):
                raise ValueError("the same lease is listed twice")
            self._owned.update(leases)

    def _register(self, ticket: Ticket, event: Any) -> None:
        with self._lock:
            ticket.event = event
            ticket.generation = self.generation
            self._outstanding[ticket.id] = ticket

    def _finish(self, ticket: Ticket) -> int:
        """Mark a ticket whose copy completed finished; returns the leases it released."""
        if ticket.state is TicketState.IN_FLIGHT and ticket.error is None:
            ticket.state = TicketState.DONE
        else:
            ticket.state = TicketState.CANCELLED
        del self._outstanding[ticket.id]
        self._owned.difference_update(ticket.leases)
        freed_elsewhere = [lease for lease in ticket.leases if lease.released]
        for lease in ticket.leases:
            if not lease.released:
                lease.release()
        if freed_elsewhere:
            raise RuntimeError(
                f"ticket {ticket.id}: {freed_elsewhere!r} were released while the ticket owned them"
            )
        return len(ticket.leases)

    def _check_generation(self, ticket: Ticket) -> None:
        if ticket.generation != self.generation:
            raise StaleTicketError(
                f"ticket {ticket.id} is from generation {ticket.generation}; the streams were "
                f"drained and are at generation {self.generation}"
            )
