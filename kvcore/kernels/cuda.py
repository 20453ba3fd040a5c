"""The CUDA kernel set: copy engines where the host side is in runs, a UVA kernel where not.

Index tensors arrive on the CPU (plans are made there) and are uploaded here with
non-blocking copies, so nothing on these paths waits for the GPU.
"""

from __future__ import annotations

import torch

from kvcore.kernels import GatherRows, KernelSet, reference
from kvcore.kernels.batch_copy import BatchCopyError, copy_runs_batched, copy_runs_each
from kvcore.kernels.triton_rows import gather_rows_uva, triton_available
from kvcore.runs import PairedRuns

# Below this many runs one copy_ per run costs less host time than building a batch.
_FEW_RUNS = 4


def _host_side(src_words: torch.Tensor, dst_words: torch.Tensor) -> torch.Tensor:
    return src_words if src_words.device.type == "cpu" else dst_words


def copy_runs(src_words: torch.Tensor, dst_words: torch.Tensor, runs: PairedRuns) -> str | None:
    """One cudaMemcpyBatchAsync for many runs; one copy_ each for a few, or when it refuses.

    Returns the reason when the batched submission was refused and the runs went one by one.
    """
    if runs.count <= _FEW_RUNS:
        reference.copy_runs(src_words, dst_words, runs)
        return None
    try:
        copy_runs_batched(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
    except BatchCopyError as refused:
        copy_runs_each(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
        return f"batch_copy_refused:{refused.reason}"
    return None


def make_gather_rows(ctas: int) -> GatherRows:
    def gather_rows(
        src_words: torch.Tensor,
        src_idx: torch.Tensor,
        dst_words: torch.Tensor,
        dst_idx: torch.Tensor,
    ) -> str | None:
        device = dst_words.device if dst_words.device.type == "cuda" else src_words.device
        host = _host_side(src_words, dst_words)
        if not triton_available():
            reference.gather_rows(src_words, src_idx, dst_words, dst_idx)
            return "gather_kernel_unavailable:triton"
        if host.device.type == "cpu" and not host.is_pinned():
            reference.gather_rows(src_words, src_idx, dst_words, dst_idx)
            return "gather_kernel_unavailable:pageable_host"
        gather_rows_uva(
            src_words,
            reference.index_on(src_idx, device),
            dst_words,
            reference.index_on(dst_idx, device),
            ctas=ctas,
        )
        return None

    return gather_rows


def cuda_kernels(gather_ctas: int) -> KernelSet:
    return KernelSet(
        name=f"cuda(gather_ctas={gather_ctas})",
        copy_runs=copy_runs,
        gather_rows=make_gather_rows(gather_ctas),
        stage_in=reference.stage_in,
        stage_out=reference.stage_out,
    )
