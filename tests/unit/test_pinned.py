from __future__ import annotations

import gc
import logging
import mmap
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import pinned
from kvcore.metrics import Metrics
from kvcore.pinned import (
    Backpressure,
    Lease,
    PinnedArena,
    PinnedMemoryError,
    allocate_host_buffer,
    check_memlock,
    prefault,
)

PAGE = mmap.PAGESIZE


class FakeRegistrar:
    """Stands in for cudaHostRegister; checks that nothing is unmapped while registered."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None) -> None:
        self.fail_at = fail_at
        self.error = error or PinnedMemoryError("fake registration failure")
        self.calls: list[tuple[str, int, int]] = []
        self.registered: dict[int, int] = {}
        self.mappings: list[mmap.mmap] = []
        self.unregister_error: Exception | None = None

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise self.error
        self.calls.append(("register", ptr, nbytes))
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert self.mappings and not any(m.closed for m in self.mappings), "unmapped first"
        if self.unregister_error is not None:
            raise self.unregister_error
        self.calls.append(("unregister", ptr, self.registered.pop(ptr)))


@pytest.fixture
def registrar(monkeypatch: pytest.MonkeyPatch) -> FakeRegistrar:
    """A fake registrar that also sees every mapping kvcore.pinned creates."""
    fake = FakeRegistrar()
    real_mmap = mmap.mmap

    def recording_mmap(*args: object, **kwargs: object) -> mmap.mmap:
        mapping = real_mmap(*args, **kwargs)
        fake.mappings.append(mapping)
        return mapping

    monkeypatch.setattr(pinned.mmap, "mmap", recording_mmap)
    monkeypatch.setattr(
        pinned.resource, "getrlimit", lambda _: (pinned.resource.RLIM_INFINITY,) * 2
    )
    return fake


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_pageable_buffer_is_exact_size_and_closes() -> None:
    buf = allocate_host_buffer(1_000_003, pin=False)
    assert (buf.kind, buf.pinned, buf.nbytes) == ("pageable", False, 1_000_003)
    assert buf.tensor.dtype == torch.uint8 and buf.tensor.numel() == 1_000_003
    buf.close()
    buf.close()
    assert buf.closed
    with pytest.raises(RuntimeError, match="closed"):
        _ = buf.tensor


def test_default_pin_follows_cuda_availability(
    registrar: FakeRegistrar, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert allocate_host_buffer(4096).kind == "pageable"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    buf = allocate_host_buffer(4096, registrar=registrar)
    assert buf.kind == "registered" and buf.pinned
    buf.close()


@pytest.mark.parametrize("nbytes", [0, -5])
def test_buffer_size_must_be_positive(nbytes: int) -> None:
    with pytest.raises(ValueError):
        allocate_host_buffer(nbytes, pin=False)


def test_registered_buffer_registers_exact_chunks_and_holds_data(registrar: FakeRegistrar) -> None:
    chunk = 4 * PAGE
    nbytes = 2 * chunk + 3 * PAGE + 17
    buf = allocate_host_buffer(nbytes, pin=True, register_chunk_bytes=chunk, registrar=registrar)
    assert (buf.kind, buf.pinned, buf.tensor.numel()) == ("registered", True, nbytes)
    base = buf.tensor.data_ptr()
    assert registrar.calls == [
        ("register", base, chunk),
        ("register", base + chunk, chunk),
        ("register", base + 2 * chunk, 3 * PAGE + 17),
    ]
    data = random_bytes(nbytes, seed=1)
    buf.tensor.copy_(data)
    assert torch.equal(buf.tensor, data)
    (mapping,) = registrar.mappings
    buf.close()
    assert registrar.registered == {}
    assert [c[0] for c in registrar.calls[3:]] == ["unregister"] * 3
    assert mapping.closed
    buf.close()
    assert len(registrar.calls) == 6


def test_registration_failure_rolls_back(registrar: FakeRegistrar) -> None:
    registrar.fail_at = 2
    with pytest.raises(PinnedMemoryError, match="fake registration failure"):
        allocate_host_buffer(5 * PAGE, pin=True, register_chunk_bytes=PAGE, registrar=registrar)
    assert registrar.registered == {}
    assert [c[0] for c in registrar.calls] == ["register"] * 2 + ["unregister"] * 2
    assert all(m.closed for m in registrar.mappings)


def test_foreign_registration_error_is_wrapped(registrar: FakeRegistrar) -> None:
    registrar.fail_at = 0
    registrar.error = OSError("driver said no")
    with pytest.raises(PinnedMemoryError, match=f"registering {PAGE} bytes") as info:
        allocate_host_buffer(PAGE, pin=True, registrar=registrar)
    assert isinstance(info.value.__cause__, OSError)


def test_failed_unregistration_keeps_memory_mapped(registrar: FakeRegistrar) -> None:
    buf = allocate_host_buffer(2 * PAGE, pin=True, register_chunk_bytes=PAGE, registrar=registrar)
    registrar.unregister_error = RuntimeError("busy")
    with pytest.raises(RuntimeError, match="busy"):
        buf.close()
    (mapping,) = registrar.mappings
    assert not mapping.closed and len(registrar.registered) == 2
    registrar.unregister_error = None
    buf.close()
    assert registrar.registered == {} and mapping.closed


def test_views_outliving_close_stay_valid(registrar: FakeRegistrar) -> None:
    buf = allocate_host_buffer(3 * PAGE, pin=True, registrar=registrar)
    view = buf.tensor[PAGE : 2 * PAGE]
    buf.close()
    assert buf.closed and registrar.registered == {}
    data = random_bytes(PAGE, seed=2)
    view.copy_(data)
    assert torch.equal(view, data)


def test_dropped_buffer_is_unregistered_once_its_last_view_dies(
    registrar: FakeRegistrar,
) -> None:
    buf = allocate_host_buffer(3 * PAGE, pin=True, registrar=registrar, register_chunk_bytes=PAGE)
    view = buf.tensor[PAGE:]
    del buf
    gc.collect()
    assert len(registrar.registered) == 3  # a view still uses the memory
    del view
    gc.collect()
    assert registrar.registered == {}
    assert [call[0] for call in registrar.calls] == ["register"] * 3 + ["unregister"] * 3


def test_chunk_size_must_be_whole_pages(registrar: FakeRegistrar) -> None:
    with pytest.raises(ValueError, match="page size"):
        allocate_host_buffer(PAGE, pin=True, register_chunk_bytes=PAGE + 1, registrar=registrar)


def test_pinning_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        pinned.resource, "getrlimit", lambda _: (pinned.resource.RLIM_INFINITY,) * 2
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PinnedMemoryError, match="needs CUDA"):
        allocate_host_buffer(PAGE, pin=True)


@pytest.mark.parametrize(
    ("size", "threads"), [(1, 4), (PAGE, 8), (7 * PAGE + 5, 3), (20 * PAGE, 64)]
)
def test_prefault_touches_first_byte_of_every_page_only(size: int, threads: int) -> None:
    original = np.random.default_rng(size).integers(1, 256, size, dtype=np.uint8)
    array = original.copy()
    prefault(array, threads)
    touched = np.zeros(size, dtype=bool)
    touched[::PAGE] = True
    assert (array[touched] == 0).all()
    assert np.array_equal(array[~touched], original[~touched])


def limit_memlock(monkeypatch: pytest.MonkeyPatch, soft: int, euid: int) -> None:
    monkeypatch.setattr(pinned.resource, "getrlimit", lambda _: (soft, soft))
    monkeypatch.setattr(pinned.os, "geteuid", lambda: euid)


def test_memlock_limit_names_limit_request_and_fix(
    registrar: FakeRegistrar, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit_memlock(monkeypatch, soft=64 * 1024, euid=1000)
    with pytest.raises(PinnedMemoryError) as info:
        allocate_host_buffer(1 << 20, pin=True, registrar=registrar)
    message = str(info.value)
    for part in ("RLIMIT_MEMLOCK", "65536 bytes", "`ulimit -l` shows 64 KiB", "1048576 bytes"):
        assert part in message
    assert "ulimit -l unlimited" in message and "memlock=-1" in message
    assert registrar.calls == [] and registrar.mappings == []


def test_memlock_limit_only_warns_for_root(
    registrar: FakeRegistrar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    limit_memlock(monkeypatch, soft=PAGE, euid=0)
    with caplog.at_level(logging.WARNING, logger="kvcore.pinned"):
        buf = allocate_host_buffer(4 * PAGE, pin=True, registrar=registrar)
    assert "RLIMIT_MEMLOCK" in caplog.text and "root" in caplog.text
    assert buf.pinned
    buf.close()


def test_memlock_within_limit_or_unlimited_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    limit_memlock(monkeypatch, soft=PAGE, euid=1000)
    check_memlock(PAGE)
    with pytest.raises(PinnedMemoryError):
        check_memlock(PAGE + 1)
    monkeypatch.setattr(
        pinned.resource, "getrlimit", lambda _: (pinned.resource.RLIM_INFINITY,) * 2
    )
    check_memlock(1 << 50)


def test_arena_capacity_is_exact_not_rounded() -> None:
    capacity = 256 * 3001
    with PinnedArena(capacity, pin=False) as arena:
        assert arena.buffer.tensor.numel() == capacity
        assert (arena.capacity_bytes, arena.free_bytes, arena.pinned) == (capacity, capacity, False)


def test_arena_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="multiple of alignment"):
        PinnedArena(1000, alignment=256, pin=False)
    with pytest.raises(ValueError, match="buffer holds"):
        PinnedArena(512, buffer=allocate_host_buffer(1024, pin=False))
    arena = PinnedArena(1024, pin=False)
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError):
            arena.reserve(bad)
    lease = arena.reserve(1024)
    assert isinstance(lease, Lease) and arena.free_bytes == 0
    lease.release()
    arena.close()


def largest_free_run(used: list[bool]) -> int:
    best = run = 0
    for u in used:
        run = 0 if u else run + 1
        best = max(best, run)
    return best


ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(min_value=1, max_value=700)),
        st.tuples(st.just("release"), st.integers(min_value=0, max_value=1000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_arena_accounting_is_exact(sequence: list[tuple[str, int]]) -> None:
    align, units = 64, 24
    metrics = Metrics()
    arena = PinnedArena(align * units, alignment=align, pin=False, metrics=metrics)
    used = [False] * units
    live: list[Lease] = []
    for op, value in sequence:
        if op == "reserve":
            need = -(-value // align)
            free_run = largest_free_run(used)
            result = arena.reserve(value)
            if need <= free_run:
                assert isinstance(result, Lease)
                assert (result.nbytes, result.reserved_bytes) == (value, need * align)
                assert result.offset % align == 0
                first = result.offset // align
                assert not any(used[first : first + need]), "lease overlaps a live lease"
                used[first : first + need] = [True] * need
                live.append(result)
            else:
                assert isinstance(result, Backpressure) and not result
                assert result.requested == value
                assert result.available == free_run * align
                assert (result.in_use, result.capacity) == (arena.in_use_bytes, units * align)
        elif live:
            lease = live.pop(value % len(live))
            lease.release()
            first = lease.offset // align
            used[first : first + lease.reserved_bytes // align] = [False] * (
                lease.reserved_bytes // align
            )
        in_use = sum(lease.reserved_bytes for lease in live)
        assert arena.in_use_bytes == in_use <= arena.capacity_bytes
        assert arena.free_bytes == arena.capacity_bytes - in_use
        assert metrics.pinned_bytes_in_use == in_use
        assert metrics.pinned_bytes_capacity == units * align
    for lease in live:
        lease.release()
    assert arena.in_use_bytes == 0
    arena.close()
    assert (metrics.pinned_bytes_in_use, metrics.pinned_bytes_capacity) == (0, 0)


def test_backpressure_when_full_then_success_after_release() -> None:
    arena = PinnedArena(4096, alignment=256, pin=False)
    leases = [arena.reserve(1000) for _ in range(4)]
    assert all(isinstance(lease, Lease) for lease in leases)
    refused = arena.reserve(1)
    assert not refused and isinstance(refused, Backpressure)
    assert (refused.requested, refused.available, refused.in_use, refused.capacity) == (
        1,
        0,
        4096,
        4096,
    )
    assert (
        repr(refused)
        == "Backpressure(requested=1 B, available=0 B, in_use=4.0 KiB, capacity=4.0 KiB)"
    )
    leases[1].release()
    again = arena.reserve(1024)
    assert isinstance(again, Lease) and again.offset == leases[1].offset
    assert arena.reserve(1025).available == 0


def test_lease_views_do_not_overlap_and_gaps_stay_untouched() -> None:
    rng = random.Random(3)
    arena = PinnedArena(256 * 64, pin=False)
    poison = random_bytes(arena.capacity_bytes, seed=4)
    arena.buffer.tensor.copy_(poison)
    leases = []
    while isinstance(lease := arena.reserve(rng.randint(1, 900)), Lease):
        leases.append(lease)
    payloads = [random_bytes(lease.nbytes, seed=10 + i) for i, lease in enumerate(leases)]
    for lease, payload in zip(leases, payloads, strict=True):
        lease.view().copy_(payload)
    covered = torch.zeros(arena.capacity_bytes, dtype=torch.bool)
    for lease, payload in zip(leases, payloads, strict=True):
        assert torch.equal(lease.view(), payload)
        covered[lease.offset : lease.offset + lease.nbytes] = True
    assert torch.equal(arena.buffer.tensor[~covered], poison[~covered])


def test_lease_typed_view_shares_memory() -> None:
    arena = PinnedArena(4096, pin=False)
    lease = arena.reserve(24 * 4)
    floats = lease.view(torch.float32, (4, 6))
    values = torch.randn(4, 6)
    floats.copy_(values)
    assert floats.shape == (4, 6)
    assert torch.equal(lease.view().view(torch.float32).view(4, 6), values)


def test_release_rules() -> None:
    arena = PinnedArena(4096, pin=False)
    other = PinnedArena(4096, pin=False)
    lease = arena.reserve(100)
    stranger = other.reserve(100)
    with pytest.raises(ValueError, match="does not belong"):
        arena.release(stranger)
    arena.release(lease)
    with pytest.raises(RuntimeError, match="released twice"):
        lease.release()
    with pytest.raises(RuntimeError, match="released"):
        lease.view()
    assert arena.in_use_bytes == 0 and other.in_use_bytes == 256


def test_close_refused_while_leases_outstanding() -> None:
    metrics = Metrics()
    arena = PinnedArena(4096, pin=False, metrics=metrics)
    a, b = arena.reserve(100), arena.reserve(300)
    with pytest.raises(RuntimeError, match=r"2 leases \(768 bytes\)"):
        arena.close()
    assert not arena.buffer.closed and arena.in_use_bytes == 768
    assert isinstance(arena.reserve(10), Lease)
    arena.close(force=True)
    assert a.released and b.released and arena.buffer.closed and arena.in_use_bytes == 0
    assert metrics.pinned_bytes_capacity == 0
    with pytest.raises(RuntimeError, match="closed"):
        arena.reserve(10)
    arena.close()


def test_context_manager_closes_registered_buffer(registrar: FakeRegistrar) -> None:
    buf = allocate_host_buffer(2 * PAGE, pin=True, registrar=registrar)
    with PinnedArena(2 * PAGE, buffer=buf) as arena:
        assert arena.pinned
        arena.reserve(PAGE).release()
    assert buf.closed and registrar.registered == {}


def test_concurrent_leases_never_share_bytes() -> None:
    arena = PinnedArena(256 * 128, pin=False)
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            lease = arena.reserve(rng.randint(1, 2000))
            if not lease:
                continue
            pattern = torch.full((lease.nbytes,), seed, dtype=torch.uint8)
            lease.view().copy_(pattern)
            time.sleep(0)
            if not torch.equal(lease.view(), pattern):
                failures.append(f"thread {seed} saw its lease overwritten")
            lease.release()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert arena.in_use_bytes == 0 and arena.lease_count == 0
    assert isinstance(arena.reserve(arena.capacity_bytes), Lease)


def _segmented_buffer(nbytes: int, segment: int) -> pinned.HostBuffer:
    buffer = pinned.PageableBuffer(torch.empty(nbytes, dtype=torch.uint8))
    buffer.segment_bytes = segment
    return buffer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4096)), max_size=60), st.data())
def test_leases_never_cross_a_registration_segment(ops, data) -> None:
    """The driver rejects one DMA over two registrations: no lease may straddle one."""
    segment, alignment, capacity = 4096, 256, 4096 * 3 + 1024
    arena = PinnedArena(capacity, alignment=alignment, buffer=_segmented_buffer(capacity, segment))
    live = []
    for grow, nbytes in ops:
        if grow or not live:
            lease = arena.reserve(nbytes)
            if lease:
                assert (
                    lease.offset // segment == (lease.offset + lease.reserved_bytes - 1) // segment
                )
                assert lease.offset + lease.reserved_bytes <= capacity
                live.append(lease)
        else:
            live.pop(data.draw(st.integers(0, len(live) - 1))).release()
        assert arena.in_use_bytes == sum(lease.reserved_bytes for lease in live)
    for lease in live:
        lease.release()
    whole = [arena.reserve(segment) for _ in range(3)]
    assert all(whole) and arena.reserve(1024)
    assert arena.in_use_bytes == capacity
    with pytest.raises(ValueError, match="registration segment"):
        arena.reserve(segment + 1)
    arena.close(force=True)
