"""``kvcore bench --host-pool``'s SGLang rows on the CPU: SGLang's own allocation with and
without kvcore's hook, nothing pinned."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed")
pytestmark = pytest.mark.sglang

from benchmarks import host_pool  # noqa: E402
from benchmarks.sglang import host_pool_build  # noqa: E402


def test_both_sides_build_the_pool_exactly_resident_and_readable():
    row = host_pool.measure(0.04, False, "sglang")
    assert "skipped" not in row, row
    dims = host_pool_build.pool_dims(0.04)
    pool_gib = dims[2] * host_pool_build.TOKEN_ROW_BYTES / (1 << 30)
    assert row["tensor_bytes_gib"] == pytest.approx(pool_gib)
    for side in host_pool.SIDES:
        assert f"{side}_error" not in row, row
        # SGLang's mapping and kvcore's are both the buffer's exact bytes, all faulted in.
        assert row[f"{side}_tier_gib"] == pytest.approx(pool_gib)
        assert row[f"{side}_rss_gib"] >= 0.9 * pool_gib
        assert row[f"{side}_identical"]


def test_pool_dims_fill_the_size_with_whole_pages_of_tokens():
    dims = host_pool_build.pool_dims(1.01)
    page = host_pool_build.PAGE_SIZE
    assert dims[:2] == (2, host_pool_build.LAYERS) and dims[3:] == (8, 128)
    assert dims[2] % page == 0
    assert dims[2] * host_pool_build.TOKEN_ROW_BYTES <= 1.01 * (1 << 30)
    assert (dims[2] + page) * host_pool_build.TOKEN_ROW_BYTES > 1.01 * (1 << 30)


class Recorder:
    """Records what CUDA would be asked to pin."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.ranges[ptr]


def test_the_pin_first_build_is_usable_after_its_first_share_and_waits_for_the_rest(
    monkeypatch,
):
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

    from kvcore import host_pinning

    # kvcore's side wraps SGLang's allocation for good, as in the bench's own process.
    monkeypatch.setattr(HostTensorAllocator, "allocate", vars(HostTensorAllocator)["allocate"])
    recorder = Recorder()
    monkeypatch.setattr(host_pinning, "CudaHostRegistrar", lambda: recorder)
    monkeypatch.setattr(host_pool_build, "PIN_FIRST_BYTES", 1 << 20)
    host_pool_build.load()
    buffer, nbytes, release, pinned_whole = host_pool_build.build_pin_first("kvcore", 0.04, True)
    assert nbytes == buffer.numel() * buffer.element_size()
    assert pinned_whole is not None
    pinned_whole()
    assert sum(recorder.ranges.values()) == nbytes
    # What the bench reads back lies in the first step's ranges (one registration a part).
    read = host_pool_build.first_step_bytes(buffer)
    start, end = read.data_ptr(), read.data_ptr() + read.numel()
    assert any(ptr <= start and end <= ptr + size for ptr, size in recorder.ranges.items())
    release()
    assert recorder.ranges == {}
