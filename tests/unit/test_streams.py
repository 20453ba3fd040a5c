from __future__ import annotations

import random
import threading

import pytest
import torch

from kvcore.direction import Direction
from kvcore.pinned import Lease, PinnedArena
from kvcore.streams import (
    CopyStreams,
    CpuSyncBackend,
    ManualCpuBackend,
    StaleTicketError,
    Ticket,
    TicketState,
)

ROW = 1000


@pytest.fixture
def arena() -> PinnedArena:
    return PinnedArena(256 * 256, pin=False)


@pytest.fixture
def backend() -> ManualCpuBackend:
    return ManualCpuBackend()


@pytest.fixture
def streams(backend: ManualCpuBackend) -> CopyStreams:
    return CopyStreams(backend)


def rand_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def lease(arena: PinnedArena, nbytes: int = ROW) -> Lease:
    result = arena.reserve(nbytes)
    assert isinstance(result, Lease)
    return result


def staged_copy(
    streams: CopyStreams, arena: PinnedArena, seed: int, direction: Direction = Direction.H2D
) -> tuple[Ticket, torch.Tensor, torch.Tensor]:
    """Stage random bytes in a lease and submit a copy of them into a poisoned target."""
    gen = torch.Generator().manual_seed(seed)
    staging = lease(arena)
    source = rand_bytes(ROW, gen)
    staging.view().copy_(source)
    target = rand_bytes(ROW, gen)
    view = staging.view()
    ticket = streams.submit(direction, lambda: target.copy_(view), nbytes=ROW, leases=[staging])
    return ticket, source, target


