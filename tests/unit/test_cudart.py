"""kvcore.kernels.cudart on a machine without a CUDA driver, and with a stand-in for one."""

from __future__ import annotations

import contextlib
import ctypes
import types

import pytest
import torch

from kvcore.kernels import cuda, cudart, overlap_ring, reference
from kvcore.planning.layers import layer_pairs
from kvcore.planning.staged_chunks import staged_chunks
from kvcore.runs import Runs


def test_without_a_loaded_driver_there_is_no_device_address(monkeypatch):
    monkeypatch.setattr(cudart, "_loaded", lambda name: None)
    cudart._pointer_attribute.cache_clear()
    try:
        assert cudart.device_address(4096) is None
    finally:
        cudart._pointer_attribute.cache_clear()


class FakeDriver:
    """cuPointerGetAttribute(DEVICE_POINTER) over a table of mapped ranges; records the
    attributes asked for."""

    def __init__(self, mapped: dict[int, int]) -> None:
        self.mapped = mapped
        self.asked: list[int] = []

    def __call__(self, out, attribute: int, pointer: int) -> int:
        self.asked.append(attribute)
        if pointer not in self.mapped:
            return 1  # CUDA_ERROR_INVALID_VALUE
        ctypes.cast(out, ctypes.POINTER(ctypes.c_uint64)).contents.value = self.mapped[pointer]
        return 0


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver({4096: 1 << 40})
    monkeypatch.setattr(cudart, "_pointer_attribute", lambda: driver)
    return driver


def test_device_address_is_the_drivers_mapping(fake_driver):
    assert cudart.device_address(4096) == 1 << 40
    assert fake_driver.asked == [cudart._DEVICE_POINTER_ATTRIBUTE]


def test_an_unmapped_or_null_pointer_has_no_device_address(fake_driver):
    assert cudart.device_address(8192) is None
    assert cudart.device_address(0) is None
    assert fake_driver.asked == [cudart._DEVICE_POINTER_ATTRIBUTE]


def test_layers_whose_host_memory_the_gpu_cannot_reach_are_gathered_one_by_one(monkeypatch):
    monkeypatch.setattr(cuda, "triton_available", lambda: True)
    monkeypatch.setattr(cuda, "host_pinned", lambda pairs: True)
    monkeypatch.setattr(cuda, "device_address", lambda pointer: None)
    host = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    device = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    ops = cuda._CudaIndexedOps(gather_ctas=4, staged_pieces=2, gather_ctas_to_host=2)
    assert ops._launch(layer_pairs(host, device)) == "gather_layers_unavailable:host_pointer"


def test_the_gather_takes_its_ctas_by_the_side_it_writes():
    ops = cuda._CudaIndexedOps(gather_ctas=8, staged_pieces=1, gather_ctas_to_host=3)
    host = torch.zeros(4, 2, dtype=torch.int64)
    device_side = torch.empty(4, 2, dtype=torch.int64, device="meta")
    assert ops.ctas_for(host) == 3
    assert ops.ctas_for(device_side) == 8


def test_device_rows_under_the_short_row_bytes_take_the_short_row_ctas():
    ops = cuda._CudaIndexedOps(
        gather_ctas=8, staged_pieces=1, gather_ctas_to_host=3, short_rows=(4, 2048)
    )
    mla_rows = torch.empty(4, 288, dtype=torch.int32, device="meta")  # 1152 B
    mha_rows = torch.empty(4, 256, dtype=torch.int64, device="meta")  # 2048 B
    host_rows = torch.zeros(4, 2, dtype=torch.int64)
    assert [ops.ctas_for(t) for t in (mla_rows, mha_rows, host_rows)] == [4, 8, 3]


