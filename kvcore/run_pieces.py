"""Cutting a request's runs into pieces: by position in their concatenation (a staged
copy's pieces, each with the host runs it spans) and at given rows (a pool registered in
steps, which no DMA may cross)."""

from __future__ import annotations

import numpy as np
import torch

from kvcore.runs import Runs, no_runs


def slice_runs(runs: Runs, begin: int, end: int) -> Runs:
    """The part of ``runs`` that covers positions ``[begin, end)`` of their concatenation.

    Staged copies are split into pieces by position so that the scatter of one piece
    overlaps the DMA of the next; each piece needs the host runs it spans.
    """
    if not 0 <= begin <= end <= runs.total:
        raise ValueError(f"[{begin}, {end}) is not within [0, {runs.total}]")
    if begin == end:
        return no_runs()
    lengths = runs.lengths.numpy()
    run_ends = np.cumsum(lengths)
    run_begins = run_ends - lengths
    keep = (run_ends > begin) & (run_begins < end)
    piece_begins = np.maximum(run_begins[keep], begin)
    piece_ends = np.minimum(run_ends[keep], end)
    starts = runs.starts.numpy()[keep] + (piece_begins - run_begins[keep])
    return Runs(torch.from_numpy(starts), torch.from_numpy(piece_ends - piece_begins))


def cut_runs(runs: Runs, cuts: np.ndarray) -> Runs:
    """``runs`` with every run that spans one of ``cuts`` (sorted row positions, each the
    first row of a new piece) cut there, in the same order; ``runs`` itself where none does.

    A DMA cannot cross from one host registration into the next, so a run over a pool
    registered in steps is copied as one piece per registration it touches.
    """
    if not runs.count or not len(cuts):
        return runs
    starts = runs.starts.numpy()
    ends = starts + runs.lengths.numpy()
    # The cuts strictly inside run i are cuts[first[i]:last[i]].
    first = np.searchsorted(cuts, starts, side="right")
    last = np.searchsorted(cuts, ends, side="left")
    inside = np.maximum(last - first, 0)
    if not inside.any():
        return runs
    pieces = inside + 1
    owner = np.repeat(np.arange(runs.count), pieces)
    # Each piece begins at its run's start or at a cut inside it, and ends where the next
    # piece of its run begins or at its run's end.
    rank = np.arange(owner.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    begins = np.where(rank == 0, starts[owner], cuts[first[owner] + rank - 1])
    last_piece = rank == pieces[owner] - 1
    piece_ends = np.where(
        last_piece, ends[owner], cuts[np.minimum(first[owner] + rank, len(cuts) - 1)]
    )
    return Runs(
        torch.from_numpy(begins.astype(np.int64)),
        torch.from_numpy((piece_ends - begins).astype(np.int64)),
    )
