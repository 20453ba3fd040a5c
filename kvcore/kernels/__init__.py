"""Device kernels behind the mover, chosen by the device type of the transfer's device side.

A :class:`KernelSet` holds one implementation of each op the mover issues. One registry
maps a device type to its set: the reference set (plain torch ops) serves every device
type with no entry; CUDA's entry is a :data:`KernelFactory` (cudaMemcpyBatchAsync, a
Triton UVA gather), built per mover from its :class:`~kvcore.planning.path_policy.PathPolicy` on
first use because it imports Triton. :func:`register_kernels` puts a set or a factory in
place of either; :func:`unregister_kernels` takes an entry out again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvcore.kernels import reference
from kvcore.planning.path_policy import PathPolicy
from kvcore.runs import PairedRuns, Runs

if TYPE_CHECKING:
    from kvcore.planning.layers import LayerPairs
    from kvcore.planning.staged_chunks import StagedChunk

# copy_runs and a prepared gather return None, or the reason they had to take a slower
# way (a refused batch submission, a missing kernel), which the mover counts.
CopyRuns = Callable[[torch.Tensor, torch.Tensor, PairedRuns], str | None]
# A gather between two fixed row views, set up once: called with (src_idx, dst_idx).
PreparedGather = Callable[[torch.Tensor, torch.Tensor], str | None]
PrepareGather = Callable[[torch.Tensor, torch.Tensor], PreparedGather]
StageIn = Callable[[torch.Tensor, Runs, torch.Tensor, torch.Tensor, torch.Tensor], None]
StageOut = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Runs], None]
# The same runs of every pair of a LayerPairs, in one submission.
CopyRunsLayers = Callable[["LayerPairs", PairedRuns], str | None]
# A transfer's (src_idx, dst_idx) made ready on its device once, for every layer of one
# request; what comes back is the kernel set's own, handed back to gather_prepared.
PrepareRows = Callable[[torch.Tensor, torch.Tensor, torch.device], object]
GatherPrepared = Callable[["LayerPairs", object], str | None]
# gather_prepared over entries [begin, end) of the prepared rows: a staged load's pieces.
GatherRange = Callable[["LayerPairs", object, int, int], str | None]
# A staged page-in's (chunks, dst_idx) made ready on its device once for every layer of one
# request; what comes back is handed to stage_in_prepared with the leased staging buffer.
PrepareStageIn = Callable[[Sequence["StagedChunk"], torch.Tensor, torch.device], object]
StageInPrepared = Callable[["LayerPairs", object, torch.Tensor], None]
# Index tensors on a device, ready for work issued next on the current stream, without a
# host sync: a job's rows uploaded once, then read piece by piece.
UploadRows = Callable[[tuple[torch.Tensor, ...], torch.device], tuple[torch.Tensor, ...]]


class AddressRing(Protocol):
    """Slots of a staging buffer taken in turn, each piece's DMAs given by address
    (:class:`~kvcore.kernels.overlap_ring.AddressRing`)."""

    def fill(self, slot: int, reused: bool, copies: Sequence[tuple[int, int, int]]) -> None: ...

    def draining(self, slot: int, refilled: bool) -> AbstractContextManager[None]: ...


# A ring of this many slots on a device, joined to its current stream while open.
OpenAddressRing = Callable[[torch.device, int], AbstractContextManager[AddressRing]]


@dataclass(frozen=True)
class KernelSet:
    """One implementation of each mover op; see :mod:`kvcore.kernels.reference` for semantics.

    Each path has one op over one pair of buffers (``copy_runs``, ``prepare_gather``,
    ``stage_in``, ``stage_out``); the optional ones take every pair of a
    :class:`~kvcore.planning.layers.LayerPairs` at once, where the mover would otherwise
    loop over the pairs."""

    name: str
    copy_runs: CopyRuns
    prepare_gather: PrepareGather
    """The gather ``dst_words[dst_idx[k]] = src_words[src_idx[k]]`` between
    ``(src_words, dst_words)``, its checks and set-up done once; the mover keeps the result
    per plan and calls it with ``(src_idx, dst_idx)``."""
    stage_in: StageIn
    stage_out: StageOut
    copy_runs_layers: CopyRunsLayers | None = None
    """None: the mover calls ``copy_runs`` once per pair."""
    prepare_rows: PrepareRows | None = None
    """Both indices of a gather on its device, once for every layer of a request. Set with
    ``gather_prepared``; None: the mover gathers pair by pair."""
    gather_prepared: GatherPrepared | None = None
    """The gather for every pair at once, with indices from ``prepare_rows``."""
    gather_range: GatherRange | None = None
    """``gather_prepared`` over entries ``[begin, end)`` of the prepared indices, with no
    slice of them made (set with ``prepare_rows``). None: a page-in staged by region slices
    each piece's indices and gathers them as ``gather_pairs`` does."""
    prepare_stage_in: PrepareStageIn | None = None
    """A staged page-in's chunks made ready once for every layer of a request, where each
    layer's ``stage_in`` would issue the same ops (one piece). None: each layer's chunks
    go through ``stage_in``."""
    stage_in_prepared: StageInPrepared | None = None
    """``stage_in`` for every pair and chunk with what ``prepare_stage_in`` made; set with it."""
    upload_rows: UploadRows | None = None
    """Indices on their device in one upload. None: a page-in staged by region hands each
    piece's host indices to ``prepare_rows``."""
    open_address_ring: OpenAddressRing | None = None
    """A ring whose pieces are copied by address, for a page-in staged by region. None: its
    pieces go through ``copy_runs`` on a ring of torch's streams and events."""


