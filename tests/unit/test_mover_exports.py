"""kvcore.mover exports only what it defines: planning, policy and staging names are
imported from their own modules, so each has one home."""

from __future__ import annotations

import kvcore.mover as mover


def test_mover_exports_only_its_own_names():
    assert mover.__all__
    for name in mover.__all__:
        assert getattr(mover, name).__module__ == "kvcore.mover", name
