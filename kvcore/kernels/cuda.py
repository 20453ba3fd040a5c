"""The CUDA kernel set: copy engines where the host side is in runs, a UVA kernel where not.

Index tensors arrive on the CPU (plans are made there) and are uploaded through an
:class:`~kvcore.kernels.index_upload.IndexUploader`, so nothing on these paths waits
for the GPU.
"""

from __future__ import annotations

import torch

from kvcore.kernels import KernelSet, reference
from kvcore.kernels.batch_copy import BatchCopyError, copy_runs_batched, copy_runs_each
from kvcore.kernels.index_upload import IndexUploader
from kvcore.kernels.triton_rows import gather_rows_uva, triton_available
from kvcore.runs import PairedRuns, Runs

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


class _CudaIndexedOps:
    """The ops that take index tensors, uploading them through one ring per device."""

    def __init__(self, gather_ctas: int) -> None:
        self.gather_ctas = gather_ctas
        self._uploaders: dict[torch.device, IndexUploader] = {}

    def _on(self, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        if index.device == device:
            return index
        uploader = self._uploaders.get(device)
        if uploader is None:
            uploader = self._uploaders.setdefault(device, IndexUploader(device))
        return uploader.upload(index)

    def gather_rows(
        self,
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
            self._on(src_idx, device),
            dst_words,
            self._on(dst_idx, device),
            ctas=self.gather_ctas,
        )
        return None

    def stage_in(
        self,
        src_words: torch.Tensor,
        host_runs: Runs,
        staging: torch.Tensor,
        dst_words: torch.Tensor,
        dst_idx: torch.Tensor,
    ) -> None:
        device_idx = self._on(dst_idx, dst_words.device)
        reference.stage_in(src_words, host_runs, staging, dst_words, device_idx)

    def stage_out(
        self,
        src_words: torch.Tensor,
        src_idx: torch.Tensor,
        staging: torch.Tensor,
        dst_words: torch.Tensor,
        host_runs: Runs,
    ) -> None:
        device_idx = self._on(src_idx, src_words.device)
        reference.stage_out(src_words, device_idx, staging, dst_words, host_runs)


def cuda_kernels(gather_ctas: int) -> KernelSet:
    ops = _CudaIndexedOps(gather_ctas)
    return KernelSet(
        name=f"cuda(gather_ctas={gather_ctas})",
        copy_runs=copy_runs,
        gather_rows=ops.gather_rows,
        stage_in=ops.stage_in,
        stage_out=ops.stage_out,
    )
