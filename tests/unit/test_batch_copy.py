"""batch_copy_pointers' submission split, with the CUDA runtime replaced by a recorder."""

from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace

import numpy as np
import pytest

from kvcore.kernels import batch_copy


class _FakeAttributes:
    def getPtr(self) -> int:
        return 0


class _FakeRuntime:
    cudaMemcpyAttributes = _FakeAttributes
    cudaMemcpySrcAccessOrder = enum.Enum(
        "Order", "cudaMemcpySrcAccessOrderStream cudaMemcpySrcAccessOrderAny"
    )
    cudaMemcpyFlags = enum.Enum("Flags", "cudaMemcpyFlagPreferOverlapWithCompute")
    cudaError_t = int

    @staticmethod
    def cudaGetErrorName(err: int) -> tuple[int, bytes]:
        return 0, f"cudaError{err}".encode()


class _Recorder:
    """Stands in for the ctypes-bound cudaMemcpyBatchAsync: reads the arrays it is handed."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.calls: list[list[tuple[int, int, int]]] = []
        self.fail_on_call = fail_on_call

    def __call__(self, dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, stream) -> int:
        def read(address: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(address))

        self.calls.append(list(zip(read(dsts), read(srcs), read(sizes), strict=True)))
        return 1 if len(self.calls) == self.fail_on_call else 0


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(batch_copy, "_runtime", lambda: _FakeRuntime)
    monkeypatch.setattr(batch_copy, "_direct_batch_call", lambda: recorder)
    return recorder


def _arrays(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(count)
    return tuple(rng.integers(1, 1 << 40, count, dtype=np.uint64) for _ in range(3))


STREAM = SimpleNamespace(cuda_stream=0x1234)


@pytest.mark.parametrize(
    ("count", "limit", "expected_calls"),
    [(700, 256, [256, 256, 188]), (256, 256, [256]), (5, 2, [2, 2, 1]), (700, None, [700])],
)
def test_copies_are_split_into_calls_of_at_most_the_limit_in_order(
    recorder: _Recorder, count: int, limit: int | None, expected_calls: list[int]
):
    dsts, srcs, sizes = _arrays(count)
    batch_copy.batch_copy_pointers(
        dsts, srcs, sizes, STREAM, source_in_stream_order=True, max_copies_per_call=limit
    )
    assert [len(call) for call in recorder.calls] == expected_calls
    submitted = [copy for call in recorder.calls for copy in call]
    assert submitted == list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True))


def test_the_default_limit_keeps_every_call_within_the_driver_safe_size(recorder: _Recorder):
    dsts, srcs, sizes = _arrays(3 * batch_copy.MAX_COPIES_PER_CALL + 1)
    batch_copy.batch_copy_pointers(dsts, srcs, sizes, STREAM, source_in_stream_order=False)
    assert max(len(call) for call in recorder.calls) == batch_copy.MAX_COPIES_PER_CALL
    assert sum(len(call) for call in recorder.calls) == len(sizes)


def test_a_refused_call_raises_and_submits_nothing_after_it(
    recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
):
    cleared: list[None] = []
    monkeypatch.setattr(batch_copy, "clear_pending_error", lambda: cleared.append(None) or True)
    recorder.fail_on_call = 2
    dsts, srcs, sizes = _arrays(600)
    with pytest.raises(batch_copy.BatchCopyError, match="cudaError1"):
        batch_copy.batch_copy_pointers(
            dsts, srcs, sizes, STREAM, source_in_stream_order=True, max_copies_per_call=256
        )
    assert [len(call) for call in recorder.calls] == [256, 256]
    # The refusal is read off the runtime: torch's next launch check must not find it.
    assert cleared == [None]


def test_a_non_positive_limit_is_refused(recorder: _Recorder):
    dsts, srcs, sizes = _arrays(4)
    with pytest.raises(ValueError, match="max_copies_per_call"):
        batch_copy.batch_copy_pointers(
            dsts, srcs, sizes, STREAM, source_in_stream_order=True, max_copies_per_call=0
        )
    assert recorder.calls == []
