"""What each KV cache group of a vLLM offload handler copies, read once from its stock handler.

A group names the KV tensors its layers use; kvcore copies a group's pages by row indices
(:mod:`kvcore_vllm.page_rows`) unless a tensor's layout or its pages' padding says it
cannot, which stays the group's reason for stock's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore_vllm.page_rows import PageRows, page_bytes, page_rows
from kvcore_vllm.stock_copies import StockCopies


@dataclass(frozen=True)
class Group:
    """What one KV cache group copies: its distinct KV tensors (indices into the stock lists)."""

    tensors: tuple[int, ...]
    page_bytes: int
    """Bytes a stock job counts per block of this group (every layer reference)."""


def describe_groups(
    stock: StockCopies, blocks_per_chunk: int
) -> tuple[list[Group | str], dict[int, PageRows]]:
    """Each group of ``stock``'s handler, or why kvcore leaves its jobs to stock; and the
    page rows of every KV tensor kvcore can copy, by tensor index."""
    if stock.canonical_layout:
        return ["canonical_layout"] * len(stock.layer_refs_per_group), {}
    rows: dict[int, PageRows] = {}
    reasons: dict[int, str] = {}
    for index, (gpu, cpu) in enumerate(zip(stock.gpu_tensors, stock.cpu_tensors, strict=True)):
        found = page_rows(gpu, cpu, blocks_per_chunk)
        if isinstance(found, str):
            reasons[index] = found
        else:
            rows[index] = found
    groups: list[Group | str] = []
    for refs in stock.layer_refs_per_group:
        tensors = tuple(dict.fromkeys(ref.tensor_idx for ref in refs))
        reason = next((reasons[t] for t in tensors if t in reasons), None)
        if reason is None and any(
            ref.page_size_bytes != page_bytes(stock.gpu_tensors[ref.tensor_idx]) for ref in refs
        ):
            # Stock copies the unpadded head of each page; whole rows would copy more.
            reason = "partial_page"
        group_bytes = sum(ref.page_size_bytes for ref in refs)
        groups.append(reason if reason is not None else Group(tensors, group_bytes))
    return groups, rows
