"""kvcore.bench.host_buffers: exact-size host memory, registered chunk by chunk."""

from __future__ import annotations

import gc
import logging
import mmap

import numpy as np
import pytest
import torch

from kvcore import host_pinning
from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.host_pinning import PinnedMemoryError, check_memlock, populate

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
    """A fake registrar that also sees every mapping kvcore.bench.host_buffers creates."""
    fake = FakeRegistrar()
    real_mmap = mmap.mmap

    def recording_mmap(*args: object, **kwargs: object) -> mmap.mmap:
        mapping = real_mmap(*args, **kwargs)
        fake.mappings.append(mapping)
        return mapping

    monkeypatch.setattr(mmap, "mmap", recording_mmap)
    monkeypatch.setattr(
        host_pinning.resource, "getrlimit", lambda _: (host_pinning.resource.RLIM_INFINITY,) * 2
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
        host_pinning.resource, "getrlimit", lambda _: (host_pinning.resource.RLIM_INFINITY,) * 2
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PinnedMemoryError, match="needs CUDA"):
        allocate_host_buffer(PAGE, pin=True)


@pytest.mark.parametrize(
    ("size", "threads", "offset"),
    [(1, 4, 0), (PAGE, 8, 3), (7 * PAGE + 5, 3, 11), (20 * PAGE, 64, 0)],
)
@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "touch"])
def test_populate_faults_every_page_in_and_changes_no_byte(
    monkeypatch: pytest.MonkeyPatch, size: int, threads: int, offset: int, madvise: bool
) -> None:
    monkeypatch.setattr(host_pinning, "_POPULATE", host_pinning._Populate())
    if not madvise:
        monkeypatch.setattr(host_pinning._POPULATE, "refused", True)
    mapping = mmap.mmap(-1, size + offset + PAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    original = np.random.default_rng(size).integers(0, 256, array.size, dtype=np.uint8)
    array[:] = original
    populate(array.__array_interface__["data"][0] + offset, size, threads)
    assert np.array_equal(array, original)
    del array
    mapping.close()


def test_populate_of_nothing_does_nothing() -> None:
    populate(0, 0, 4)


def limit_memlock(monkeypatch: pytest.MonkeyPatch, soft: int, euid: int) -> None:
    monkeypatch.setattr(host_pinning.resource, "getrlimit", lambda _: (soft, soft))
    monkeypatch.setattr(host_pinning.os, "geteuid", lambda: euid)


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
    with caplog.at_level(logging.WARNING, logger="kvcore.host_pinning"):
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
        host_pinning.resource, "getrlimit", lambda _: (host_pinning.resource.RLIM_INFINITY,) * 2
    )
    check_memlock(1 << 50)


def test_a_kernel_without_populate_write_is_told_once_and_pages_are_touched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def refusing(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        return -1

    populating = host_pinning._Populate()
    monkeypatch.setattr(host_pinning, "_POPULATE", populating)
    monkeypatch.setattr(host_pinning, "_libc_madvise", lambda: refusing)
    monkeypatch.setattr(host_pinning.ctypes, "get_errno", lambda: host_pinning.errno.EINVAL)
    mapping = mmap.mmap(-1, 4 * PAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    array[:] = 7
    with caplog.at_level(logging.INFO, logger="kvcore.host_pinning"):
        for _ in range(2):
            populate(array.__array_interface__["data"][0], array.size, 1)
    assert calls == [host_pinning.MADV_POPULATE_WRITE] and populating.refused
    assert (array == 7).all() and caplog.text.count("MADV_POPULATE_WRITE refused (EINVAL)") == 1
    del array
    mapping.close()


def test_a_refused_registration_leaves_no_error_for_torchs_next_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cudaHostRegister's failure stays the runtime's last error until read: the registrar
    reads it off before raising, or the engine's next launch would report it as its own."""
    from kvcore.kernels import cudart

    cleared: list[None] = []
    monkeypatch.setattr(cudart, "clear_pending_error", lambda: cleared.append(None) or True)

    class RefusingRuntime:
        class cudaError:
            success = 0

        @staticmethod
        def cudaHostRegister(ptr: int, nbytes: int, flags: int) -> int:
            return 1

        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:
            return 0

        @staticmethod
        def cudaGetErrorString(err: int) -> str:
            return "invalid argument"

    registrar = object.__new__(host_pinning.CudaHostRegistrar)
    registrar._cudart = RefusingRuntime()
    registrar.unregister(4096)
    assert cleared == []
    with pytest.raises(
        PinnedMemoryError, match=r"cudaHostRegister\(8192\) failed: invalid argument"
    ):
        registrar.register(4096, 8192)
    assert cleared == [None]
