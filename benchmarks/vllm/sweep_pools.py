"""The block pools of the vLLM sweep (:mod:`benchmarks.vllm.sweep`), its requests, and its checks.

A :class:`Pools` holds one model's offload layout: one GPU tensor per KV tensor (each
its own allocation, as vLLM allocates them) and the host tensors as views of one host
region whose chunk rows hold every tensor's page (vLLM's shared region), plus what each
side must hold, kept on the device so that checking a request costs device time, not
host time: ``gpu_ref`` (the GPU tensors' expected bytes) and ``host_ref`` (the region's).

Every request is checked in full before the next one runs: its destination pages against
their sources, and the rows around each job's destination (its window) against what
they held before; :meth:`Pools.verify_all` compares both sides whole at the end of a
pass. Between requests the destination is made to differ from what the next copy must
write: a load's GPU pages are overwritten with the complement of their source, a store's
GPU source pages get fresh random bytes (so a host page the copy missed still holds
bytes the request never wrote).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.vllm.offload_layout import Layout, fragmented_ids

# Rows either side of a job's ids that its window check covers; a stray write further
# away is caught by the pass's whole-pool check.
WINDOW_MARGIN = 2
# Bytes of rows a check compares at a time.
CHECK_CHUNK_BYTES = 1 << 30


def slice_blocks(blocks: int) -> int:
    """Pool rows one job of ``blocks`` needs: fragmented_ids spans at most 4 rows a block
    (steps of 2 to 4 at a break), plus the window margins."""
    return 4 * blocks + 2 * WINDOW_MARGIN


@dataclass(frozen=True)
class Job:
    """One offload job: GPU block ids and CPU chunk ids (page k of one is page k of the
    other), drawn inside ``bounds`` (its slice of each pool)."""

    gpu_ids: np.ndarray
    cpu_ids: np.ndarray
    bounds: tuple[int, int]


@dataclass(frozen=True)
class Request:
    """What one vLLM step submits: ``jobs`` back to back, in one direction."""

    jobs: tuple[Job, ...]
    gpu_to_cpu: bool

    @property
    def gpu_ids(self) -> np.ndarray:
        return np.concatenate([job.gpu_ids for job in self.jobs])

    @property
    def cpu_ids(self) -> np.ndarray:
        return np.concatenate([job.cpu_ids for job in self.jobs])

    def key(self) -> bytes:
        return self.gpu_ids.tobytes() + b"|" + self.cpu_ids.tobytes()


class RequestDrawer:
    """New block ids for every request: the jobs of a request lie in disjoint slices of
    each pool, their ids broken at ``frag`` of the neighbour pairs, and no request's ids
    repeat an earlier one's (nothing planned for one request can serve another)."""

    def __init__(self, pool_blocks: int, rng: np.random.Generator) -> None:
        self.pool_blocks = pool_blocks
        self._rng = rng
        self._seen: set[bytes] = set()

    def draw(
        self,
        blocks: int,
        frag: float,
        jobs: int,
        *,
        gpu_to_cpu: bool,
        gpu_frag: float | None = None,
    ) -> Request:
        """A request of ``jobs`` jobs of ``blocks`` blocks; the GPU ids broken at ``gpu_frag``
        of the neighbour pairs (None: at ``frag``, as the CPU ids)."""
        slice_rows = self.pool_blocks // jobs
        if slice_rows < slice_blocks(blocks):
            raise ValueError(
                f"{jobs} jobs of {blocks} blocks need {jobs * slice_blocks(blocks)} pool "
                f"blocks; the pool has {self.pool_blocks}"
            )
        for _ in range(100):
            request = Request(
                tuple(
                    Job(
                        self._ids(
                            blocks,
                            frag if gpu_frag is None else gpu_frag,
                            j * slice_rows,
                            slice_rows,
                        ),
                        self._ids(blocks, frag, j * slice_rows, slice_rows),
                        (j * slice_rows, (j + 1) * slice_rows),
                    )
                    for j in range(jobs)
                ),
                gpu_to_cpu,
            )
            key = request.key()
            if key not in self._seen:
                self._seen.add(key)
                return request
        raise RuntimeError(f"no new ids left for {jobs} jobs of {blocks} blocks")

    def _ids(self, blocks: int, frag: float, start: int, rows: int) -> np.ndarray:
        ids = fragmented_ids(blocks, frag, self._rng)
        room = rows - 2 * WINDOW_MARGIN - int(ids[-1])
        return ids + start + WINDOW_MARGIN + int(self._rng.integers(0, room))


