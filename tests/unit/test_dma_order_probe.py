"""scripts/dma_order_probe.py: the descriptors of each order, and its arguments."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.support.scripts import load_script

probe = load_script("dma_order_probe")


def _pools(host_base: int, gpu_bases: list[int]):
    pools = object.__new__(probe.Pools)
    pools.host = type("Host", (), {"data_ptr": lambda self: host_base})()
    pools.gpu_bases = np.array(gpu_bases, dtype=np.uint64)
    return pools


def test_block_major_reads_the_host_in_address_order_and_layer_major_a_layer_at_a_time(
    monkeypatch,
):
    monkeypatch.setattr(probe, "LAYERS", 3)
    pools = _pools(1 << 30, [0, 1 << 20, 2 << 20])
    gpu_ids = np.array([5, 1], dtype=np.int64)
    page = probe.PAGE_BYTES
    dst, src, sizes = pools.descriptors(4, gpu_ids, block_major=True)
    assert (np.diff(src.astype(np.int64)) == page).all()
    assert src[0] == (1 << 30) + 4 * 3 * page
    bases = [0, 1 << 20, 2 << 20]
    assert dst.tolist() == [base + 5 * page for base in bases] + [base + page for base in bases]
    assert (sizes == page).all()
    dst, src, _ = pools.descriptors(4, gpu_ids, block_major=False)
    assert dst.tolist()[:2] == [5 * page, page]
    assert (src[1] - src[0], src[2] - src[0]) == (3 * page, page)


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (probe.token_counts, "abc"),
        (probe.token_counts, "8192,"),
        (probe.token_counts, "8"),
        (probe.compute_loads, "prefill"),
        (probe.repeat_count, "1"),
    ],
)
def test_a_wrong_argument_is_one_line(parse, text):
    with pytest.raises(argparse.ArgumentTypeError, match="give"):
        parse(text)
