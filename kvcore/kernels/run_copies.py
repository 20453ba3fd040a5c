"""Copies whose host side is in runs: the copy engines, through one batched submission
where the runs are many, so that the host issues a few calls rather than one per run."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kvcore.kernels import reference
from kvcore.kernels.batch_copy import (
    BatchCopyError,
    copy_pointers_batched,
    copy_runs_batched,
    copy_runs_each,
)
from kvcore.planning.layers import LayerPairs
from kvcore.runs import PairedRuns

# Below this many runs one copy_ per run costs less host time than building a batch.
_FEW_RUNS = 4


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


def copy_runs_layers(pairs: LayerPairs, runs: PairedRuns) -> str | None:
    """Every pair's runs in one batched submission (a few calls of at most 256 copies).

    The pairs were checked when ``pairs`` was made and the runs' bounds by the mover, so
    only the addresses are computed here. Returns the reason when the batch was refused
    and the runs went one copy per run.
    """
    if runs.count * len(pairs) <= _FEW_RUNS:
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            reference.copy_runs(src_words, dst_words, runs)
        return None
    row_bytes = pairs.row_bytes
    bases = _bases(pairs)
    src_offsets = (runs.src_starts.numpy() * row_bytes).astype(np.uint64)
    dst_offsets = (runs.dst_starts.numpy() * row_bytes).astype(np.uint64)
    sizes = np.tile((runs.lengths.numpy() * row_bytes).astype(np.uint64), len(pairs))
    try:
        copy_pointers_batched(
            (bases[1][:, None] + dst_offsets[None, :]).ravel(),
            (bases[0][:, None] + src_offsets[None, :]).ravel(),
            sizes,
            pairs.dsts[0].device if pairs.dsts[0].device.type == "cuda" else pairs.srcs[0].device,
            host_pinned=host_pinned(pairs),
        )
    except BatchCopyError as refused:
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            copy_runs_each(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
        return f"batch_copy_refused:{refused.reason}"
    return None


# Facts about a LayerPairs that hold as long as it lives, computed on its first use.
_BASES: weakref.WeakKeyDictionary[LayerPairs, tuple[np.ndarray, np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
_PINNED: weakref.WeakKeyDictionary[LayerPairs, bool] = weakref.WeakKeyDictionary()


def _bases(pairs: LayerPairs) -> tuple[np.ndarray, np.ndarray]:
    """The pairs' source and destination addresses."""
    bases = _BASES.get(pairs)
    if bases is None:
        src, dst = (
            np.array([t.data_ptr() for t in side], dtype=np.uint64)
            for side in (pairs.src_words, pairs.dst_words)
        )
        bases = _BASES[pairs] = (src, dst)
    return bases


def host_pinned(pairs: LayerPairs) -> bool:
    """Whether every host-side buffer of the pairs is pinned (checked once per storage)."""
    pinned = _PINNED.get(pairs)
    if pinned is None:
        host = {
            t.untyped_storage().data_ptr(): t
            for t in (*pairs.srcs, *pairs.dsts)
            if t.device.type == "cpu"
        }
        pinned = all(t.is_pinned() for t in host.values())
        _PINNED[pairs] = pinned
    return pinned
