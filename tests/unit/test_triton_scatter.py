"""The layer ring's scatter launcher where its kernel cannot launch: it says so once and
hands every later call of that shape back to the caller, with nothing written."""

from __future__ import annotations

import logging

import pytest
import torch
from interpreted import needs_triton

from kvcore.kernels import triton_scatter
from kvcore.kernels.triton_tile import Launch

pytestmark = needs_triton


def test_a_kernel_that_fails_to_launch_leaves_the_shape_to_the_callers_copy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    launches: list[None] = []

    def refused(*_: object) -> None:
        launches.append(None)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(Launch, "run", refused)
    gen = torch.Generator().manual_seed(3)
    staging = torch.randint(-(2**62), 2**62, (2 * 8, 64), generator=gen)
    slot = [staging[:8], staging[8:]]
    dsts = [torch.randint(-(2**62), 2**62, (20, 64), generator=gen) for _ in range(2)]
    before = [d.clone() for d in dsts]
    scatter = triton_scatter.SlotScatter(ctas=4)
    with caplog.at_level(logging.WARNING, logger=triton_scatter.__name__):
        for _ in range(3):
            assert not scatter(None, 0, slot, dsts, torch.randperm(20, generator=gen)[:8])
    assert len(launches) == 1
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "RuntimeError: no kernel image" in caplog.records[0].getMessage()
    for got, kept in zip(dsts, before, strict=True):
        assert torch.equal(got, kept)