def test_the_policy_carries_both_cta_counts_from_the_settings():
    from kvcore.config import KVCoreConfig
    from kvcore.planning.path_policy import policy_from_config

    env = {
        "KVCORE_GATHER_CTAS": "6",
        "KVCORE_GATHER_CTAS_TO_HOST": "2",
        "KVCORE_GATHER_CTAS_SHORT_ROWS": "3",
        "KVCORE_RING_SCATTER_CTAS": "12",
    }
    policy = policy_from_config(KVCoreConfig.from_env(env))
    assert (policy.gather_ctas, policy.gather_ctas_to_host, policy.gather_ctas_short_rows) == (
        6,
        2,
        3,
    )
    assert policy.ring_scatter_ctas == 12
    defaults = policy_from_config(KVCoreConfig.from_env({}))
    assert (defaults.gather_ctas, defaults.gather_ctas_to_host) == (8, 4)
    assert (defaults.gather_ctas_short_rows, defaults.short_row_bytes) == (4, 2048)
    assert defaults.ring_scatter_ctas == cuda.RING_SCATTER_CTAS == 64


def test_a_staged_page_in_of_many_long_units_goes_through_a_ring_of_slots():
    mib, kib32 = 1 << 20, 32 * 1024
    # vLLM's 2048-token job: 64 units of 4 MiB fill a 256 MiB buffer, a slot each.
    assert cuda.overlap_slots(256 * mib, [128], kib32, pairs=64) == (128, 64)
    # Longer units: as many slots as fit, reused round after round.
    assert cuda.overlap_slots(256 * mib, [512], kib32, pairs=64) == (512, 16)
    assert cuda.overlap_slots(256 * mib, [4096, 100], kib32, pairs=8) == (4096, 2)
    # Never more slots than units.
    assert cuda.overlap_slots(256 * mib, [64], kib32, pairs=4) == (64, 4)
    # Fewer than four units (SGLang's per-layer K and V): in turn.
    assert cuda.overlap_slots(256 * mib, [128], kib32, pairs=2) is None
    # Units under 1 MiB on average: in turn.
    assert cuda.overlap_slots(256 * mib, [31], kib32, pairs=64) is None
    # Fewer than two slots fit: in turn.
    assert cuda.overlap_slots(256 * mib, [4097], kib32, pairs=8) is None
    assert cuda.overlap_slots(256 * mib, [], kib32, pairs=8) is None


def test_a_rings_units_take_the_slots_in_turn_each_its_own_rows_of_the_buffer():
    rows_per_pair, words, slots, slot_rows = 6, 4, 3, 8
    host = [torch.arange(p * 100, p * 100 + 40 * words).view(40, words) for p in range(5)]
    device = [torch.zeros(40, words, dtype=torch.int64) for _ in range(5)]
    pairs = layer_pairs(host, device)
    dst_rows = torch.tensor([7, 3, 30, 12, 0, 25])
    host_runs = Runs(torch.tensor([2]), torch.tensor([rows_per_pair]))
    chunks = staged_chunks(host_runs, rows_per_pair, rows_per_pair)
    prepared = reference.prepare_stage_in(chunks, dst_rows, torch.device("cpu"))
    staging = torch.zeros(slots * slot_rows * words * 8, dtype=torch.uint8)
    units = list(overlap_ring._staged_units(pairs, prepared, staging, slot_rows, slots))
    assert len(units) == 5
    base = staging.data_ptr()
    for number, (src_words, runs, staged, dst_words, rows) in enumerate(units):
        assert src_words is pairs.src_words[number] and dst_words is pairs.dst_words[number]
        assert runs == ((2, rows_per_pair),) and rows is prepared.chunks[0][1]
        # Unit n takes slot n % 3: its rows start that slot's rows into the buffer.
        assert staged.shape == (rows_per_pair, words)
        assert staged.data_ptr() - base == (number % slots) * slot_rows * words * 8


