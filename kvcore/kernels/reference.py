"""Reference kernels: plain torch ops on byte-level row views.

They are the CPU implementation of every op the mover issues (every field of
:class:`kvcore.kernels.KernelSet`, as the CUDA set has them), and also valid
(if slower) on CUDA because they only use device-agnostic torch ops. Faster
device kernels must stay byte-identical to these.

Every ``*_words`` argument is a ``[rows, words]`` integer view made by
:func:`kvcore.row_words.as_row_words`; copying integer words instead of the tensor's own dtype
keeps NaN payloads, fp8 and bf16 bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcore.runs import PairedRuns, Runs

if TYPE_CHECKING:
    from kvcore.planning.layers import LayerPairs
    from kvcore.planning.staged_chunks import StagedChunk


def index_on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` on ``device`` without a host sync.

    A blocking upload would wait for every copy queued before it; going through
    pinned memory lets the upload queue behind them instead.
    """
    if index.device == device:
        return index
    if device.type == "cuda" and index.device.type == "cpu":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def staging_words(staging: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The first ``rows`` rows of a flat uint8 staging buffer, shaped and typed like ``like``."""
    words = like.shape[1]
    needed = rows * words * like.element_size()
    if needed > staging.numel():
        raise ValueError(f"{needed} bytes do not fit a staging buffer of {staging.numel()}")
    return staging[:needed].view(like.dtype).view(rows, words)


_KEPT_ROWS = "_kvcore_rows_by_word"
"""The attribute of a staging buffer's tensor that holds :func:`buffer_rows`' views."""


def buffer_rows(staging: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """:func:`staging_words`, made from whole-buffer rows kept on the buffer's tensor, one
    set per word view: a request's first layer then slices once instead of viewing three
    times. The kept rows are set on the buffer's storage, not viewed from its tensor: a
    view would hold the tensor, and a tensor's attribute holding its own view is a cycle
    the collector cannot see, which would keep the buffer's memory for good."""
    words, size = like.shape[1], like.element_size()
    key = (like.dtype, words)
    kept = staging.__dict__.get(_KEPT_ROWS)
    whole = None if kept is None else kept.get(key)
    if whole is None:
        offset, row_bytes = staging.storage_offset(), words * size
        if staging.dtype != torch.uint8 or not staging.is_contiguous() or offset % size:
            return staging_words(staging, rows, like)
        # Kept for later calls, which may run outside inference mode: a normal tensor.
        with torch.inference_mode(False):
            whole = torch.empty(0, dtype=like.dtype, device=staging.device).set_(
                staging.untyped_storage(),
                offset // size,
                (staging.numel() // row_bytes, words),
                (words, 1),
            )
        if kept is None:
            kept = {}
            setattr(staging, _KEPT_ROWS, kept)
        kept[key] = whole
    if rows > whole.shape[0]:
        needed = rows * words * size
        raise ValueError(f"{needed} bytes do not fit a staging buffer of {staging.numel()}")
    return whole[:rows]


def copy_runs(src_words: torch.Tensor, dst_words: torch.Tensor, runs: PairedRuns) -> None:
    """One copy per paired run."""
    for src_start, dst_start, length in zip(
        runs.src_starts.tolist(), runs.dst_starts.tolist(), runs.lengths.tolist(), strict=True
    ):
        dst_words[dst_start : dst_start + length].copy_(
            src_words[src_start : src_start + length], non_blocking=True
        )


def gather_rows(
    src_words: torch.Tensor,
    src_idx: torch.Tensor,
    dst_words: torch.Tensor,
    dst_idx: torch.Tensor,
) -> None:
    """``dst_words[dst_idx[k]] = src_words[src_idx[k]]`` as one gather and one scatter."""
    rows = src_words.index_select(0, index_on(src_idx, src_words.device))
    # A device destination's scatter is queued behind the copy; a host one runs at once,
    # so its rows must have arrived (a non-blocking copy to the host returns before).
    arrived = rows.to(dst_words.device, non_blocking=dst_words.device.type != "cpu")
    dst_words.index_copy_(0, index_on(dst_idx, dst_words.device), arrived)


def copy_runs_layers(pairs: LayerPairs, runs: PairedRuns) -> None:
    """:func:`copy_runs` for every pair."""
    for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
        copy_runs(src_words, dst_words, runs)


def gather_layers(pairs: LayerPairs, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """:func:`gather_rows` for every pair."""
    for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
        gather_rows(src_words, src_idx, dst_words, dst_idx)


def prepare_gather(
    src_words: torch.Tensor, dst_words: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """:func:`gather_rows` bound to one pair's views, for a plan executed again and again."""

    def gather(src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        gather_rows(src_words, src_idx, dst_words, dst_idx)

    return gather


def prepare_rows(
    src_idx: torch.Tensor, dst_idx: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's indices on ``device``, for :func:`gather_prepared` on each layer."""
    return index_on(src_idx, device), index_on(dst_idx, device)


def upload_rows(
    indices: tuple[torch.Tensor, ...], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Each of ``indices`` on ``device``."""
    return tuple(index_on(index, device) for index in indices)


def gather_prepared(pairs: LayerPairs, rows: object) -> None:
    """:func:`gather_rows` for every pair, with the indices of :func:`prepare_rows`."""
    src_idx, dst_idx = _prepared(rows)
    gather_layers(pairs, src_idx, dst_idx)


def gather_range(pairs: LayerPairs, rows: object, begin: int, end: int) -> None:
    """:func:`gather_prepared` over entries ``begin`` to ``end`` of the prepared indices."""
    src_idx, dst_idx = _prepared(rows)
    if not (0 <= begin <= end <= src_idx.numel() == dst_idx.numel()):
        raise ValueError(f"rows {begin} to {end} lie outside {src_idx.numel()} prepared rows")
    gather_layers(pairs, src_idx[begin:end], dst_idx[begin:end])


def _prepared(rows: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(rows, tuple) and len(rows) == 2):
        raise TypeError(f"rows must come from prepare_rows, got {type(rows).__name__}")
    return rows


def runs_to_staging(
    host_words: torch.Tensor, host_runs: Runs, staging: torch.Tensor, *, into_staging: bool
) -> None:
    """One copy per host run between the runs and ``staging``, where they lie back to back."""
    listed_runs_to_staging(host_words, host_runs.as_list(), staging, into_staging=into_staging)


def listed_runs_to_staging(
    host_words: torch.Tensor,
    host_runs: Iterable[tuple[int, int]],
    staging: torch.Tensor,
    *,
    into_staging: bool,
) -> None:
    """:func:`runs_to_staging` of runs already listed as ``(start, length)``."""
    position = 0
    rows = staging.shape[0]
    for start, length in host_runs:
        host = host_words[start : start + length]
        # A chunk of one run fills its staging rows: no slice of them to make.
        whole = length == rows and not position
        staged = staging if whole else staging[position : position + length]
        if into_staging:
            staged.copy_(host, non_blocking=True)
        else:
            host.copy_(staged, non_blocking=True)
        position += length


def stage_in(
    src_words: torch.Tensor,
    host_runs: Runs,
    staging: torch.Tensor,
    dst_words: torch.Tensor,
    dst_idx: torch.Tensor,
) -> None:
    """Host-to-device: host runs into ``staging`` back to back, then scatter to ``dst_idx``.

    ``staging`` is ``[host_runs.total, words]`` on the destination's device.
    """
    runs_to_staging(src_words, host_runs, staging, into_staging=True)
    dst_words.index_copy_(0, index_on(dst_idx, dst_words.device), staging)


def stage_out(
    src_words: torch.Tensor,
    src_idx: torch.Tensor,
    staging: torch.Tensor,
    dst_words: torch.Tensor,
    host_runs: Runs,
) -> None:
    """Device-to-host: gather ``src_idx`` into ``staging``, then copy it out into the host runs.

    ``staging`` is ``[host_runs.total, words]`` on the source's device.
    """
    torch.index_select(src_words, 0, index_on(src_idx, src_words.device), out=staging)
    runs_to_staging(dst_words, host_runs, staging, into_staging=False)


def index_copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst[dst_idx] = src[src_idx]`` by torch indexing, for rows kvcore cannot view as
    words (strided, overlapping, on other devices).

    The rows must be of one dtype and one shape: the values then move unchanged (every
    source row is read before any is written). A pair that would need a conversion or a
    broadcast raises; only the engine's own stock path may do that.
    """
    if src.dtype != dst.dtype:
        raise TypeError(
            f"rows of {src.dtype} cannot move into rows of {dst.dtype} unchanged: that "
            "takes a conversion, which only the engine's stock path may do"
        )
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"rows of shape {tuple(src.shape[1:])} cannot move into rows of shape "
            f"{tuple(dst.shape[1:])} unchanged: that takes a broadcast or a reshape, which "
            "only the engine's stock path may do"
        )
    rows = src[src_idx.to(src.device)]
    dst[dst_idx.to(dst.device)] = rows.to(dst.device)


@dataclass(frozen=True, eq=False)
class PreparedStageIn:
    """A staged page-in made ready once for every layer of one request: each chunk's host
    runs as Python ints and its destination rows on the device, so that a layer costs its
    copies and one scatter per chunk, with nothing segmented, sliced or uploaded again."""

    chunks: tuple[tuple[tuple[tuple[int, int], ...], torch.Tensor, int], ...]
    """Per chunk: its host runs ``(start, length)``, its destination rows, its row count."""
    views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = field(default_factory=dict)
    """Per staging buffer address and word view: each chunk's rows of the buffer, made on
    the first layer that needs them (a request's layers share one view)."""


def prepare_stage_in(
    chunks: Sequence[StagedChunk], dst_idx: torch.Tensor, device: torch.device
) -> PreparedStageIn:
    """``chunks`` of a staged page-in into rows ``dst_idx`` of ``device``, for
    :func:`stage_in_prepared` on each layer."""
    on_device = index_on(dst_idx, device)
    entries = on_device.shape[0]
    return PreparedStageIn(
        tuple(
            (
                tuple(chunk.host_runs.as_list()),
                # A request's one chunk takes the whole index: no slice to make.
                on_device
                if chunk.begin == 0 and chunk.end == entries
                else on_device[chunk.begin : chunk.end],
                chunk.end - chunk.begin,
            )
            for chunk in chunks
        )
    )


def chunk_views(
    prepared: PreparedStageIn, staging: torch.Tensor, like: torch.Tensor
) -> list[torch.Tensor]:
    """Each chunk's rows of ``staging`` (a flat uint8 buffer) as words like ``like``, made
    once per buffer address and word view and kept in ``prepared``."""
    key = (staging.data_ptr(), like.dtype, like.shape[1])
    views = prepared.views.get(key)
    if views is None:
        views = [buffer_rows(staging, rows, like) for _, _, rows in prepared.chunks]
        prepared.views[key] = views
    return views


def stage_in_prepared(pairs: LayerPairs, prepared: object, staging: torch.Tensor) -> None:
    """:func:`stage_in` of every chunk for every pair of ``pairs``, through ``staging`` (a
    flat uint8 buffer the caller holds), with chunks from :func:`prepare_stage_in`."""
    if not isinstance(prepared, PreparedStageIn):
        raise TypeError(f"prepared must come from prepare_stage_in, got {type(prepared).__name__}")
    chunks = prepared.chunks
    for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
        views = chunk_views(prepared, staging, src_words)
        for (host_runs, rows_on_device, _), staged in zip(chunks, views, strict=True):
            listed_runs_to_staging(src_words, host_runs, staged, into_staging=True)
            dst_words.index_copy_(0, rows_on_device, staged)
