"""vLLM's shared CPU tier pinned in steps (``KVCORE_HOST_POOL_PIN_FIRST``): the first rows
before the worker goes on, the rest on a thread, and kvcore's manager handing out only
pinned chunks, on vLLM's own region and manager classes with a recording registrar."""

from __future__ import annotations

import dataclasses
import mmap
import threading
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import SHARED_REGION_ONLY, second_workers_region, shared_region, spec_args

from kvcore.host_pinning import PinnedMemoryError
from kvcore.pin_progress import PinProgress, PinWatch, progress_path
from kvcore_vllm import region_faulting, region_pinning
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec

pytestmark = [pytest.mark.vllm, SHARED_REGION_ONLY]


def _pool_size(manager: Any) -> int:
    """The manager's pool size, under the installed release's name."""
    return int(getattr(manager, installed_shape().name("_num_chunks")))


ROW = 4 * mmap.PAGESIZE  # one chunk of every KV tensor: page-aligned, as vLLM requires
ROWS = 37


class Registrar:
    """Records registrations; the steps after the first wait for :attr:`go`."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.go = threading.Event()
        self.fail_at = fail_at

    def register(self, ptr: int, nbytes: int) -> None:
        if len(self.registered) == self.fail_at:
            raise PinnedMemoryError("cudaHostRegister(...) failed: out of memory")
        if self.registered:
            assert self.go.wait(30)
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def _region() -> Any:
    return shared_region(ROWS, ROW)


@pytest.fixture
def unregistered(monkeypatch) -> list[int]:
    """The addresses vLLM's cleanup unregisters (its own helper, recorded)."""
    from vllm.v1.kv_offload.cpu import shared_offload_region

    addresses: list[int] = []
    monkeypatch.setattr(shared_offload_region, "host_unregister", addresses.append)
    return addresses


def _pin(
    region: Any,
    key: str,
    registrar: Registrar,
    failures: list[Exception],
    fault: Callable[[int, int, int], None] | None = None,
) -> None:
    from vllm.v1.kv_offload.cpu import gpu_worker

    stock = gpu_worker.pin_mmap_region
    with region_pinning.pinned_in_steps(
        gpu_worker, key, 10 * ROW, failures.append, lambda: registrar, fault
    ):
        gpu_worker.pin_mmap_region(region, worker_slot_only=True)
    assert gpu_worker.pin_mmap_region is stock


def _wait_ready(watch: PinWatch, ready: int) -> None:
    for _ in range(3000):
        if watch.ready == ready:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"pinned {watch.ready} rows, waited for {ready}")


