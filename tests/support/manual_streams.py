"""ManualStreams: :class:`kvcore.streams.NamedStreams` on a CPU, run only when a test says.

It stands in for a GPU in tests of work in flight: work is queued per stream and runs
only when the test calls :meth:`ManualStreams.complete`, FIFO per stream; a stream that
waits on an unfinished event runs nothing. Events complete when their stream reaches
them. Any hashable names a stream, so a test can model the engine's compute stream next
to the copy streams. An exception from a work callable propagates from the call that
ran it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any


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


class ManualStreams:
    def __init__(self) -> None:
        self._streams: dict[str, ManualStream] = {}
        self._seq = itertools.count()

    def stream(self, name: Hashable) -> ManualStream:
        key = str(name)
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
            raise TypeError(f"ManualStreams cannot wait on {event!r}")
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