class Pools:
    """One model's GPU tensors and host region, with their expected bytes on ``device``.

    The GPU tensors are views of one ``[tensors, blocks, page]`` allocation, so that a
    check is one operation over every layer (vLLM allocates each layer's on its own;
    both handlers read only each tensor's address and strides).
    """

    def __init__(
        self,
        layout: Layout,
        region: torch.Tensor,
        device: torch.device,
        generator: torch.Generator,
    ) -> None:
        if layout.blocks_per_chunk != 1 or layout.gpu_blocks != layout.cpu_chunks:
            raise ValueError("the sweep's pools have one block a chunk, as many on each side")
        self.layout = layout
        self.device = device
        self.blocks = layout.gpu_blocks
        self._generator = _device_generator(generator, device)
        self.gpu_all = self._random((layout.tensors, self.blocks, layout.page_bytes))
        self.gpu = list(self.gpu_all.unbind(0))
        self.gpu_ref = self.gpu_all.clone()
        self.host = layout.host_views(region)
        row = layout.host_row_bytes
        self.region = region[: self.blocks * row].view(self.blocks, row)
        # Drawn on the device and copied out: a host draw of gigabytes takes minutes.
        self.host_ref = self._random((self.blocks, row))
        self.region.copy_(self.host_ref)

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def tensors(self) -> int:
        return self.layout.tensors

    def prepare(self, request: Request) -> None:
        """Make the request's destination differ from what the copy must write there."""
        gpu_rows = self._index(request.gpu_ids)
        if request.gpu_to_cpu:
            fresh = self._random((self.tensors, len(gpu_rows), self.page_bytes))
            self.gpu_all[:, gpu_rows] = fresh
            self.gpu_ref[:, gpu_rows] = fresh
        else:
            sources = self._host_pages(self._index(request.cpu_ids))
            self.gpu_all[:, gpu_rows] = torch.bitwise_not(sources)

    def verify(self, request: Request) -> bool:
        """Whether the request copied every page exactly and touched no other row of its
        windows; afterwards the pools hold what the next request expects either way."""
        if request.gpu_to_cpu:
            return all([self._verify_store(job) for job in request.jobs])
        return self._verify_load(request)

    def _host_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """host_ref's pages at chunk ``rows``, as ``[tensors, len(rows), page_bytes]``."""
        used = self.tensors * self.page_bytes
        pages = self.host_ref[rows, :used].view(len(rows), self.tensors, self.page_bytes)
        return pages.transpose(0, 1)

    def _verify_load(self, request: Request) -> bool:
        gpu_rows = self._index(request.gpu_ids)
        sources = self._host_pages(self._index(request.cpu_ids))
        copied = torch.equal(self.gpu_all[:, gpu_rows], sources)
        # Back to the bytes gpu_ref holds, so that every row outside a destination must
        # match it; the windows are compared now, the rest at the end of the pass.
        self.gpu_all[:, gpu_rows] = self.gpu_ref[:, gpu_rows]
        untouched = [self._gpu_rows_unchanged(*_window(j.gpu_ids, j.bounds)) for j in request.jobs]
        return copied and all(untouched)

    def _gpu_rows_unchanged(self, lo: int, hi: int) -> bool:
        """Whether GPU rows ``lo:hi`` hold gpu_ref's bytes; they do afterwards."""
        same = True
        for a, b in self._chunks(lo, hi):
            if not torch.equal(self.gpu_all[:, a:b], self.gpu_ref[:, a:b]):
                same = False
                self.gpu_all[:, a:b] = self.gpu_ref[:, a:b]
        return same

    def _verify_store(self, job: Job) -> bool:
        used = self.tensors * self.page_bytes
        same = True
        for a, b in self._chunks(*_window(job.cpu_ids, job.bounds)):
            inside = (job.cpu_ids >= a) & (job.cpu_ids < b)
            rows = self._index(job.cpu_ids[inside] - a)
            pages = self.gpu_ref[:, self._index(job.gpu_ids[inside])].transpose(0, 1)
            expected = self.host_ref[a:b].clone()
            expected[rows, :used] = pages.reshape(len(rows), used)
            seen = self.region[a:b].to(self.device)
            same = torch.equal(seen, expected) and same
            # What the host holds now, right or wrong: a wrong row is reported once.
            self.host_ref[a:b] = seen
        return same

    def verify_all(self) -> bool:
        """Whether both sides hold exactly their expected bytes, every row."""
        same = True
        for a, b in self._chunks(0, self.blocks):
            same = torch.equal(self.gpu_all[:, a:b], self.gpu_ref[:, a:b]) and same
            same = torch.equal(self.region[a:b].to(self.device), self.host_ref[a:b]) and same
        return same

    def _chunks(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """Rows ``lo:hi`` in pieces of about CHECK_CHUNK_BYTES a side, so that a check's
        temporaries stay small beside the pools."""
        step = max(1, CHECK_CHUNK_BYTES // self.region.shape[1])
        for a in range(lo, hi, step):
            yield a, min(a + step, hi)

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids.astype(np.int64)).to(self.device)

    def _random(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(
            -128, 128, shape, dtype=torch.int8, device=self.device, generator=self._generator
        )


def _window(ids: np.ndarray, bounds: tuple[int, int]) -> tuple[int, int]:
    """The rows from ``WINDOW_MARGIN`` before the job's first id to as many after its last,
    within the job's slice."""
    return (
        max(bounds[0], int(ids[0]) - WINDOW_MARGIN),
        min(bounds[1], int(ids[-1]) + WINDOW_MARGIN + 1),
    )


def _device_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``generator`` (the same one on a CPU)."""
    if device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)
