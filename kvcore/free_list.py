"""FreeSlotList: every free slot of a pool as one int64 tensor, kept in step per call.

For an adapter whose engine exposes its free slots as one tensor (SGLang's host
pools keep ``free_slots``) while kvcore's allocator hands slots out from anywhere
in the pool. Cutting slots out of the middle of a plain free list would copy the
whole list on every call; here pages sit in a permutation whose first rows are the
free pages (a sparse set), with each page's row kept, so allocating or freeing
``n`` pages rewrites O(n) rows and the free slots stay one prefix of it.

Not thread-safe: callers serialise, as for the allocator it follows.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcore.allocator import check_pool_size


class FreeSlotList:
    """Slots ``[0, size)`` in pages of ``page_size``: the free ones, as one tensor."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        size, page_size = check_pool_size(size, page_size)
        self.page_size = page_size
        self._pages = size // page_size
        # Row -> the page in it; rows [0, _free_pages) hold the free pages.
        self._page_in = np.arange(self._pages, dtype=np.int64)
        # Page -> its row.
        self._row_of = np.arange(self._pages, dtype=np.int64)
        # Row -> the slots of the page in it (the very same array when a page is a slot).
        self._slots_in = (
            self._page_in.reshape(self._pages, 1)
            if page_size == 1
            else np.arange(size, dtype=np.int64).reshape(self._pages, page_size)
        )
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._free_pages = self._pages
        self._flat = torch.from_numpy(self._slots_in.reshape(-1))

    @property
    def slots(self) -> torch.Tensor:
        """The free slots, page by page in no set order, each page ascending.

        A view: later calls rearrange the storage beneath it, so read it again after
        each call rather than keeping an earlier one.
        """
        return self._flat[: self._free_pages * self.page_size]

    def __len__(self) -> int:
        return self._free_pages * self.page_size

    def take(self, pages: np.ndarray) -> None:
        """``pages`` (distinct page ids, all free) are allocated from now on."""
        end = self._free_pages
        start = end - len(pages)
        rows = self._rows_of(pages)
        if start < 0 or rows.max(initial=-1) >= end:
            raise ValueError(f"not every one of the {len(pages)} pages to take is free")
        self._gather(pages, rows, start, end)
        self._free_pages = start

    def give_back(self, pages: np.ndarray) -> None:
        """``pages`` (distinct page ids, all allocated) are free from now on."""
        start = self._free_pages
        end = start + len(pages)
        rows = self._rows_of(pages)
        if end > self._pages or rows.min(initial=start) < start:
            raise ValueError(f"not every one of the {len(pages)} pages to give back is allocated")
        self._gather(pages, rows, start, end)
        self._free_pages = end

    def _rows_of(self, pages: np.ndarray) -> np.ndarray:
        if len(pages) and (pages.min() < 0 or pages.max() >= self._pages):
            raise ValueError(f"page ids must lie in [0, {self._pages})")
        return self._row_of[pages]

    def _gather(self, pages: np.ndarray, rows: np.ndarray, start: int, end: int) -> None:
        """Move ``pages`` (now in ``rows``) into rows ``[start, end)``; the pages they
        displace from there take the rows ``pages`` leave."""
        inside = (rows >= start) & (rows < end)
        displaced = np.ones(end - start, dtype=bool)
        displaced[rows[inside] - start] = False
        holes = rows[~inside]
        movers = self._page_in[start:end][displaced]
        self._page_in[holes] = movers
        self._row_of[movers] = holes
        self._page_in[start:end] = pages
        self._row_of[pages] = np.arange(start, end, dtype=np.int64)
        if self.page_size > 1:
            ps = self.page_size
            self._slots_in[holes] = movers[:, None] * ps + self._offsets
            self._slots_in[start:end] = pages[:, None] * ps + self._offsets