def test_the_layer_rings_scatter_takes_the_policys_ctas():
    from kvcore.kernels import kernels_for
    from kvcore.planning.path_policy import PathPolicy

    ops = cuda._CudaIndexedOps(
        gather_ctas=8, staged_pieces=1, gather_ctas_to_host=3, ring_scatter_ctas=12
    )
    assert ops._slot_scatter.ctas == 12
    assert cuda._CudaIndexedOps(8, 1, 3)._slot_scatter.ctas == cuda.RING_SCATTER_CTAS
    named = kernels_for(torch.device("cuda"), PathPolicy(ring_scatter_ctas=5)).name
    assert "ring_scatter_ctas=5" in named


def test_the_policy_opens_the_address_ring_only_where_a_cuda_runtime_is_loaded(monkeypatch):
    from kvcore.kernels import kernels_for
    from kvcore.planning.path_policy import PathPolicy

    device = torch.device("cuda")
    monkeypatch.setattr(cuda, "stream_calls", lambda: object())
    assert kernels_for(device, PathPolicy(address_ring=False)).open_address_ring is None
    assert kernels_for(device, PathPolicy()).open_address_ring is not None
    monkeypatch.setattr(cuda, "stream_calls", lambda: None)
    assert kernels_for(device, PathPolicy()).open_address_ring is None


def test_a_layered_gather_that_falls_back_pair_by_pair_waits_for_its_rows_first(monkeypatch):
    """Rows kept on the device by ``prepare_rows`` may have been uploaded on another stream:
    the per-pair gathers of a fallback read them only after the current stream is ordered
    on that upload, as the one-launch path is."""
    events: list[str] = []

    class Upload:
        def order_current_stream(self, handle: int | None = None) -> int:
            events.append("ordered")
            return 7

    def prepare_gather(src_words, dst_words):
        def gather(src_idx, dst_idx):
            events.append("gather")

        return gather

    ops = cuda._CudaIndexedOps(gather_ctas=4, staged_pieces=1, gather_ctas_to_host=2)
    monkeypatch.setattr(ops, "_launch", lambda pairs: "gather_layers_unavailable:layout")
    monkeypatch.setattr(ops, "prepare_gather", prepare_gather)
    host = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    device = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    idx = torch.arange(4)
    rows = cuda._DeviceRows(idx, idx, (Upload(),))
    reason = ops.gather_prepared(layer_pairs(host, device), rows)
    assert reason == "gather_layers_unavailable:layout"
    assert events == ["ordered", "gather", "gather"]


def test_a_layered_gather_reads_the_current_stream_once_for_its_rows_and_its_offsets(
    monkeypatch,
):
    """The rows' upload and the launch table's offsets are ordered on one stream handle,
    read once a launch (host time on every request's gather)."""
    seen: list[object] = []

    class Upload:
        def order_current_stream(self, handle: int | None = None) -> int:
            seen.append(("rows", handle))
            return 7

    class Offsets:
        def order_current_stream(self, handle: int | None = None) -> int:
            seen.append(("offsets", handle))
            return 7 if handle is None else handle

    class Gather:
        def rows_between(self, src_idx, dst_idx, begin, end):
            seen.append("launch")

    launch = types.SimpleNamespace(offsets=Offsets(), gather=Gather())
    ops = cuda._CudaIndexedOps(gather_ctas=4, staged_pieces=1, gather_ctas_to_host=2)
    monkeypatch.setattr(ops, "_launch", lambda pairs: launch)
    host = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    device = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    idx = torch.arange(4)
    assert (
        ops.gather_prepared(layer_pairs(host, device), cuda._DeviceRows(idx, idx, (Upload(),)))
        is None
    )
    assert seen == [("rows", None), ("offsets", 7), "launch"]
    seen.clear()
    # Rows already on the device: no upload to order, so the offsets read the handle.
    assert ops.gather_prepared(layer_pairs(host, device), cuda._DeviceRows(idx, idx, ())) is None
    assert seen == [("offsets", None), "launch"]


