"""Memory the index segmentation (:mod:`kvcore.runs`) reuses from call to call: per-thread
temporaries grown to the largest index seen, and shared read-only counting tensors."""

from __future__ import annotations

import threading

import numpy as np
import torch


class Scratch(threading.local):
    """Per-thread buffers for the temporaries of segmenting an index, grown to the largest
    index seen and reused.

    A fresh array of a MiB or more is mapped anew by malloc and page-faulted on first
    touch; on the hosts measured that cost more than the arithmetic (a 128k-row plan:
    1.4 ms with fresh temporaries, 0.3 ms once malloc kept its memory). Nothing in them
    outlives the call that fills them.
    """

    def __init__(self) -> None:
        self.words = np.empty(0, dtype=np.int64)
        self.flags = np.empty(0, dtype=np.bool_)
        self.slots = np.empty(0, dtype=np.int32)
        self.counting = np.arange(0, dtype=np.int32)

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Two int64 and three bool arrays of ``n`` entries."""
        if self.words.size < 2 * n:
            self.words = np.empty(2 * n, dtype=np.int64)
        if self.flags.size < 3 * n:
            self.flags = np.empty(3 * n, dtype=np.bool_)
        words, flags = self.words, self.flags
        return words[:n], words[n : 2 * n], flags[:n], flags[n : 2 * n], flags[2 * n : 3 * n]

    def mask(self, span: int) -> np.ndarray:
        """``span`` bools, all False."""
        if self.flags.size < span:
            self.flags = np.empty(span, dtype=np.bool_)
        mask = self.flags[:span]
        mask[:] = False
        return mask

    def stamps(self, span: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``span`` int32 slots of any content (each is written before it is read) and the
        positions ``0 .. n - 1`` as int32, read-only."""
        if self.slots.size < span:
            # Mapped, not touched: only the pages the indices land on are ever faulted in.
            self.slots = np.empty(span, dtype=np.int32)
        if self.counting.size < n:
            self.counting = np.arange(n, dtype=np.int32)
            self.counting.flags.writeable = False
        return self.slots[:span], self.counting[:n]


SCRATCH = Scratch()


class Counting:
    """Read-only tensors of 1s and of 0, 1, 2, ... shared by every run set of single rows,
    grown as needed (a plan of scattered rows has a run per row)."""

    def __init__(self) -> None:
        self._ones = torch.ones(0, dtype=torch.int64)
        self._arange = torch.arange(0, dtype=torch.int64)
        self._lock = threading.Lock()

    def ones_and_arange(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._ones.numel() < n:
                self._ones = torch.ones(n, dtype=torch.int64)
                self._arange = torch.arange(n, dtype=torch.int64)
            return self._ones[:n], self._arange[:n]


COUNTING = Counting()
