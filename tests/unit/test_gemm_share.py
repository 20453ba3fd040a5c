"""benchmarks.gemm_share: the GEMM batch is CUDA work, and the summary reads each side."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gemm_share import GemmBatch, gemm_summary
from benchmarks.sweep_report import SweepRow


def _row(**extra: float) -> SweepRow:
    return SweepRow(
        engine="vllm",
        case="per-layer/32L/mha/host-0%/store/1-job",
        tokens=4096,
        layers=32,
        nbytes=1,
        stock_ms=1.0,
        kvcore_ms=1.0,
        stock_host_ms=0.1,
        kvcore_host_ms=0.1,
        identical=True,
        calls=1,
        kvcore_served=1,
        pass_reasons={},
        paths=[],
        extra=dict(extra),
    )


def test_a_gemm_batch_refuses_a_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        GemmBatch(torch.device("cpu"), 1.0)


def test_the_summary_gives_each_timed_side_its_kept_share_and_skips_untimed_rows():
    timed = _row(gemm_alone_ms=10.0, gemm_with_stock_ms=20.0, gemm_with_kvcore_ms=12.5)
    assert gemm_summary([_row(), timed]) == [
        f"GEMM throughput kept during {timed.case} 4096: stock 50%, kvcore 80%"
    ]
