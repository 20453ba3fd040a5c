"""kvcore's async core: named copy streams, a pool of events, jobs reported in order.

The vLLM handler queues each job's copies on a stream of its own (:class:`OrderedJobs`):
a job waits, on the GPU, for the work queued on the engine's compute stream when it was
submitted, and is reported finished once, in submission order. SGLang's adapter uses none
of this: it copies on the streams SGLang hands it, which already order its copies against
the model's.

:class:`CudaStreams` gives the streams and events on a GPU; :class:`CpuSyncStreams` runs
work at once, for hosts without one. The host blocks only in :meth:`OrderedJobs.wait`,
:meth:`OrderedJobs.settle` and :meth:`OrderedJobs.drain`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from kvcore.issuer import Issued, Issuer

T = TypeVar("T")


class NamedStreams(Protocol):
    """Streams by name, and the events that order them."""

    def stream(self, name: Hashable) -> Any: ...

    def record(self, stream: Any) -> Any:
        """An event, recorded on ``stream`` after the work issued there so far."""
        ...

    def query(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work issued later on ``stream`` starts only after ``event``; the host does not block."""
        ...

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        """Call ``fn`` so that the copies it issues go to ``stream``."""
        ...

    def release(self, event: Any) -> None:
        """Nothing will query, wait on or time ``event`` again: it may be recorded anew."""
        ...


def highest_priority() -> int:
    """The highest (most urgent) CUDA stream priority torch can create a stream with."""
    # A static method at run time, typed as an instance method in torch's stubs.
    _least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    return int(greatest)


