"""scripts/ring_pieces.py: the piece cap and slots it sets from PIECE_CAP_MIB and RING_SLOTS."""

from __future__ import annotations

import pytest

from kvcore import region_staging
from kvcore.kernels import REFERENCE
from tests.support.scripts import load_script

script = load_script("ring_pieces")


def test_the_cap_is_the_packages_unless_named_and_0_lifts_it(monkeypatch):
    assert script.piece_cap_bytes({}) == region_staging._MAX_PIECE_BYTES
    assert script.piece_cap_bytes({"PIECE_CAP_MIB": "8"}) == 8 << 20
    assert region_staging.ring_slots(256, 1024, 1 << 20) == (8, 16)
    # Lifted, a 1 GiB page-in of 1 MiB spans takes an eighth of the 256-span lease a piece.
    monkeypatch.setattr(
        region_staging, "_MAX_PIECE_BYTES", script.piece_cap_bytes({"PIECE_CAP_MIB": "0"})
    )
    assert region_staging.ring_slots(256, 1024, 1 << 20) == (8, 32)


@pytest.mark.parametrize("text", ["-1", "lots", ""])
def test_a_cap_that_is_no_size_is_refused_in_one_line(text):
    with pytest.raises(SystemExit, match=f"PIECE_CAP_MIB={text}: give 0"):
        script.piece_cap_bytes({"PIECE_CAP_MIB": text})


def test_the_slots_are_the_packages_unless_named(monkeypatch):
    assert script.ring_slots({}) == region_staging.RING_SLOTS
    monkeypatch.setattr(region_staging, "RING_SLOTS", script.ring_slots({"RING_SLOTS": "4"}))
    assert region_staging.ring_slots(256, 1024, 1 << 20) == (4, 16)


@pytest.mark.parametrize("text", ["0", "65", "many", ""])
def test_a_slot_count_out_of_range_is_refused_in_one_line(text):
    with pytest.raises(SystemExit, match=f"RING_SLOTS={text}: give a slot count"):
        script.ring_slots({"RING_SLOTS": text})


def test_sliced_scatters_are_asked_for_by_name_only(monkeypatch):
    assert not script.sliced_scatters({})
    assert script.sliced_scatters({"PIECE_SCATTER": "sliced"})
    with pytest.raises(SystemExit, match="PIECE_SCATTER=slices: give sliced or in-place"):
        script.sliced_scatters({"PIECE_SCATTER": "slices"})
    seen: list[object] = []
    monkeypatch.setattr(
        region_staging, "_piece_scatter", lambda kernels, *args: seen.append(kernels.gather_range)
    )
    monkeypatch.setattr(region_staging, "_MAX_PIECE_BYTES", region_staging._MAX_PIECE_BYTES)
    monkeypatch.setattr(region_staging, "RING_SLOTS", region_staging.RING_SLOTS)
    script.apply({"PIECE_SCATTER": "sliced"})
    region_staging._piece_scatter(REFERENCE, "pairs", "positions", "rows", "device")
    assert seen == [None]