def test_a_ranged_gather_hands_its_entries_to_the_launch_unsliced(monkeypatch):
    """``gather_range``: the rows' upload and the offsets ordered as for a whole gather, the
    launch given the prepared indices and the range; entries outside them refused; where
    no layered launch serves the pairs, each pair's gather gets the range's slices."""
    seen: list[object] = []

    class Offsets:
        def order_current_stream(self, handle: int | None = None) -> int:
            seen.append(("offsets", handle))
            return 7

    def rows_between(src_idx, dst_idx, begin, end):
        seen.append(("launch", src_idx, dst_idx, begin, end))

    launch = types.SimpleNamespace(
        offsets=Offsets(), gather=types.SimpleNamespace(rows_between=rows_between)
    )
    ops = cuda._CudaIndexedOps(gather_ctas=4, staged_pieces=1, gather_ctas_to_host=2)
    monkeypatch.setattr(ops, "_launch", lambda pairs: launch)
    host = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    device = [torch.zeros(8, 16, dtype=torch.int64) for _ in range(2)]
    pairs = layer_pairs(host, device)
    src_idx, dst_idx = torch.arange(6), torch.arange(6).flip(0)
    rows = cuda._DeviceRows(src_idx, dst_idx, ())
    assert ops.gather_range(pairs, rows, 2, 5) is None
    assert seen == [("offsets", None), ("launch", src_idx, dst_idx, 2, 5)]
    for begin, end in ((4, 3), (-1, 2), (0, 7)):
        with pytest.raises(ValueError, match="outside 6 prepared rows"):
            ops.gather_range(pairs, rows, begin, end)
    with pytest.raises(TypeError, match="prepare_rows"):
        ops.gather_range(pairs, (src_idx, dst_idx), 0, 6)

    gathered: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prepare_gather(src_words, dst_words):
        return lambda src, dst: gathered.append((src, dst))

    monkeypatch.setattr(ops, "_launch", lambda pairs: "gather_layers_unavailable:layout")
    monkeypatch.setattr(ops, "prepare_gather", prepare_gather)
    assert ops.gather_range(pairs, rows, 1, 4) == "gather_layers_unavailable:layout"
    assert len(gathered) == 2
    for src, dst in gathered:
        assert torch.equal(src, src_idx[1:4]) and torch.equal(dst, dst_idx[1:4])


class _Log(list):
    """What the fake streams and events were asked to do, in order."""


class _FakeEvent:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(f"{self.name} recorded on {stream.name}")


class _FakeStream:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits {event.name}")


class _FakeLanes:
    def __init__(self, log: _Log) -> None:
        self.dma = _FakeStream(log, "dma")
        self.filled: list[_FakeEvent] = []
        self.freed: list[_FakeEvent] = []
        self.log = log

    def events_for(self, slots: int) -> None:
        while len(self.filled) < slots:
            n = len(self.filled)
            self.filled.append(_FakeEvent(self.log, f"filled{n}"))
            self.freed.append(_FakeEvent(self.log, f"freed{n}"))


def _fake_cuda_streams(monkeypatch) -> tuple[_Log, dict]:
    """Lanes of fake streams for a "cuda" device, the current stream a fake too, and
    ``torch.cuda.stream`` noting which stream work is issued under."""
    log = _Log()
    current = _FakeStream(log, "current")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(torch.cuda, "stream", on)
    return log, {torch.device("cuda", 0): _FakeLanes(log)}


def test_a_slot_ring_fills_on_the_second_stream_drains_on_the_current_and_ends_joined(
    monkeypatch,
):
    log, lanes = _fake_cuda_streams(monkeypatch)
    with overlap_ring.slot_ring(lanes, torch.device("cuda", 0), 2) as ring:
        with ring.filling(1, reused=False):
            log.append("dma into slot 1")
        with ring.draining(1, refilled=True):
            log.append("scatter from slot 1")
        with ring.filling(1, reused=True):
            log.append("dma into slot 1 again")
        with ring.draining(1, refilled=False):
            log.append("scatter from slot 1 again")
    assert log == [
        "dma waits current",
        "on dma",
        "dma into slot 1",
        "filled1 recorded on dma",
        "off dma",
        "current waits filled1",
        "scatter from slot 1",
        "freed1 recorded on current",
        "on dma",
        "dma waits freed1",
        "dma into slot 1 again",
        "filled1 recorded on dma",
        "off dma",
        "current waits filled1",
        "scatter from slot 1 again",
        "current waits dma",
    ]


