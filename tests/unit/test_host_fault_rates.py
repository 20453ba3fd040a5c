"""scripts/host_fault_rates.py on the CPU: every mapping kind it times is the bytes asked
for, writable and shared where it says so, and is given back."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest

from tests.support.resident import resident_pages
from tests.support.scripts import load_script

fault_rates = load_script("host_fault_rates")


def test_segmented_shared_memory_is_one_contiguous_writable_range():
    nbytes = 5 * 4 * mmap.PAGESIZE + 3 * mmap.PAGESIZE  # not a multiple of the segments
    address, release = fault_rates._segmented(nbytes, 4)
    try:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
        view[:] = data
        assert np.array_equal(view, data)
        assert resident_pages(address, nbytes) == (nbytes // mmap.PAGESIZE,) * 2
        maps = Path("/proc/self/maps").read_text()
        assert maps.count("kvcore-fault-rates") == 4  # four memfd files side by side
    finally:
        release()
    assert "kvcore-fault-rates" not in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("kind", fault_rates.KINDS)
def test_each_kind_is_faulted_in_and_timed(kind):
    row = fault_rates.one_rate(kind, 16 * mmap.PAGESIZE, 2, register=False)
    assert row["kind"] == kind and row["fault_gib_per_s"] > 0
    assert row["register_gib_per_s"] is None
