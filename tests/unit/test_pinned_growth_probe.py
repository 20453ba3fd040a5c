"""scripts/pinned_growth_probe.py: it needs a CUDA device and says so where there is none."""

from __future__ import annotations

import pytest
import torch

from tests.support.scripts import load_script

probe = load_script("pinned_growth_probe")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_with_a_reason(capsys):
    assert probe.main(["--uploads", "3"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_uploads_reports_nothing_where_the_allocator_cannot_be_read():
    assert probe.uploads(torch.device("cpu"), 3, pinned=False, seed=0) is None
