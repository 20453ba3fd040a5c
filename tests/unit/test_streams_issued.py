"""kvcore.streams.OrderedJobs with an issuer: submit returns before the copies are issued,
each job still waits for the compute work queued when it was submitted, and a job whose
issuing raises is handed back, never reported."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest

from kvcore.issuer import Issued, Issuer
from kvcore.streams import CpuSyncStreams, OrderedJobs
from tests.unit.test_streams import CountingStreams, IssuingStreams, appending, as_tuple


class _Ticket(Issued):
    def __init__(self, issuer: ManualIssuer) -> None:
        super().__init__()
        self._issuer = issuer

    def wait(self) -> None:
        """Waiting for it runs the issuer up to it, as its thread would have."""
        while not self.done:
            self._issuer.run()


class ManualIssuer(Issuer):
    """An issuer that runs handed work only when told to, on the caller's thread."""

    def __init__(self) -> None:
        self.pending: deque[tuple[Callable[[], None], _Ticket]] = deque()

    def submit(self, work: Callable[[], None]) -> Issued:
        ticket = _Ticket(self)
        self.pending.append((work, ticket))
        return ticket

    def run(self, n: int = 1) -> None:
        for _ in range(min(n, len(self.pending))):
            work, ticket = self.pending.popleft()
            try:
                work()
            except BaseException as exc:
                ticket._finish(exc)
            else:
                ticket._finish(None)

    def idle(self) -> None:
        self.run(len(self.pending))

    def close(self) -> None:
        self.idle()


@pytest.fixture
def streams() -> CountingStreams:
    return CountingStreams()


@pytest.fixture
def issuer() -> ManualIssuer:
    return ManualIssuer()


@pytest.fixture
def jobs(streams: CountingStreams, issuer: ManualIssuer) -> OrderedJobs:
    return OrderedJobs(streams, "copies", lambda: streams.stream("compute"), issuer)


def test_submit_returns_before_the_job_is_issued_and_it_is_reported_after(
    streams: CountingStreams, issuer: ManualIssuer, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    jobs.submit(1, 10, appending(order, "copy"))
    assert streams.pending(streams.stream("copies")) == 0 and len(issuer.pending) == 1
    streams.complete_all()
    assert jobs.finished(as_tuple) == [] and len(jobs) == 1
    issuer.run()
    streams.complete_all()
    assert order == ["copy"]
    assert jobs.finished(as_tuple) == [(1, 10, None)]
    assert streams.held == 0


def test_an_issued_job_waits_for_the_compute_work_of_its_submission_only(
    streams: CountingStreams, issuer: ManualIssuer, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    compute = streams.stream("compute")
    streams.run_on(compute, appending(order, "model before"))
    jobs.submit(1, 1, appending(order, "copy"))
    streams.run_on(compute, appending(order, "model after"))
    issuer.run()
    jobs.wait({1})
    assert order == ["model before", "copy"]
    assert streams.pending(compute) == 1


def test_a_job_whose_issuing_raises_is_handed_back_not_reported(issuer: ManualIssuer) -> None:
    streams = IssuingStreams()
    copies = streams.stream("copies")
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"), issuer)
    order: list[str] = []

    def half_issued() -> None:
        streams.issue(copies, appending(order, "part of 2"))
        raise ValueError("plan went stale")

    jobs.submit(1, 1, lambda: streams.issue(copies, appending(order, "1")))
    jobs.submit(2, 1, half_issued)
    jobs.submit(3, 1, lambda: streams.issue(copies, appending(order, "3")))
    issuer.idle()
    jobs.settle()
    assert order == ["1", "part of 2", "3"]
    assert [r[0] for r in jobs.finished(as_tuple)] == [1, 3]
    failed = jobs.take_failed()
    assert [job_id for job_id, _ in failed] == [2] and isinstance(failed[0][1], ValueError)
    assert jobs.take_failed() == [] and len(jobs) == 0 and streams.held == 0


def test_wait_issues_up_to_the_latest_named_job_and_hands_back_its_failure(
    issuer: ManualIssuer,
) -> None:
    streams = IssuingStreams()
    jobs = OrderedJobs(streams, "copies", lambda: streams.stream("compute"), issuer)

    def fails() -> None:
        raise RuntimeError("issue failed")

    jobs.submit(1, 1, lambda: None)
    jobs.submit(2, 1, fails)
    jobs.submit(3, 1, lambda: None)
    jobs.wait({2})
    assert len(issuer.pending) == 1  # job 3 not issued
    assert [job_id for job_id, _ in jobs.take_failed()] == [2]
    assert [job.job_id for job in jobs] == [1, 3]
    jobs.drain()
    assert streams.held == 0


def test_drain_and_settle_let_the_issuer_finish_first(
    streams: CountingStreams, issuer: ManualIssuer, jobs: OrderedJobs
) -> None:
    order: list[str] = []
    jobs.submit(1, 1, appending(order, "a"))
    jobs.settle()
    assert order == ["a"] and not issuer.pending
    jobs.submit(2, 1, appending(order, "b"))
    jobs.drain()
    assert order == ["a", "b"] and len(jobs) == 0 and streams.held == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_on_a_thread_reports_each_job_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    issuer = Issuer(f"test-traffic-{seed}")
    jobs = OrderedJobs(CpuSyncStreams(), "copies", lambda: None, issuer)
    ran: list[int] = []
    reported: list[int] = []
    failing = set()
    try:
        for job_id in range(500):
            if rng.random() < 0.05:
                failing.add(job_id)
                jobs.submit(job_id, 1, lambda: (_ for _ in ()).throw(ValueError("no")))
            else:
                jobs.submit(job_id, 1, lambda j=job_id: ran.append(j))
            if rng.random() < 0.3:
                reported += [r[0] for r in jobs.finished(as_tuple)]
            if rng.random() < 0.05:
                jobs.wait({rng.randrange(job_id + 1)})
        issuer.idle()
        reported += [r[0] for r in jobs.finished(as_tuple)]
    finally:
        issuer.close()
    handed_back = {job_id for job_id, _ in jobs.take_failed()}
    assert handed_back == failing
    assert reported == [j for j in range(500) if j not in failing] == ran
