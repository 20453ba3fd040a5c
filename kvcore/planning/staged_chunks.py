"""A staged transfer cut into pieces that each fit the staging buffer, with the host runs
each piece reads or writes."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.run_pieces import slice_runs
from kvcore.runs import Runs


@dataclass(frozen=True)
class StagedChunk:
    """Rows ``[begin, end)`` of a staged transfer and the host runs they read or write."""

    begin: int
    end: int
    host_runs: Runs


def staged_chunks(
    host_runs: Runs, chunk_rows: int, rows: int | None = None
) -> tuple[StagedChunk, ...]:
    """The host runs cut into chunks of at most ``chunk_rows`` rows (a staging buffer's
    worth). ``rows``: their total where the caller knows it (a transfer's index length),
    which spares a torch reduction on a request's first call."""
    if rows is None:
        rows = host_runs.total
    if rows <= chunk_rows:
        return (StagedChunk(0, rows, host_runs),)
    bounds = [(begin, min(begin + chunk_rows, rows)) for begin in range(0, rows, chunk_rows)]
    return tuple(StagedChunk(b, e, slice_runs(host_runs, b, e)) for b, e in bounds)