class _FakeCalls:
    """StreamCalls noting each call by the names of its handles (events 100 on, streams
    below)."""

    def __init__(self, log: _Log, names: dict[int, str]) -> None:
        self.log, self.names = log, names

    def event(self) -> int:
        handle = 100 + len([n for n in self.names if n >= 100])
        self.names[handle] = f"event{handle - 100}"
        return handle

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.log.append(f"copy {nbytes} from {src} to {dst} on {self.names[stream]}")

    def record(self, event: int, stream: int) -> None:
        self.log.append(f"{self.names[event]} recorded on {self.names[stream]}")

    def wait(self, stream: int, event: int) -> None:
        self.log.append(f"{self.names[stream]} waits {self.names[event]}")


def _address_ring_on_fakes(monkeypatch) -> tuple[_Log, _FakeCalls, dict]:
    log, names = _Log(), {1: "current", 2: "dma"}
    calls = _FakeCalls(log, names)
    monkeypatch.setattr(
        overlap_ring.torch.cuda, "Stream", lambda device: types.SimpleNamespace(cuda_stream=2)
    )
    monkeypatch.setattr(overlap_ring, "current_stream_handle", lambda device, index: 1)
    return log, calls, {}


def test_an_address_ring_copies_on_the_second_stream_drains_on_the_current_and_ends_joined(
    monkeypatch,
):
    log, calls, lanes = _address_ring_on_fakes(monkeypatch)
    device = torch.device("cuda", 0)
    with overlap_ring.address_ring(lanes, device, 2, calls) as ring:
        ring.fill(1, False, [(5000, 9000, 64), (5064, 9500, 32)])
        with ring.draining(1, refilled=True):
            log.append("scatter from slot 1")
        ring.fill(1, True, [(5000, 7000, 96)])
        with ring.draining(1, refilled=False):
            log.append("scatter from slot 1 again")
    # event0 joins the streams; slot s has filled event 1 + 2s and freed event 2 + 2s.
    assert log == [
        "event0 recorded on current",
        "dma waits event0",
        "copy 64 from 9000 to 5000 on dma",
        "copy 32 from 9500 to 5064 on dma",
        "event3 recorded on dma",
        "current waits event3",
        "scatter from slot 1",
        "event4 recorded on current",
        "dma waits event4",
        "copy 96 from 7000 to 5000 on dma",
        "event3 recorded on dma",
        "current waits event3",
        "scatter from slot 1 again",
        "event0 recorded on dma",
        "current waits event0",
    ]
    # The device's lanes are kept: a second ring makes no new stream or events.
    log.clear()
    with overlap_ring.address_ring(lanes, device, 2, calls):
        pass
    assert len(calls.names) == 2 + 5
    assert log[-1] == "current waits event0"


def test_a_failed_call_through_an_address_ring_still_ends_joined(monkeypatch):
    log, calls, lanes = _address_ring_on_fakes(monkeypatch)
    with (
        pytest.raises(RuntimeError, match="a copy failed"),
        overlap_ring.address_ring(lanes, torch.device("cuda", 0), 2, calls),
    ):
        raise RuntimeError("a copy failed")
    assert log[-2:] == ["event0 recorded on dma", "current waits event0"]


