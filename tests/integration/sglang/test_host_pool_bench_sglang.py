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


def test_pool_dims_fill_the_size_with_whole_tokens():
    dims = host_pool_build.pool_dims(1)
    assert dims[:2] == (2, host_pool_build.LAYERS) and dims[3:] == (8, 128)
    assert dims[2] * host_pool_build.TOKEN_ROW_BYTES <= 1 << 30
    assert (dims[2] + 1) * host_pool_build.TOKEN_ROW_BYTES > 1 << 30
