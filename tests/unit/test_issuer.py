"""kvcore.issuer: a thread that runs handed work in order, marking what raised."""

from __future__ import annotations

import threading

import pytest

from kvcore.issuer import Issuer


def test_work_runs_on_the_thread_in_the_order_handed_over() -> None:
    issuer = Issuer("test-order")
    ran: list[tuple[int, str]] = []
    try:
        tickets = [
            issuer.submit(lambda n=n: ran.append((n, threading.current_thread().name)))
            for n in range(50)
        ]
        issuer.idle()
        assert all(t.done and t.error is None for t in tickets)
        assert ran == [(n, "test-order") for n in range(50)]
    finally:
        issuer.close()


def test_work_that_raises_is_marked_and_the_next_still_runs() -> None:
    issuer = Issuer("test-raise")
    ran: list[str] = []

    def fails() -> None:
        raise ValueError("bad job")

    try:
        failed = issuer.submit(fails)
        after = issuer.submit(lambda: ran.append("after"))
        after.wait()
        assert failed.done and isinstance(failed.error, ValueError)
        assert after.error is None and ran == ["after"]
    finally:
        issuer.close()


def test_a_ticket_is_not_done_while_its_work_runs() -> None:
    issuer = Issuer("test-gate")
    gate = threading.Event()
    try:
        held = issuer.submit(gate.wait)
        queued = issuer.submit(lambda: None)
        assert not held.done and not queued.done
        gate.set()
        queued.wait()
        assert held.done and queued.done
    finally:
        gate.set()
        issuer.close()


def test_close_runs_what_was_handed_over_then_refuses_more() -> None:
    issuer = Issuer("test-close")
    ran: list[int] = []
    ticket = issuer.submit(lambda: ran.append(1))
    issuer.close()
    issuer.close()  # again: nothing
    assert ticket.done and ran == [1]
    issuer.idle()  # closed: returns at once
    with pytest.raises(RuntimeError, match="closed"):
        issuer.submit(lambda: None)


def test_a_failed_prepare_fails_every_piece_of_work() -> None:
    def prepare() -> None:
        raise RuntimeError("no device")

    issuer = Issuer("test-prepare", prepare)
    ran: list[int] = []
    try:
        ticket = issuer.submit(lambda: ran.append(1))
        ticket.wait()
        assert isinstance(ticket.error, RuntimeError) and ran == []
    finally:
        issuer.close()
