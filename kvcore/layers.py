"""Buffer pairs of one layout that move together with one plan: a model's layers.

Engines copy the same rows of every layer: vLLM's offload handler one job over all its
KV tensors, SGLang's backups all layers at once. :func:`layer_pairs` checks the pairs
once (the checks :meth:`TransferPlan.rebind` would repeat per layer and per transfer)
and keeps their row views, so :meth:`Mover.execute_layers` can issue one submission for
all of them where the device's kernels have one (a single gather launch, one batched
DMA call) and one per pair where not.

The pairs' destinations must not share rows with each other: with one submission the
order in which two pairs write the same byte is undefined (engines' layouts never alias;
vLLM's shared host region interleaves layers without overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.kernels.reference import row_bytes, rows_as_words
from kvcore.pair_checks import check_pair


@dataclass(frozen=True, eq=False)
class LayerPairs:
    """Pairs ``(srcs[i], dsts[i])`` with one row size, one source and one destination device."""

    srcs: tuple[torch.Tensor, ...]
    dsts: tuple[torch.Tensor, ...]
    src_words: tuple[torch.Tensor, ...]
    """``[rows, words]`` integer views of ``srcs``, all of one word type (empty when
    ``reason`` is set)."""
    dst_words: tuple[torch.Tensor, ...]
    src_rows: int
    """Rows of the shortest source: a plan whose source span exceeds it cannot run."""
    dst_rows: int
    row_bytes: int
    reason: str | None
    """Why some pair cannot move on kvcore's paths (a fallback reason), or None."""

    def __len__(self) -> int:
        return len(self.srcs)

    @property
    def word_bytes(self) -> int:
        return self.src_words[0].element_size() if self.src_words else 0


def layer_pairs(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> LayerPairs:
    """Check the pairs once: a caller error raises, a layout kvcore cannot move sets ``reason``."""
    srcs, dsts = tuple(srcs), tuple(dsts)
    if not srcs or len(srcs) != len(dsts):
        raise ValueError(
            f"need as many sources as destinations, at least one: {len(srcs)}, {len(dsts)}"
        )
    for side, name in ((srcs, "sources"), (dsts, "destinations")):
        if len({t.device for t in side}) > 1:
            raise ValueError(
                f"the {name} are on several devices: {sorted({str(t.device) for t in side})}"
            )
        if any(t.dim() == 0 for t in side):
            raise ValueError(f"one of the {name} is a scalar; rows are indexed along dim 0")
    reason, width = None, 8
    for src, dst in zip(srcs, dsts, strict=True):
        reason, pair_width = check_pair(src, dst)
        if reason is not None:
            break
        width = min(width, pair_width)
    if reason is None and len({row_bytes(t) for t in srcs}) > 1:
        reason = "row_shape_mismatch"
    src_words: tuple[torch.Tensor, ...] = ()
    dst_words: tuple[torch.Tensor, ...] = ()
    if reason is None:
        # One word type for every view, so that one kernel launch serves every pair.
        src_words = tuple(rows_as_words(t, width) for t in srcs)
        dst_words = tuple(rows_as_words(t, width) for t in dsts)
    return LayerPairs(
        srcs=srcs,
        dsts=dsts,
        src_words=src_words,
        dst_words=dst_words,
        src_rows=min(t.shape[0] for t in srcs),
        dst_rows=min(t.shape[0] for t in dsts),
        row_bytes=row_bytes(srcs[0]),
        reason=reason,
    )
