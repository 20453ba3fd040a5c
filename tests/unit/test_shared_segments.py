"""kvcore.shared_segments: one contiguous shared range over several memfd files."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcore import shared_segments
from tests.support.resident import resident_pages

NAME = "kvcore-host-pool"


def _files_mapped() -> int:
    return Path("/proc/self/maps").read_text().count(NAME)


def test_the_range_is_contiguous_zero_writable_and_one_file_a_segment():
    before = _files_mapped()
    nbytes = 7 * mmap.PAGESIZE * 3 + 123  # neither whole pages nor whole segments
    shared = shared_segments.segmented_shared(nbytes, 3)
    assert shared.segments == 3 and _files_mapped() == before + 3
    assert resident_pages(shared.address, nbytes)[0] == 0  # nothing faulted in yet
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(shared.address))
    assert not view.any()
    data = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    view[:] = data
    assert bytes(shared.buffer) == data.tobytes()
    del view
    shared.release()
    assert _files_mapped() == before


def test_the_range_lives_as_long_as_a_tensor_on_it():
    before = _files_mapped()
    shared = shared_segments.segmented_shared(8 * mmap.PAGESIZE, 2)
    tensor = torch.frombuffer(shared.buffer, dtype=torch.int32, count=2 * mmap.PAGESIZE)
    del shared
    gc.collect()
    tensor.fill_(-3)
    assert _files_mapped() == before + 2 and int(tensor.sum()) == -3 * tensor.numel()
    del tensor
    gc.collect()
    assert _files_mapped() == before


def test_a_refused_segment_leaves_nothing_mapped(monkeypatch):
    before = _files_mapped()
    made: list[int] = []
    create = os.memfd_create

    def third_refused(name: str) -> int:
        if len(made) == 2:
            raise OSError(24, "Too many open files")
        made.append(1)
        return create(name)

    monkeypatch.setattr(shared_segments.os, "memfd_create", third_refused)
    with pytest.raises(OSError, match="Too many open files"):
        shared_segments.segmented_shared(4 * mmap.PAGESIZE, 4)
    assert _files_mapped() == before


@pytest.mark.parametrize(
    ("gib", "count"), [(0.5, 1), (1, 1), (2, 2), (31.5, 31), (64, 32), (512, 32)]
)
def test_segment_count_keeps_segments_of_a_gib_or_more_and_at_most_32(gib, count):
    assert shared_segments.segment_count(int(gib * (1 << 30))) == count


def test_nothing_to_map_is_refused():
    with pytest.raises(ValueError, match="positive"):
        shared_segments.segmented_shared(0, 2)