def test_the_first_rows_are_pinned_before_the_worker_goes_on_and_the_rest_after(
    monkeypatch, unregistered
):
    monkeypatch.setattr(region_pinning, "STEP_BYTES", 8 * ROW)
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    registrar, failures = Registrar(), []
    try:
        _pin(region, key, registrar, failures)
        base = region._base.data_ptr()
        # The first step, rows [0, 10), is in; the thread waits to pin the next.
        assert failures == [] and region.is_pinned
        assert registrar.registered == [(base, 10 * ROW)]
        watch = PinWatch.open(key)
        assert watch is not None and (watch.total, watch.ready) == (ROWS, 10)
        manager = KVCoreCPUOffloadingManager(ROWS, pinned_keys=[key])
        assert manager._get_num_free_chunks() == 10
        ctx = ReqContext(req_id="r")
        keys = [make_offload_key(f"k{i}".encode(), 0) for i in range(8)]
        output = manager.prepare_store(keys, ctx)
        assert output is not None and max(output.store_spec.block_ids.tolist()) < 10
        # A store bigger than what is pinned finds no room yet.
        more = [make_offload_key(f"m{i}".encode(), 0) for i in range(12)]
        assert manager.prepare_store(more, ReqContext(req_id="s")) is None
        registrar.go.set()
        _wait_ready(watch, ROWS)
        # The rest in steps of 8 rows, each ending on a row: 10-18, 18-26, 26-34, 34-37.
        ends = [(ptr - base + size) // ROW for ptr, size in registrar.registered]
        assert ends == [10, 18, 26, 34, 37]
        assert manager._get_num_free_chunks() == ROWS - 8
        assert manager._pinned == []  # read no more once every chunk is in
        watch.close()
    finally:
        region.cleanup()
    # vLLM's cleanup unregistered every range kvcore registered, last first, and the
    # progress file went with it.
    assert unregistered == [ptr for ptr, _ in reversed(registrar.registered)]
    assert not region.is_pinned and not progress_path(key).exists()


def test_a_cleanup_while_pinning_stops_the_thread_and_unregisters_what_got_in(
    monkeypatch, unregistered
):
    monkeypatch.setattr(region_pinning, "STEP_BYTES", 8 * ROW)
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    registrar = Registrar()
    _pin(region, key, registrar, [])
    threading.Timer(0.2, registrar.go.set).start()
    region.cleanup()  # waits for the step in progress, then nothing more is pinned
    assert unregistered == [ptr for ptr, _ in reversed(registrar.registered)]
    assert len(registrar.registered) <= 2 and not progress_path(key).exists()


def test_a_failed_first_step_leaves_the_region_to_vllm_counted(monkeypatch, unregistered):
    from vllm.v1.kv_offload.cpu import gpu_worker

    stock_calls: list[Any] = []
    monkeypatch.setattr(gpu_worker, "pin_mmap_region", lambda *a, **k: stock_calls.append(a))
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    failures: list[Exception] = []
    try:
        with region_pinning.pinned_in_steps(
            gpu_worker, key, 10 * ROW, failures.append, lambda: Registrar(fail_at=0)
        ):
            gpu_worker.pin_mmap_region(region, worker_slot_only=True)
        assert [type(f) for f in failures] == [PinnedMemoryError]
        assert stock_calls == [(region,)]  # vLLM's own registration, whole
        assert PinWatch.open(key) is None  # the manager hands out every chunk
        assert KVCoreCPUOffloadingManager(ROWS, pinned_keys=[key])._get_num_free_chunks() == ROWS
    finally:
        region.cleanup()


def test_each_step_faults_its_rows_before_registering_them(monkeypatch, unregistered):
    monkeypatch.setattr(region_pinning, "STEP_BYTES", 8 * ROW)
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    registrar = Registrar()
    events: list[tuple[str, int, int]] = []
    shares: list[int] = []
    register = registrar.register

    def recorded_register(ptr: int, nbytes: int) -> None:
        register(ptr, nbytes)
        events.append(("register", ptr, nbytes))

    def recorded_fault(ptr: int, nbytes: int, at_once: int) -> None:
        events.append(("fault", ptr, nbytes))
        shares.append(at_once)

    monkeypatch.setattr(registrar, "register", recorded_register)
    registrar.go.set()
    try:
        _pin(region, key, registrar, [], recorded_fault)
        watch = PinWatch.open(key)
        assert watch is not None
        _wait_ready(watch, ROWS)
        watch.close()
    finally:
        region.cleanup()
    # Each range faulted once, before its registration; the first step alone with every
    # thread, the later ones several at once (ahead of the registrations), sharing them.
    faults = [(ptr, n) for kind, ptr, n in events if kind == "fault"]
    assert sorted(faults) == sorted(registrar.registered) and len(faults) > 2
    for ptr, nbytes in registrar.registered:
        assert events.index(("fault", ptr, nbytes)) < events.index(("register", ptr, nbytes))
    assert shares[0] == 1 and set(shares[1:]) == {region_pinning.FAULTED_AHEAD}


def test_a_failed_first_step_faults_the_region_in_before_vllm_registers_it(
    monkeypatch, unregistered
):
    from vllm.v1.kv_offload.cpu import gpu_worker

    events: list[Any] = []
    monkeypatch.setattr(
        gpu_worker, "pin_mmap_region", lambda *a, **k: events.append(("stock", a[0]))
    )
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    failures: list[Exception] = []
    try:
        with region_pinning.pinned_in_steps(
            gpu_worker,
            key,
            10 * ROW,
            failures.append,
            lambda: Registrar(fail_at=0),
            lambda ptr, n, at_once: events.append(("fault", ptr, n)),
        ):
            gpu_worker.pin_mmap_region(region, worker_slot_only=True)
        base = region._base.data_ptr()
        # The first step faulted its rows before its registration failed; then the whole
        # region, which vLLM's registration would otherwise fault on one thread.
        assert events == [
            ("fault", base, 10 * ROW),
            ("fault", base, ROWS * ROW),
            ("stock", region),
        ]
        assert [type(f) for f in failures] == [PinnedMemoryError]
    finally:
        region.cleanup()


def test_a_failed_faulting_leaves_the_region_to_vllms_registration(monkeypatch, unregistered):
    from vllm.v1.kv_offload.cpu import gpu_worker

    stock_calls: list[Any] = []
    monkeypatch.setattr(gpu_worker, "pin_mmap_region", lambda *a, **k: stock_calls.append(a))
    region, key = _region(), f"engine-{uuid.uuid4().hex}-r0"
    failures: list[Exception] = []

    def refused(address: int, nbytes: int, at_once: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    try:
        with region_pinning.pinned_in_steps(
            gpu_worker, key, 10 * ROW, failures.append, Registrar, refused
        ):
            gpu_worker.pin_mmap_region(region, worker_slot_only=True)
        # The first step's faulting, then the whole region's: each counted, none raised.
        assert [type(f) for f in failures] == [OSError, OSError]
        assert stock_calls == [(region,)] and PinWatch.open(key) is None
    finally:
        region.cleanup()


def _spec(monkeypatch, world_size: int = 1) -> KVCoreCPUOffloadingSpec:
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", lambda self, kv: SimpleNamespace(kv=kv))
    (config,) = spec_args({"cpu_bytes_to_use": 1 << 20})
    parallel = dataclasses.replace(config.parallel, world_size=world_size)
    return KVCoreCPUOffloadingSpec(dataclasses.replace(config, parallel=parallel))


@pytest.mark.parametrize(
    ("env", "world_size", "steps"),
    [
        ({"KVCORE_HOST_POOL_PIN_FIRST": "1GiB"}, 1, True),
        ({}, 1, False),
        ({"KVCORE_HOST_POOL_PIN_FIRST": "1GiB"}, 2, True),
        ({"KVCORE_HOST_POOL_PIN_FIRST": "1GiB", "KVCORE_HOST_POOL": "0"}, 1, False),
    ],
)
def test_the_worker_and_the_manager_agree_on_pinning_in_steps(monkeypatch, env, world_size, steps):
    from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region

    monkeypatch.delenv("KVCORE_HOST_POOL_PIN_FIRST", raising=False)
    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = _spec(monkeypatch, world_size)
    seen: list[Any] = []

    def stock_create(self: Any, kv: Any) -> Any:
        seen.append(gpu_worker.pin_mmap_region)
        seen.append(shared_offload_region._get_populate_write_fn)
        return SimpleNamespace(kv=kv)

    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", stock_create)
    stock = gpu_worker.pin_mmap_region
    populate = shared_offload_region._get_populate_write_fn
    spec.create_worker(SimpleNamespace(tensors=[]))
    # While the stock worker is built, pin_mmap_region is kvcore's where steps apply, and
    # the region is then left unfaulted for the steps to fault.
    assert (seen[0] is not stock) == steps and gpu_worker.pin_mmap_region is stock
    if steps:
        assert seen[1](None) is region_faulting._left_unfaulted
    else:
        assert "faulting_left_to_pinning" not in seen[1].__qualname__
    assert shared_offload_region._get_populate_write_fn is populate
    # The manager reads the worker's progress where, and only where, the worker pins in steps.
    key = region_pinning.progress_key(spec)
    assert key is not None
    progress = PinProgress(key, 64)
    try:
        manager = spec.get_manager()
        assert bool(manager._pinned) == steps
        assert manager._get_num_free_chunks() == (0 if steps else _pool_size(manager))
    finally:
        progress.close()


SLOT = 2 * mmap.PAGESIZE  # a worker's slot of each row: the row holds two workers' slots


def test_a_worker_of_several_pins_its_own_slots_in_steps_as_vllm_would_whole(
    monkeypatch, unregistered
):
    from vllm.v1.kv_offload.cpu import gpu_worker

    # The rest of a row (another worker's slot) saves enough to register slots alone.
    monkeypatch.setattr(gpu_worker, region_pinning.MIN_SAVED, mmap.PAGESIZE)
    monkeypatch.setattr(region_pinning, "STEP_BYTES", 8 * SLOT)
    stock_ranges: list[tuple[int, int]] = []
    monkeypatch.setattr(
        gpu_worker, "host_register", lambda ptr, n: stock_ranges.append((ptr, n)) or True
    )
    stock_region = second_workers_region(ROWS, SLOT)
    region = second_workers_region(ROWS, SLOT)
    key = f"engine-{uuid.uuid4().hex}-r1"
    registrar = Registrar()
    registrar.go.set()
    try:
        gpu_worker.pin_mmap_region(stock_region, worker_slot_only=True)
        stock_base = stock_region._base.data_ptr()
        _pin(region, key, registrar, [])
        watch = PinWatch.open(key)
        assert watch is not None
        _wait_ready(watch, ROWS)
        watch.close()
        base = region._base.data_ptr()
        # Every row's slot of the second worker, each a registration of its own: vLLM's
        # ranges, in steps of whole rows.
        assert [(p - base, n) for p, n in registrar.registered] == [
            (p - stock_base, n) for p, n in stock_ranges
        ]
        assert registrar.registered[0] == (base + SLOT, SLOT) and len(stock_ranges) == ROWS
    finally:
        stock_region.is_pinned = False  # its registration above was a recording
        stock_region.cleanup()
        region.cleanup()


def test_the_manager_hands_out_what_every_worker_has_pinned(monkeypatch):
    engine = f"engine-{uuid.uuid4().hex}"
    first, second = PinProgress(f"{engine}-r0", ROWS), PinProgress(f"{engine}-r1", ROWS)
    try:
        first.publish(10)
        second.publish(5)
        keys = [f"{engine}-r0", f"{engine}-r1", f"{engine}-r2"]  # r2 pinned its part whole
        manager = KVCoreCPUOffloadingManager(ROWS, pinned_keys=keys)
        assert manager._get_num_free_chunks() == 5
        second.publish(ROWS)
        assert manager._get_num_free_chunks() == 10
        first.publish(ROWS)
        assert manager._get_num_free_chunks() == ROWS and manager._pinned == []
    finally:
        first.close()
        second.close()
