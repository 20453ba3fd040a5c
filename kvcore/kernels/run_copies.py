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
RUN_ORDER_EVIDENCE = (
    "docs/bench/h100-dma-order-2026-12-06.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-run-by-run.json",
)
"""The runs that judged copies of an interleaved region run by run (:func:`_bases`): a probe
pairing both orders request by request, and vLLM's handler before and after."""


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
    src_bases, dst_bases, run_by_run = _bases(pairs)
    src_offsets = (runs.src_starts.numpy() * row_bytes).astype(np.uint64)
    dst_offsets = (runs.dst_starts.numpy() * row_bytes).astype(np.uint64)
    lengths = (runs.lengths.numpy() * row_bytes).astype(np.uint64)
    if run_by_run:
        dsts = (dst_bases[None, :] + dst_offsets[:, None]).ravel()
        srcs = (src_bases[None, :] + src_offsets[:, None]).ravel()
        sizes = np.repeat(lengths, len(pairs))
    else:
        dsts = (dst_bases[:, None] + dst_offsets[None, :]).ravel()
        srcs = (src_bases[:, None] + src_offsets[None, :]).ravel()
        sizes = np.tile(lengths, len(pairs))
    try:
        copy_pointers_batched(
            dsts,
            srcs,
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
_BASES: weakref.WeakKeyDictionary[LayerPairs, tuple[np.ndarray, np.ndarray, bool]] = (
    weakref.WeakKeyDictionary()
)
_PINNED: weakref.WeakKeyDictionary[LayerPairs, bool] = weakref.WeakKeyDictionary()


def _bases(pairs: LayerPairs) -> tuple[np.ndarray, np.ndarray, bool]:
    """The pairs' source and destination addresses, and whether their copies go run by run
    (every pair's copy of a run, then the next run's) rather than pair by pair.

    Run by run where one side's views interleave in one region (vLLM's CPU tier: a chunk
    row holds every layer's page side by side; the sources' side first), the pairs then
    sorted by that side's addresses: the copy engines read or write the host in address
    order, where pair by pair they jump a chunk row each copy, which cost them time beside
    the model's compute (:data:`RUN_ORDER_EVIDENCE`, MHA's 32 KiB pages)."""
    bases = _BASES.get(pairs)
    if bases is None:
        src, dst = (
            np.array([t.data_ptr() for t in side], dtype=np.uint64)
            for side in (pairs.src_words, pairs.dst_words)
        )
        sides = ((src, pairs.src_words), (dst, pairs.dst_words))
        interleaved = next((starts for starts, views in sides if _interleaved(starts, views)), None)
        if interleaved is not None:
            order = np.argsort(interleaved, kind="stable")
            src, dst = src[order], dst[order]
        bases = _BASES[pairs] = (src, dst, interleaved is not None)
    return bases


def _interleaved(starts: np.ndarray, views: tuple[torch.Tensor, ...]) -> bool:
    """Whether several ``views``, starting at ``starts``, start closer together than any of
    them reaches: views of one region, each a row offset in, rather than tensors one after
    the other."""
    if len(starts) < 2:
        return False
    reach = min(t.shape[0] * t.stride(0) * t.element_size() for t in views)
    return int(starts.max() - starts.min()) < reach


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
