"""``LayeredLaunch.rows_between``: entries of the indices read in place by the direct launch
(by address, no slice made), sliced for Triton's JIT; checked with a stand-in for the
compiled kernel, as a CPU has none to launch."""

from __future__ import annotations

import types

import pytest
import torch

from kvcore.kernels import triton_layers

ROWS_A_TILE, LAYERS, CTAS = 4, 3, 64


def _launch(monkeypatch: pytest.MonkeyPatch, compiled: object) -> triton_layers.LayeredLaunch:
    """A launch over a stand-in table of ``LAYERS`` pairs on device ``cuda:0``, current there."""
    launch = object.__new__(triton_layers.LayeredLaunch)
    launch.table = types.SimpleNamespace(
        launch=types.SimpleNamespace(rows=ROWS_A_TILE), layers=LAYERS
    )
    launch.ctas = CTAS
    launch.device = torch.device("cuda", 0)
    launch._compiled = compiled
    launch._fixed_head = ("src table", "dst table", "offsets")
    launch._fixed_tail = ("layers and pitches",)
    launch._empty = False
    monkeypatch.setattr(triton_layers, "_current_raw_stream", lambda index: 99)
    monkeypatch.setattr(triton_layers, "_current_device_index", lambda: 0)
    monkeypatch.setattr(triton_layers, "launch_hooked", lambda: False)
    return launch


def _indices() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randperm(40, generator=gen)[:10], torch.randperm(40, generator=gen)[:10]


@pytest.mark.parametrize(("begin", "end"), [(3, 9), (0, 10), (9, 10)])
def test_the_direct_launch_reads_the_entries_by_address(monkeypatch, begin, end):
    runs: list[tuple] = []
    compiled = types.SimpleNamespace(
        run=lambda *args: runs.append(args), function="kernel", packed_metadata="meta"
    )
    src_idx, dst_idx = _indices()
    _launch(monkeypatch, compiled).rows_between(src_idx, dst_idx, begin, end)
    rows = end - begin
    tiles = -(-rows // ROWS_A_TILE) * LAYERS
    assert runs == [
        (
            min(CTAS, tiles),
            1,
            1,
            99,
            "kernel",
            "meta",
            None,
            None,
            None,
            "src table",
            "dst table",
            "offsets",
            src_idx.data_ptr() + begin * 8,
            dst_idx.data_ptr() + begin * 8,
            rows,
            "layers and pitches",
        )
    ]


def test_through_the_jit_the_entries_go_as_slices_and_whole_indices_as_they_are(monkeypatch):
    launch = _launch(monkeypatch, None)
    seen: list[tuple] = []
    monkeypatch.setattr(launch, "_jit", lambda src, dst, rows, tiles: seen.append((src, dst)))
    src_idx, dst_idx = _indices()
    launch.rows_between(src_idx, dst_idx, 2, 7)
    launch.rows_between(src_idx, dst_idx, 0, 10)
    (part_src, part_dst), (whole_src, whole_dst) = seen
    assert torch.equal(part_src, src_idx[2:7]) and torch.equal(part_dst, dst_idx[2:7])
    assert whole_src is src_idx and whole_dst is dst_idx


def test_an_empty_range_launches_nothing(monkeypatch):
    runs: list[tuple] = []
    compiled = types.SimpleNamespace(
        run=lambda *args: runs.append(args), function="kernel", packed_metadata="meta"
    )
    src_idx, dst_idx = _indices()
    _launch(monkeypatch, compiled).rows_between(src_idx, dst_idx, 4, 4)
    assert runs == []