class CudaStreams:
    """One torch.cuda.Stream per name on ``device``; events that time the work between them."""

    def __init__(self, device: torch.device, *, priority: int = 0) -> None:
        self.device = device
        self.priority = priority
        """The streams' CUDA priority (lower runs first; 0 is torch's default)."""
        self._streams: dict[str, torch.cuda.Stream] = {}
        # Released events, recorded again instead of creating (and later destroying) new
        # ones: three per job otherwise, each a driver call both ways.
        self._free: list[torch.cuda.Event] = []

    def stream(self, name: Hashable) -> torch.cuda.Stream:
        key = str(name)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=self.device, priority=self.priority)
        return self._streams[key]

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        try:
            event = self._free.pop()
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def release(self, event: torch.cuda.Event) -> None:
        self._free.append(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def run_on(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()


@dataclass(frozen=True)
class CpuStream:
    name: str


class _CompletedEvent:
    def __repr__(self) -> str:
        return "CompletedEvent"


COMPLETED = _CompletedEvent()


class CpuSyncStreams:
    """Runs work at once; every event is complete when recorded."""

    def __init__(self) -> None:
        self._streams: dict[str, CpuStream] = {}

    def stream(self, name: Hashable) -> CpuStream:
        key = str(name)
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


@dataclass(slots=True)
class Job:
    job_id: int
    nbytes: int
    start: Any
    end: Any
    planned_s: float
    issued: Issued | None = None
    """Where an :class:`~kvcore.issuer.Issuer` issues the job: ``start`` and ``end`` are
    set once it has."""


class OrderedJobs:
    """Jobs queued on the stream ``name`` of ``streams``, reported finished in submission order.

    ``compute_stream`` returns the stream whose queued work each job waits for. One stream
    runs them all, so a job has finished once its end event has, and so have those before it.
    Given an ``issuer``, each job's copies are issued on its thread (:meth:`submit` returns
    once the job's wait for the compute stream is captured); a job whose issuing raised is
    not reported but kept for :meth:`take_failed`.
    """

    def __init__(
        self,
        streams: NamedStreams,
        name: Hashable,
        compute_stream: Callable[[], Any],
        issuer: Issuer | None = None,
    ) -> None:
        self._streams = streams
        self._stream = streams.stream(name)
        self._compute_stream = compute_stream
        self._issuer = issuer
        self.queued: deque[Job] = deque()
        """The jobs not yet reported, oldest first: the same deque for the queue's life, for
        callers to test (``if jobs.queued``, no call) and never to change."""
        self._failed: list[tuple[int, BaseException]] = []

    @property
    def issuer(self) -> Issuer | None:
        return self._issuer

    def __len__(self) -> int:
        return len(self.queued)

    def __iter__(self) -> Iterator[Job]:
        return iter(self.queued)

    def submit(
        self, job_id: int, nbytes: int, work: Callable[[], None], planned_s: float = 0.0
    ) -> None:
        """Queue the copies ``work`` issues, after the work queued on the compute stream now.

        ``planned_s``: host seconds the caller spent on the job before this call, added to
        the time it is reported with, so that the time runs from the job's hand-over: exact
        where the stream is idle at submission, an upper bound where an earlier job still
        runs on it (the planning then overlapped that job).
        If ``work`` raises, no job is queued and the exception propagates; what it issued
        before raising stays queued on the stream (:meth:`settle` waits for it).
        """
        # A job may read what the compute stream is still writing, or overwrite what it
        # has yet to read.
        ready = self._streams.record(self._compute_stream())
        job = Job(job_id, nbytes, None, None, planned_s)
        if self._issuer is not None:
            # Issued as it would have been here: under this thread's inference and grad
            # modes (an engine's KV tensors made under inference mode take in-place writes
            # only there), which torch keeps per thread.
            inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

            def under_modes() -> None:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    work()

            job.issued = self._issuer.submit(lambda: self._issue(job, ready, under_modes))
            self.queued.append(job)
            return
        self._issue(job, ready, work)
        self.queued.append(job)

    def _issue(self, job: Job, ready: Any, work: Callable[[], None]) -> None:
        """``job``'s wait for the compute stream as it was at submission (``ready``), then
        its copies between its start and end events: here, or on the issuer's thread."""
        streams, stream = self._streams, self._stream
        try:
            streams.wait_event(stream, ready)
        finally:
            # The wait holds the event's state as of now, so the event can be recorded again.
            streams.release(ready)
        start = streams.record(stream)
        try:
            streams.run_on(stream, work)
            end = streams.record(stream)
        except BaseException:
            streams.release(start)
            raise
        job.start, job.end = start, end

    def finished(self, report: Callable[[int, int, float | None], T]) -> list[T]:
        """``report(job_id, nbytes, seconds)`` for each job finished since the last call, in
        submission order; ``seconds`` is the copies' GPU time and the job's planning (see
        :meth:`submit`), None where events do not time. Where asking a job's event raises,
        the jobs before it are reported and the next call raises."""
        jobs, streams = self.queued, self._streams
        reports: list[T] = []
        while jobs:
            head = jobs[0]
            if not self._issued(head):
                break
            if head.end is None:  # its issuing raised: off the queue now
                continue
            try:
                if not streams.query(head.end):
                    break
            except BaseException:
                if reports:
                    # The next call asks the same job again and raises there.
                    return reports
                raise
            job = jobs.popleft()
            elapsed = getattr(job.start, "elapsed_time", None)
            seconds = None if elapsed is None else elapsed(job.end) * 1e-3 + job.planned_s
            reports.append(report(job.job_id, job.nbytes, seconds))
            streams.release(job.start)
            streams.release(job.end)
        return reports

    def _issued(self, job: Job, *, block: bool = False) -> bool:
        """Whether ``job``'s copies have all been issued (waiting for that where ``block``);
        one whose issuing raised is taken off the queue for :meth:`take_failed`."""
        issued = job.issued
        if issued is None:
            return True
        if block:
            issued.wait()
        elif not issued.done:
            return False
        if issued.error is not None and job.end is None:
            self.queued.remove(job)
            self._failed.append((job.job_id, issued.error))
        return True

    def take_failed(self) -> list[tuple[int, BaseException]]:
        """The jobs whose issuing raised, with what it raised, since the last call: never
        reported by :meth:`finished`; what they issued before raising stays queued on the
        stream (:meth:`settle` waits for it)."""
        failed, self._failed = self._failed, []
        return failed

    def drop_oldest(self) -> int:
        """Forget the oldest job (its copy failed); its id."""
        job = self.queued.popleft()
        self._streams.release(job.start)
        self._streams.release(job.end)
        return job.job_id

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until the jobs named in ``job_ids`` have finished; other ids are ignored."""
        for job in reversed(self.queued):
            if job.job_id in job_ids:
                # The latest one named: those before it are issued and finish first.
                self._issued(job, block=True)
                for earlier in list(self.queued):
                    self._issued(earlier)
                    if earlier is job:
                        break
                if job.end is not None:
                    self._streams.synchronize(job.end)
                return

    def ahead(self, work: Callable[[], T]) -> T:
        """``work``'s result, the copies it issues queued on the jobs' stream now, ahead of
        the next job's wait for the compute stream: for copies that touch nothing the
        compute stream's work reads or writes (a load's DMAs into kvcore's own staging)."""
        if self._issuer is not None:
            # "Now" in the stream's order: after every job handed to the issuer so far.
            self._issuer.idle()
        done: list[T] = []
        self._streams.run_on(self._stream, lambda: done.append(work()))
        return done[0]

    def settle(self) -> None:
        """Block until everything queued on the stream has run, a failed job's part too."""
        streams = self._streams
        if self._issuer is not None:
            self._issuer.idle()
        settled = streams.record(self._stream)
        streams.synchronize(settled)
        streams.release(settled)

    def drain(self) -> None:
        """Block until every job has finished, then forget them all (also when one failed:
        its error propagates and the jobs after it are not waited for)."""
        jobs, streams = self.queued, self._streams
        if self._issuer is not None:
            self._issuer.idle()
        try:
            while jobs:
                head = jobs[0]
                self._issued(head)
                if head.end is None:  # its issuing raised: off the queue now
                    continue
                streams.synchronize(head.end)
                job = jobs.popleft()
                streams.release(job.start)
                streams.release(job.end)
        finally:
            jobs.clear()
