"""kvcore.streams: jobs on one stream after the compute stream's work, reported in order."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvcore.streams import COMPLETED, CpuSyncStreams, OrderedJobs
from tests.support.manual_streams import ManualEvent, ManualStreams


class CountingStreams(ManualStreams):
    """Manual streams that know which events were recorded and not yet released; releasing
    one twice, or one they never recorded, raises KeyError."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[ManualEvent] = set()

    def record(self, stream: Any) -> ManualEvent:
        event = super().record(stream)
        self.live.add(event)
        return event

    def release(self, event: ManualEvent) -> None:
        self.live.remove(event)

    @property
    def held(self) -> int:
        return len(self.live)


@pytest.fixture
def streams() -> CountingStreams:
    return CountingStreams()


@pytest.fixture
def jobs(streams: CountingStreams) -> OrderedJobs:
    return OrderedJobs(streams, "copies", lambda: streams.stream("compute"))


def as_tuple(job_id: int, nbytes: int, seconds: float | None) -> tuple[int, int, float | None]:
    return job_id, nbytes, seconds


def appending(order: list[str], name: str) -> Callable[[], None]:
    return lambda: order.append(name)


def test_a_job_runs_after_the_compute_work_queued_when_it_was_submitted(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    compute = streams.stream("compute")
    streams.run_on(compute, appending(order, "model writes"))
    jobs.submit(1, 10, appending(order, "copy"))
    streams.run_on(compute, appending(order, "model writes more"))
    # The copy stream is held back until the earlier compute work has run.
    assert streams.complete(stream=streams.stream("copies")) == 0
    assert jobs.finished(as_tuple) == []
    jobs.wait({1})
    assert order == ["model writes", "copy"]
    assert jobs.finished(as_tuple) == [(1, 10, None)]


def test_jobs_are_reported_once_in_submission_order(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    for job_id in (7, 3, 5):
        jobs.submit(job_id, job_id * 100, lambda: None)
    assert len(jobs) == 3 and [job.job_id for job in jobs] == [7, 3, 5]
    assert jobs.finished(as_tuple) == []
    streams.complete(2)
    assert jobs.finished(as_tuple) == [(7, 700, None), (3, 300, None)]
    assert jobs.finished(as_tuple) == []
    streams.complete_all()
    assert jobs.finished(as_tuple) == [(5, 500, None)]
    assert len(jobs) == 0 and streams.held == 0


def test_queued_is_one_deque_that_holds_jobs_until_they_are_reported_or_drained(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    queued = jobs.queued
    assert not queued
    jobs.submit(1, 10, lambda: None)
    jobs.submit(2, 10, lambda: None)
    assert [job.job_id for job in queued] == [1, 2]
    streams.complete(1)
    jobs.finished(as_tuple)
    assert [job.job_id for job in queued] == [2]
    jobs.drain()
    assert not queued and jobs.queued is queued
    jobs.submit(3, 10, lambda: None)
    assert [job.job_id for job in queued] == [3]


def test_wait_runs_exactly_up_to_the_latest_named_job(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    for job_id, name in enumerate("abcd", start=10):
        jobs.submit(job_id, 1, appending(order, name))
    jobs.wait({99})  # no such job: nothing runs
    assert order == []
    jobs.wait({10, 12})
    assert order == ["a", "b", "c"]
    assert streams.pending() == 1
    assert [r[0] for r in jobs.finished(as_tuple)] == [10, 11, 12]


class IssuingStreams(CountingStreams):
    """As on a GPU: ``run_on`` calls the work at once, and the copies it issues
    (:meth:`issue`) queue on the stream."""

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def issue(self, stream: Any, fn: Callable[[], None]) -> None:
        super().run_on(stream, fn)


def test_a_failing_submission_queues_no_job_and_settle_waits_for_its_part() -> None:
    streams = IssuingStreams()
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"))
    copies = streams.stream("copies")
    order: list[str] = []
    jobs.submit(1, 1, lambda: streams.issue(copies, appending(order, "first")))
    held = streams.held

    def half_issued() -> None:
        streams.issue(copies, appending(order, "part of the second"))
        raise ValueError("planning broke")

    with pytest.raises(ValueError, match="planning broke"):
        jobs.submit(2, 1, half_issued)
    assert len(jobs) == 1 and streams.held == held
    assert order == []
    jobs.settle()
    assert order == ["first", "part of the second"]
    assert [r[0] for r in jobs.finished(as_tuple)] == [1]
    assert streams.held == 0


def test_settle_runs_everything_queued_but_reports_nothing(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    jobs.submit(1, 1, appending(order, "a"))
    jobs.submit(2, 1, appending(order, "b"))
    jobs.settle()
    assert order == ["a", "b"] and streams.pending() == 0
    assert [r[0] for r in jobs.finished(as_tuple)] == [1, 2]
    assert streams.held == 0


def test_drain_waits_for_every_job_and_releases_its_events(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    for job_id in range(3):
        jobs.submit(job_id, 1, appending(order, str(job_id)))
    jobs.drain()
    assert order == ["0", "1", "2"]
    assert len(jobs) == 0 and streams.held == 0
    assert jobs.finished(as_tuple) == []


def test_drain_raises_a_failed_copy_and_forgets_the_jobs_after_it(
    streams: CountingStreams, jobs: OrderedJobs
) -> None:
    order: list[str] = []

    def failing() -> None:
        raise RuntimeError("copy failed")

    jobs.submit(1, 1, appending(order, "first"))
    jobs.submit(2, 1, failing)
    jobs.submit(3, 1, appending(order, "third"))
    with pytest.raises(RuntimeError, match="copy failed"):
        jobs.drain()
    assert order == ["first"] and len(jobs) == 0
    assert jobs.finished(as_tuple) == []


class TimedEvent:
    """An event whose elapsed_time is the difference of fake timestamps, in ms."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: TimedEvent) -> float:
        return end.ms - self.ms


def test_timing_events_give_the_jobs_seconds() -> None:
    clock = iter([0.0, 1.0, 4.0, 0.0, 10.0, 10.5])

    class Timed(CpuSyncStreams):
        def record(self, stream: Any) -> Any:
            return TimedEvent(next(clock))

    streams = Timed()
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"))
    jobs.submit(1, 8, lambda: None)  # ready at 0 ms, start 1 ms, end 4 ms
    jobs.submit(2, 8, lambda: None)  # ready at 0 ms, start 10 ms, end 10.5 ms
    assert jobs.finished(as_tuple) == [(1, 8, 0.003), (2, 8, 0.0005)]


def test_a_jobs_planning_time_is_added_to_its_copy_time_when_timed() -> None:
    clock = iter([0.0, 2.0, 5.0])

    class Timed(CpuSyncStreams):
        def record(self, stream: Any) -> Any:
            return TimedEvent(next(clock))

    streams = Timed()
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"))
    jobs.submit(1, 8, lambda: None, planned_s=0.25)  # copy 2 ms to 5 ms, planned 250 ms
    ((job_id, nbytes, seconds),) = jobs.finished(as_tuple)
    assert (job_id, nbytes) == (1, 8) and seconds == pytest.approx(0.253)
    # Events that do not time leave the job untimed, whatever its planning took.
    untimed = OrderedJobs(CpuSyncStreams(), "copies", lambda: None)
    untimed.submit(2, 8, lambda: None, planned_s=0.25)
    assert untimed.finished(as_tuple) == [(2, 8, None)]


def test_cpu_sync_streams_run_at_once_and_name_one_stream_once() -> None:
    streams = CpuSyncStreams()
    assert streams.stream("h2d") is streams.stream("h2d")
    assert streams.stream("h2d") != streams.stream("d2h")
    ran: list[int] = []
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"))
    jobs.submit(4, 2, lambda: ran.append(4))
    assert ran == [4]
    assert streams.record(streams.stream("h2d")) is COMPLETED
    assert jobs.finished(as_tuple) == [(4, 2, None)]


def test_manual_streams_wait_follows_cross_stream_dependencies() -> None:
    streams = ManualStreams()
    order: list[str] = []
    compute, copies = streams.stream("compute"), streams.stream("copies")
    streams.run_on(compute, appending(order, "producer"))
    produced = streams.record(compute)
    streams.run_on(compute, appending(order, "unrelated"))
    streams.wait_event(copies, produced)
    streams.run_on(copies, appending(order, "copy"))
    copied = streams.record(copies)
    streams.synchronize(copied)
    assert order == ["producer", "copy"]
    assert streams.complete_all() == 1 and order[-1] == "unrelated"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_reports_each_job_once_in_order_and_holds_no_event(seed: int) -> None:
    rng = random.Random(seed)
    streams = CountingStreams()
    compute = streams.stream("compute")
    jobs = OrderedJobs(streams, "copies", lambda: compute)
    submitted: list[int] = []
    reported: list[int] = []
    ran: list[int] = []
    for job_id in range(1000):
        action = rng.random()
        if action < 0.4:
            streams.run_on(compute, lambda: None)
            jobs.submit(job_id, job_id, lambda j=job_id: ran.append(j))
            submitted.append(job_id)
        elif action < 0.6:
            streams.complete(rng.randint(1, 4))
        elif action < 0.7 and submitted:
            jobs.wait({rng.choice(submitted)})
        else:
            reported += [r[0] for r in jobs.finished(as_tuple)]
        # Only jobs whose copies ran are ever reported.
        assert set(reported) <= set(ran)
    jobs.drain()
    assert reported == submitted[: len(reported)]
    assert ran == submitted
    assert streams.held == 0