def test_a_failed_call_through_either_ring_still_ends_joined_to_the_second_stream(monkeypatch):
    log, lanes = _fake_cuda_streams(monkeypatch)
    with (
        pytest.raises(RuntimeError, match="a copy failed"),
        overlap_ring.slot_ring(lanes, torch.device("cuda", 0), 2) as ring,
        ring.filling(0, reused=False),
    ):
        raise RuntimeError("a copy failed")
    assert log[0] == "dma waits current" and log[-1] == "current waits dma"
    log.clear()
    cpu_lanes = {torch.device("cpu"): lanes[torch.device("cuda", 0)]}

    def failing_copy(*args, **kwargs):
        raise RuntimeError("a copy failed")

    monkeypatch.setattr(overlap_ring.reference, "listed_runs_to_staging", failing_copy)
    pairs, prepared, staging = _overlap_job()
    with pytest.raises(RuntimeError, match="a copy failed"):
        overlap_ring.stage_in_overlapped(cpu_lanes, pairs, prepared, staging, 8, 3)
    assert log[0] == "dma waits current" and log[-1] == "current waits dma"


def _overlap_job():
    """Five pairs of 6 host rows into scattered rows, a staging buffer of 3 slots of 8 rows
    (on the CPU: the ring's lanes are looked up by the buffer's device, here fakes)."""
    words = 4
    host = [torch.arange(p * 100, p * 100 + 40 * words).view(40, words) for p in range(5)]
    dsts = [torch.full((40, words), -1, dtype=torch.int64) for _ in range(5)]
    pairs = layer_pairs(host, dsts)
    chunks = staged_chunks(Runs(torch.tensor([2]), torch.tensor([6])), 6, 6)
    prepared = reference.prepare_stage_in(chunks, DST_ROWS, torch.device("cpu"))
    staging = torch.zeros(3 * 8 * words * 8, dtype=torch.uint8)
    return pairs, prepared, staging


DST_ROWS = torch.tensor([7, 3, 30, 12, 0, 25])


def test_an_overlapped_page_in_copies_every_pair_in_rounds_of_one_unit_a_slot(monkeypatch):
    log, lanes = _fake_cuda_streams(monkeypatch)
    cpu_lanes = {torch.device("cpu"): lanes[torch.device("cuda", 0)]}
    pairs, prepared, staging = _overlap_job()
    overlap_ring.stage_in_overlapped(cpu_lanes, pairs, prepared, staging, 8, 3)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[DST_ROWS] = False
    for src, dst in zip(pairs.srcs, pairs.dsts, strict=True):
        assert torch.equal(dst[DST_ROWS], src[2:8])
        assert bool((dst[untouched] == -1).all())
    # Five units through three slots: a round of three, then one of two that first waits
    # for the scatters that read its slots; one stream switch a round.
    assert log.count("on dma") == 2
    assert [e for e in log if "freed" in e] == [
        "freed0 recorded on current",
        "freed1 recorded on current",
        "freed2 recorded on current",
        "dma waits freed0",
        "dma waits freed1",
    ]
    assert log[0] == "dma waits current" and log[-1] == "current waits dma"


def test_rows_uploaded_for_a_page_in_go_in_one_upload_and_device_ones_stay(monkeypatch):
    """Region staging's single upload: the host indices in one ``upload_all``, in order; an
    index already on the device is handed back untouched, none uploaded where all are."""
    calls: list[int] = []

    class Uploader:
        def upload_all(self, indices):
            calls.append(len(indices))
            return tuple(index + 100 for index in indices)

    ops = cuda._CudaIndexedOps(gather_ctas=4, staged_pieces=1, gather_ctas_to_host=2)
    monkeypatch.setattr(ops, "_uploader", lambda device: Uploader())
    first, second = torch.arange(3), torch.arange(4)
    uploaded = ops.upload_rows((first, second), torch.device("meta"))
    assert calls == [2] and [u.tolist() for u in uploaded] == [
        [100, 101, 102],
        [100, 101, 102, 103],
    ]
    on_device = torch.empty(5, device="meta")
    mixed = ops.upload_rows((first, on_device), torch.device("meta"))
    assert calls == [2, 1] and mixed[1] is on_device and mixed[0].tolist() == [100, 101, 102]
    both = (on_device, on_device)
    assert ops.upload_rows(both, torch.device("meta")) is both and calls == [2, 1]