REFERENCE = KernelSet(
    name="reference",
    copy_runs=reference.copy_runs,
    prepare_gather=reference.prepare_gather,
    stage_in=reference.stage_in,
    stage_out=reference.stage_out,
    copy_runs_layers=reference.copy_runs_layers,
    prepare_rows=reference.prepare_rows,
    gather_prepared=reference.gather_prepared,
    gather_range=reference.gather_range,
    prepare_stage_in=reference.prepare_stage_in,
    stage_in_prepared=reference.stage_in_prepared,
    upload_rows=reference.upload_rows,
)


def gather_pairs(
    kernels: KernelSet,
    pairs: LayerPairs,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    device: torch.device,
) -> str | None:
    """The gather ``dst[dst_idx[k]] = src[src_idx[k]]`` for every pair of ``pairs``: one
    submission where ``kernels`` have the ops over every pair, else one prepared gather a
    pair; returns why a slower way was taken, if one was."""
    if kernels.prepare_rows is not None and kernels.gather_prepared is not None:
        return kernels.gather_prepared(pairs, kernels.prepare_rows(src_idx, dst_idx, device))
    degraded = None
    for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
        degraded = kernels.prepare_gather(src_words, dst_words)(src_idx, dst_idx) or degraded
    return degraded


KernelFactory = Callable[[PathPolicy], KernelSet]
"""Builds a kernel set for a mover's policy (its gather CTAs and staged pieces)."""


def _cuda_kernels(policy: PathPolicy) -> KernelSet:
    from kvcore.kernels.cuda import cuda_kernels

    return cuda_kernels(
        policy.gather_ctas,
        policy.staged_pieces,
        policy.gather_ctas_to_host,
        short_rows=(policy.gather_ctas_short_rows, policy.short_row_bytes),
        ring_scatter_ctas=policy.ring_scatter_ctas,
        by_address=policy.address_ring,
    )


_BY_DEVICE_TYPE: dict[str, KernelSet | KernelFactory] = {"cuda": _cuda_kernels}


def register_kernels(device_type: str, kernels: KernelSet | KernelFactory) -> None:
    """Use ``kernels`` (a set, or a factory a mover calls once with its policy) for
    transfers whose device side is of ``device_type``."""
    _BY_DEVICE_TYPE[device_type] = kernels


def unregister_kernels(device_type: str) -> KernelSet | KernelFactory | None:
    """Take ``device_type``'s entry out, so that the reference set serves it again; the
    entry it had (to register again later), or None where it had none."""
    return _BY_DEVICE_TYPE.pop(device_type, None)


def registered(device_type: str) -> KernelSet | KernelFactory:
    """The registry's entry for ``device_type``: the reference set where it has none."""
    return _BY_DEVICE_TYPE.get(device_type, REFERENCE)


def kernels_for(device: torch.device, policy: PathPolicy = PathPolicy()) -> KernelSet:
    """The kernel set for ``device``; a factory's is built anew (a mover keeps its own)."""
    entry = registered(device.type)
    return entry if isinstance(entry, KernelSet) else entry(policy)
