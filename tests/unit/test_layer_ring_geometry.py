"""How the layer ring cuts the staging buffer into slots (the ring itself runs on CUDA only;
tests/gpu/test_prepared_layers_gpu.py copies through it)."""

from __future__ import annotations

import pytest

from kvcore.kernels.layer_ring import ring_geometry

MIB = 1 << 20


@pytest.mark.parametrize(
    ("staging", "pair_bytes", "pairs", "expected"),
    [
        # SGLang MHA, 8k tokens of 2 KiB rows a layer: K and V share a slot, 8 of them.
        (256 * MIB, 16 * MIB, 2, (2, 32 * MIB, 8)),
        # Small units: the slot count stops at 16.
        (256 * MIB, 1 * MIB, 2, (2, 2 * MIB, 16)),
        # 32k tokens: two K-and-V slots just fit.
        (256 * MIB, 64 * MIB, 2, (2, 128 * MIB, 2)),
        # 64k tokens: two K-and-V slots do not fit, so one pair a slot.
        (256 * MIB, 128 * MIB, 2, (1, 128 * MIB, 2)),
        # MLA: one buffer a layer.
        (256 * MIB, 72 * MIB, 1, (1, 72 * MIB, 3)),
        # Not even two one-pair slots: the ring steps aside.
        (256 * MIB, 129 * MIB, 2, None),
        (256 * MIB, 200 * MIB, 1, None),
    ],
)
def test_slots_hold_every_pair_where_two_fit_else_one(staging, pair_bytes, pairs, expected):
    geometry = ring_geometry(staging, pair_bytes, pairs)
    assert geometry == expected
    if geometry is not None:
        together, slot_bytes, slots = geometry
        assert slots * slot_bytes <= staging and slot_bytes == together * pair_bytes
