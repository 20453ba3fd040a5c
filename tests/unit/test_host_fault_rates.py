"""scripts/host_fault_rates.py on the CPU: every mapping kind it times is the bytes asked
for, writable and shared where it says so, and is given back."""

from __future__ import annotations

import mmap

import pytest

from tests.support.scripts import load_script

fault_rates = load_script("host_fault_rates")


@pytest.mark.parametrize("kind", fault_rates.KINDS)
def test_each_kind_is_faulted_in_and_timed(kind):
    row = fault_rates.one_rate(kind, 16 * mmap.PAGESIZE, 2, register=False)
    assert row["kind"] == kind and row["fault_gib_per_s"] > 0
    assert row["register_gib_per_s"] is None


def test_each_shared_kind_says_how_many_files_it_took():
    nbytes = 16 * mmap.PAGESIZE
    files = {
        kind: fault_rates.one_rate(kind, nbytes, 1, register=False)["files"]
        for kind in ("shared", "shared-segments", "shared-kvcore", "private")
    }
    # kvcore keeps a range under a GiB in one file.
    assert files == {"shared": 1, "shared-segments": 32, "shared-kvcore": 1, "private": None}