def test_submit_poll_complete_poll(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    ticket, source, target = staged_copy(streams, arena, seed=1)
    before = target.clone()
    assert (ticket.state, ticket.direction, ticket.nbytes) == (TicketState.IN_FLIGHT, "h2d", ROW)
    assert not streams.poll(ticket)
    assert torch.equal(target, before), "work ran before the stream reached it"
    assert streams.outstanding == [ticket] and streams.in_flight_bytes == ROW
    assert backend.complete() == 1
    assert arena.in_use_bytes == 1024, "leases are released by poll, not by the copy"
    assert streams.poll(ticket)
    assert ticket.state is TicketState.DONE and ticket.done
    assert torch.equal(target, source)
    assert arena.in_use_bytes == 0 and all(lease.released for lease in ticket.leases)
    assert streams.outstanding == [] and streams.in_flight_bytes == 0
    assert streams.poll(ticket)


def test_cancel_in_flight_keeps_leases_until_copy_finishes(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    ticket, source, target = staged_copy(streams, arena, seed=2)
    streams.cancel(ticket)
    assert ticket.state is TicketState.CANCELLING
    assert arena.in_use_bytes == 1024 and not ticket.leases[0].released
    assert not streams.poll(ticket)
    streams.cancel(ticket)
    assert ticket.state is TicketState.CANCELLING and arena.in_use_bytes == 1024
    backend.complete()
    assert torch.equal(target, source), "a cancelled copy still runs to the end"
    assert streams.reap() == 1
    assert ticket.state is TicketState.CANCELLED and not ticket.done
    assert arena.in_use_bytes == 0 and streams.outstanding == []


def test_cancel_after_done_and_after_completion_before_poll(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    done, _, _ = staged_copy(streams, arena, seed=3)
    backend.complete()
    streams.wait(done)
    assert done.state is TicketState.DONE
    streams.cancel(done)
    assert done.state is TicketState.CANCELLED and arena.in_use_bytes == 0
    streams.cancel(done)
    assert done.state is TicketState.CANCELLED

    unpolled, _, _ = staged_copy(streams, arena, seed=4)
    backend.complete()
    assert unpolled.state is TicketState.IN_FLIGHT and arena.in_use_bytes == 1024
    streams.cancel(unpolled)
    assert unpolled.state is TicketState.CANCELLED and arena.in_use_bytes == 0


def test_wait_runs_only_what_the_ticket_depends_on(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    first, source1, target1 = staged_copy(streams, arena, seed=5)
    second, _, target2 = staged_copy(streams, arena, seed=6)
    before2 = target2.clone()
    streams.wait(first)
    assert first.state is TicketState.DONE and torch.equal(target1, source1)
    assert second.state is TicketState.IN_FLIGHT and torch.equal(target2, before2)
    assert backend.pending() == 1 and arena.in_use_bytes == 1024
    streams.wait(second)
    assert second.done and arena.in_use_bytes == 0


def test_page_out_waits_for_producer_event(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    gen = torch.Generator().manual_seed(7)
    compute = backend.stream("compute")
    device_rows = rand_bytes(ROW, gen)
    produced = rand_bytes(ROW, gen)
    backend.run_on(compute, lambda: device_rows.copy_(produced))
    producer_done = backend.record(compute)
    staging = lease(arena)
    staging.view().copy_(rand_bytes(ROW, gen))
    view = staging.view()
    ticket = streams.submit(
        Direction.D2H,
        lambda: view.copy_(device_rows),
        nbytes=ROW,
        wait_for=producer_done,
    )
    d2h = backend.stream(Direction.D2H)
    assert backend.complete(stream=d2h) == 0, "page-out read before the producer finished"
    assert not streams.poll(ticket)
    assert backend.complete(stream=compute) == 1 and producer_done.done
    assert backend.complete(stream=d2h) == 1
    assert streams.poll(ticket) and torch.equal(view, produced)
    staging.release()


def test_wait_follows_cross_stream_dependencies(
    streams: CopyStreams, backend: ManualCpuBackend
) -> None:
    order: list[str] = []
    compute = backend.stream("compute")
    backend.run_on(compute, lambda: order.append("producer"))
    producer_done = backend.record(compute)
    backend.run_on(compute, lambda: order.append("unrelated"))
    ticket = streams.submit("d2h", lambda: order.append("copy"), nbytes=0, wait_for=producer_done)
    streams.wait(ticket)
    assert order == ["producer", "copy"] and ticket.done


def test_consumer_stream_waits_on_ticket_without_host_sync(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    ticket, source, target = staged_copy(streams, arena, seed=8)
    compute = backend.stream("compute")
    streams.make_stream_wait(ticket, compute)
    seen: list[torch.Tensor] = []
    backend.run_on(compute, lambda: seen.append(target.clone()))
    assert ticket.state is TicketState.IN_FLIGHT, "make_stream_wait must not block the host"
    assert backend.complete(stream=compute) == 0
    backend.complete(stream=backend.stream(Direction.H2D))
    assert backend.complete(stream=compute) == 1
    assert torch.equal(seen[0], source)


def test_global_completion_order_respects_waits(
    streams: CopyStreams, backend: ManualCpuBackend
) -> None:
    order: list[str] = []
    compute = backend.stream("compute")
    h2d = streams.submit("h2d", lambda: order.append("h2d-1"), nbytes=0)
    streams.make_stream_wait(h2d, compute)
    backend.run_on(compute, lambda: order.append("consumer"))
    streams.submit("h2d", lambda: order.append("h2d-2"), nbytes=0)
    streams.submit("d2h", lambda: order.append("d2h"), nbytes=0)
    assert backend.complete_all() == 4
    assert order == ["h2d-1", "consumer", "h2d-2", "d2h"]


def test_make_stream_wait_on_cancelled_ticket_is_refused(
    streams: CopyStreams, backend: ManualCpuBackend
) -> None:
    ticket = streams.submit("h2d", lambda: None, nbytes=0)
    streams.cancel(ticket)
    with pytest.raises(RuntimeError, match="cancelled"):
        streams.make_stream_wait(ticket, backend.stream("compute"))


@pytest.mark.parametrize("cancel", [False, True])
def test_drain_releases_everything_and_retires_tickets(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena, cancel: bool
) -> None:
    finished, _, _ = staged_copy(streams, arena, seed=9)
    backend.complete()
    streams.poll(finished)
    copies = [
        staged_copy(streams, arena, seed=10 + i, direction=d)
        for i, d in enumerate([Direction.H2D, Direction.D2H] * 3)
    ]
    extra = lease(arena)
    two_leases = streams.submit("d2h", lambda: None, nbytes=5, leases=[lease(arena), extra])
    tombstone, _, _ = staged_copy(streams, arena, seed=20)
    streams.cancel(tombstone)
    in_flight = [t for t, _, _ in copies] + [two_leases]

    report = streams.drain(cancel=cancel)

    assert arena.in_use_bytes == 0 and streams.outstanding == []
    assert backend.pending() == 0
    for _, source, target in copies:
        assert torch.equal(target, source), "drain waits for every copy to really finish"
    expected_state = TicketState.CANCELLED if cancel else TicketState.DONE
    assert all(t.state is expected_state for t in in_flight)
    assert tombstone.state is TicketState.CANCELLED
    assert report.completed == (0 if cancel else len(in_flight))
    assert report.cancelled == (len(in_flight) + 1 if cancel else 1)
    assert report.leases_released == len(copies) + 2 + 1
    assert report.bytes == len(copies) * ROW + 5 + ROW
    assert streams.generation == 1
    for old in [finished, tombstone, *in_flight]:
        for call in (streams.poll, streams.wait, streams.cancel):
            with pytest.raises(StaleTicketError, match="generation 0"):
                call(old)
        with pytest.raises(StaleTicketError):
            streams.make_stream_wait(old, backend.stream("compute"))
    fresh, source, target = staged_copy(streams, arena, seed=30)
    assert fresh.generation == 1
    streams.wait(fresh)
    assert fresh.done and torch.equal(target, source) and arena.in_use_bytes == 0


def test_drain_with_nothing_outstanding(streams: CopyStreams) -> None:
    report = streams.drain()
    assert (report.completed, report.cancelled, report.leases_released, report.bytes) == (0,) * 4
    assert streams.generation == 1


def test_work_raising_on_sync_backend_releases_leases(arena: PinnedArena) -> None:
    streams = CopyStreams(CpuSyncBackend())
    staging = lease(arena)
    target = torch.zeros(ROW, dtype=torch.uint8)

    def partial_copy() -> None:
        target[:10].copy_(staging.view()[:10])
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        streams.submit("h2d", partial_copy, nbytes=ROW, leases=[staging])
    assert staging.released and arena.in_use_bytes == 0 and streams.outstanding == []


def test_work_raising_later_cancels_ticket(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    error = ValueError("bad rows")

    def failing() -> None:
        raise error

    ticket = streams.submit("h2d", failing, nbytes=ROW, leases=[lease(arena)])
    good, source, target = staged_copy(streams, arena, seed=40)
    with pytest.raises(ValueError, match="bad rows"):
        backend.complete()
    assert streams.poll(ticket)
    assert ticket.state is TicketState.CANCELLED and not ticket.done and ticket.error is error
    assert arena.in_use_bytes == 1024
    backend.complete()
    assert streams.poll(good) and good.done and torch.equal(target, source)
    assert arena.in_use_bytes == 0


def test_drain_surfaces_work_error_after_cleaning_up(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    def failing() -> None:
        raise KeyError("row 7")

    first, source, target = staged_copy(streams, arena, seed=41)
    broken = streams.submit("h2d", failing, nbytes=ROW, leases=[lease(arena)])
    last, source2, target2 = staged_copy(streams, arena, seed=42)
    with pytest.raises(KeyError, match="row 7"):
        streams.drain()
    assert arena.in_use_bytes == 0 and streams.outstanding == [] and streams.generation == 1
    assert (first.state, broken.state, last.state) == (
        TicketState.DONE,
        TicketState.CANCELLED,
        TicketState.DONE,
    )
    assert torch.equal(target, source) and torch.equal(target2, source2)


def test_submit_validates_leases(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    staging = lease(arena)
    ticket = streams.submit("h2d", lambda: None, nbytes=1, leases=[staging])
    with pytest.raises(ValueError, match="already backs"):
        streams.submit("d2h", lambda: None, nbytes=1, leases=[staging])
    gone = lease(arena)
    gone.release()
    with pytest.raises(ValueError, match="cannot back"):
        streams.submit("h2d", lambda: None, nbytes=1, leases=[gone])
    spare = lease(arena)
    with pytest.raises(ValueError, match="twice"):
        streams.submit("h2d", lambda: None, nbytes=1, leases=[spare, spare])
    with pytest.raises(ValueError, match="nbytes"):
        streams.submit("h2d", lambda: None, nbytes=-1)
    with pytest.raises(TypeError, match="cannot wait"):
        streams.submit("h2d", lambda: None, nbytes=1, leases=[spare], wait_for=object())
    assert backend.pending() == 1 and streams.outstanding == [ticket]
    reused = streams.submit("h2d", lambda: None, nbytes=1, leases=[spare])
    backend.complete_all()
    assert streams.reap() == 2 and reused.done and arena.in_use_bytes == 0


def test_leases_released_behind_a_tickets_back_are_reported(
    streams: CopyStreams, backend: ManualCpuBackend, arena: PinnedArena
) -> None:
    a, b = lease(arena), lease(arena)
    ticket = streams.submit("h2d", lambda: None, nbytes=1, leases=[a, b])
    a.release()
    backend.complete()
    with pytest.raises(RuntimeError, match="released while the ticket owned"):
        streams.poll(ticket)
    assert b.released and arena.in_use_bytes == 0 and streams.outstanding == []


def test_default_backend_on_cpu_runs_at_once(arena: PinnedArena) -> None:
    streams = CopyStreams()
    assert isinstance(streams.backend, CpuSyncBackend)
    staging = lease(arena)
    source = torch.randint(0, 256, (ROW,), dtype=torch.uint8)
    target = torch.zeros(ROW, dtype=torch.uint8)
    staging.view().copy_(source)
    view = staging.view()
    ticket = streams.submit(Direction.H2D, lambda: target.copy_(view), nbytes=ROW, leases=[staging])
    assert torch.equal(target, source)
    assert streams.reap() == 1 and ticket.done and arena.in_use_bytes == 0
    streams.make_stream_wait(ticket, streams.backend.stream("compute"))


def test_ticket_ids_are_unique_across_generations(streams: CopyStreams) -> None:
    first = [streams.submit("h2d", lambda: None, nbytes=0) for _ in range(3)]
    streams.drain()
    second = [streams.submit("d2h", lambda: None, nbytes=0) for _ in range(3)]
    assert len({t.id for t in first + second}) == 6
    assert {t.generation for t in first} == {0} and {t.generation for t in second} == {1}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leak_stress_1000_cycles(seed: int, backend: ManualCpuBackend) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    arena = PinnedArena(256 * 48, pin=False)
    streams = CopyStreams(backend)
    held: list[Lease] = []
    copies: list[tuple[Ticket, torch.Tensor, torch.Tensor]] = []
    backpressured = 0
    for _ in range(1000):
        action = rng.random()
        if action < 0.35:
            result = arena.reserve(rng.randint(1, 1500))
            if isinstance(result, Lease):
                held.append(result)
            else:
                backpressured += 1
        elif action < 0.6 and held:
            owned = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), 2))]
            source = rand_bytes(owned[0].nbytes, gen)
            owned[0].view().copy_(source)
            target = torch.zeros(owned[0].nbytes, dtype=torch.uint8)
            view = owned[0].view()
            direction = rng.choice(list(Direction))
            ticket = streams.submit(
                direction, lambda t=target, v=view: t.copy_(v), nbytes=view.numel(), leases=owned
            )
            copies.append((ticket, source, target))
        elif action < 0.7 and streams.outstanding:
            streams.cancel(rng.choice(streams.outstanding))
        elif action < 0.85:
            backend.complete(rng.randint(1, 3))
        elif action < 0.95:
            streams.reap()
        elif streams.outstanding:
            streams.wait(rng.choice(streams.outstanding))
        if held and rng.random() < 0.05:
            held.pop(rng.randrange(len(held))).release()
        owned_now = sum(x.reserved_bytes for t in streams.outstanding for x in t.leases)
        assert arena.in_use_bytes == owned_now + sum(x.reserved_bytes for x in held)
        assert arena.in_use_bytes <= arena.capacity_bytes
    assert backpressured > 0 and len(copies) > 100
    for leftover in held:
        leftover.release()
    streams.drain(cancel=rng.random() < 0.5)
    assert arena.in_use_bytes == 0 and arena.lease_count == 0
    for ticket, source, target in copies:
        assert ticket.state in (TicketState.DONE, TicketState.CANCELLED)
        assert torch.equal(target, source)
    assert isinstance(arena.reserve(arena.capacity_bytes), Lease)


def test_concurrent_submitters_and_reapers(arena: PinnedArena) -> None:
    streams = CopyStreams(CpuSyncBackend())
    mismatches: list[int] = []

    def submitter(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(200):
            staging = arena.reserve(ROW)
            if not staging:
                streams.reap()
                continue
            source = rand_bytes(ROW, gen)
            staging.view().copy_(source)
            target = torch.zeros(ROW, dtype=torch.uint8)
            view = staging.view()
            streams.submit("h2d", lambda t=target, v=view: t.copy_(v), nbytes=ROW, leases=[staging])
            if not torch.equal(target, source):
                mismatches.append(seed)

    def reaper() -> None:
        for _ in range(500):
            streams.reap()

    threads = [threading.Thread(target=submitter, args=(s,)) for s in range(4)]
    threads.append(threading.Thread(target=reaper))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    streams.reap()
    assert mismatches == [] and arena.in_use_bytes == 0 and streams.outstanding == []
