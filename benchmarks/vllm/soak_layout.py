"""One layout's traffic in the vLLM soak (:mod:`benchmarks.vllm.soak`): its jobs, checked.

:class:`LayoutSoak` plays vLLM's offloading worker over one layout's pools: store jobs with
fresh random bytes, load jobs of stored requests (whole or a prefix) with their chunks
from kvcore's offloading manager, several of each in flight, ``get_finished`` polled and
now and then a ``wait``; every load compared with what was stored, every block with its
expected bytes before reuse and at each checkpoint, and at the end the manager's pool
against how it was built.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from benchmarks.soak_report import Accounting, Tally, kvcore_counts
from benchmarks.soak_state import RandomPages, failure_line, pinned_in_use, sync
from benchmarks.vllm.offload_handlers import submit
from benchmarks.vllm.offload_layout import job_specs
from benchmarks.vllm.soak_handlers import Handlers, close_handlers, make_handlers
from benchmarks.vllm.sweep_plan import ModelLayout
from benchmarks.vllm.sweep_pools import Pools
from kvcore.mover import Mover
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.releases import installed_shape

if TYPE_CHECKING:
    # The soak's options stay in benchmarks.vllm.soak, where benchmarks.soak reads
    # them; that module imports this one.
    from benchmarks.vllm.soak import Options

# Bytes of pages a check or a fill handles at a time, so that temporaries stay small.
_CHUNK_BYTES = 256 << 20


@dataclass(eq=False)
class Stored:
    """One request's offloaded blocks: its keys, in order, and the chunks they got."""

    number: int
    keys: list[Any]
    ctx: Any
    chunks: np.ndarray
    ready: bool = False
    verified: bool = False
    loading: int = 0
    evicted: bool = False


@dataclass
class Job:
    stored: Stored
    gpu: np.ndarray
    chunks: np.ndarray
    blocks: int


@dataclass
class LayoutSoak:
    """The traffic over one layout: its pools, its manager, its requests."""

    model: ModelLayout
    pools: Pools
    manager: KVCoreCPUOffloadingManager
    opts: Options
    mover: Mover
    tally: Tally
    errors: list[str]
    rng: np.random.Generator
    compute: Any
    stored: list[Stored] = field(default_factory=list)
    owner: dict[Any, Stored] = field(default_factory=dict)
    numbers: Iterator[int] = field(default_factory=lambda: iter(range(1 << 62)))
    job_ids: Iterator[int] = field(default_factory=lambda: iter(range(1 << 62)))
    stores_refused: int = 0
    evicted_unverified: int = 0

    def __post_init__(self) -> None:
        self.device = self.opts.device
        self.gpu_blocks = RandomPages(self.pools.blocks, 1, self.rng)
        self.gen = torch.Generator(self.device).manual_seed(self.opts.seed + 7)
        self.page_bytes = self.pools.page_bytes
        self.tensors = self.pools.tensors

    @property
    def where(self) -> str:
        return self.model.name

    # -- pages

    def _block_chunks(self, count: int) -> Iterator[tuple[int, int]]:
        step = max(1, _CHUNK_BYTES // (self.tensors * self.page_bytes))
        for a in range(0, count, step):
            yield a, min(a + step, count)

    def _host_pages(self, chunks: torch.Tensor) -> torch.Tensor:
        """The expected host bytes of ``chunks``, as ``[tensors, len(chunks), page]``."""
        used = self.tensors * self.page_bytes
        pages = self.pools.host_ref[chunks, :used].view(len(chunks), self.tensors, self.page_bytes)
        return pages.transpose(0, 1)

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids.astype(np.int64)).to(self.device)

    def _stray(self, gpu: np.ndarray) -> int:
        """Bytes of these GPU blocks that differ from their expected bytes (before reuse)."""
        wrong = 0
        for a, b in self._block_chunks(len(gpu)):
            rows = self._index(gpu[a:b])
            wrong += _differing(self.pools.gpu_all[:, rows], self.pools.gpu_ref[:, rows])
        return wrong

    def _fill(self, gpu: np.ndarray, chunks: np.ndarray) -> None:
        """Fresh random bytes into the blocks a store reads, and the same bytes into the host
        image its chunks must hold afterwards."""
        used = self.tensors * self.page_bytes
        for a, b in self._block_chunks(len(gpu)):
            rows, host = self._index(gpu[a:b]), self._index(chunks[a:b])
            fresh = torch.randint(
                -128,
                128,
                (self.tensors, b - a, self.page_bytes),
                dtype=torch.int8,
                device=self.device,
                generator=self.gen,
            )
            self.pools.gpu_all[:, rows] = fresh
            self.pools.gpu_ref[:, rows] = fresh
            self.pools.host_ref[host, :used] = fresh.transpose(0, 1).reshape(b - a, used)

    def _check_load(self, job: Job) -> int:
        """Bytes of the loaded blocks that differ from their chunks' expected bytes; the
        blocks' expected bytes are theirs from now on (a wrong one is counted once)."""
        wrong = 0
        for a, b in self._block_chunks(job.blocks):
            rows, host = self._index(job.gpu[a:b]), self._index(job.chunks[a:b])
            expected = self._host_pages(host)
            wrong += _differing(self.pools.gpu_all[:, rows], expected)
            self.pools.gpu_ref[:, rows] = expected
            self.pools.gpu_all[:, rows] = expected
        return wrong

    # -- jobs

    def _size(self) -> int:
        low, high = self.opts.profile.min_job, self.opts.profile.max_job
        return max(1, int(np.exp(self.rng.uniform(np.log(low), np.log(high + 1)))))

    def submit_store(self, handlers: Handlers, in_flight: dict[int, Job]) -> bool:
        blocks = self._size()
        gpu = self.gpu_blocks.alloc(blocks)
        if gpu is None:
            return False
        number = next(self.numbers)
        keys = [
            make_offload_key(f"soak-{self.opts.seed}-{number}-{i}".encode(), 0)
            for i in range(blocks)
        ]
        ctx = ReqContext(req_id=f"r{number}")
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        if out is not None:
            self._evicted(out.evicted_keys)
        if out is None or list(out.keys_to_store) != keys:
            # The pool cannot take the request now (everything is in flight or loading).
            if out is not None and out.keys_to_store:
                self.manager.complete_store(out.keys_to_store, ctx, success=False)
            self.gpu_blocks.free(gpu)
            self.stores_refused += 1
            return False
        chunks = np.asarray(out.store_spec.block_ids, dtype=np.int64)
        stored = Stored(number, keys, ctx, chunks)
        for key in keys:
            self.owner[key] = stored
        self.tally.add(stray_bytes=self._stray(gpu))
        self._fill(gpu, chunks)
        job_id = next(self.job_ids)
        src, dst = job_specs(gpu, chunks, gpu_to_cpu=True)
        submit(handlers.store, job_id, src, dst)
        in_flight[job_id] = Job(stored, gpu, chunks, blocks)
        self.tally.add(backups=1, backed_up_bytes=blocks * self.tensors * self.page_bytes)
        return True

    def _evicted(self, keys: Any) -> None:
        for key in keys:
            stored = self.owner.pop(key, None)
            if stored is None or stored.evicted:
                continue
            stored.evicted = True
            if not stored.verified:
                self.evicted_unverified += 1

    def _pick(self) -> Stored | None:
        ready = [s for s in self.stored if s.ready and not s.evicted]
        if not ready:
            return None
        fresh = [s for s in ready if not s.verified]
        return fresh[0] if fresh else ready[int(self.rng.integers(len(ready)))]

    def submit_load(self, handlers: Handlers, in_flight: dict[int, Job]) -> bool:
        stored = self._pick()
        if stored is None:
            return False
        blocks = len(stored.keys)
        if self.rng.random() < 0.5:  # a prefix, as a partial hit loads
            blocks = int(self.rng.integers(1, blocks + 1))
        gpu = self.gpu_blocks.alloc(blocks)
        if gpu is None:
            return False
        keys = stored.keys[:blocks]
        spec = self.manager.prepare_load(keys, stored.ctx)
        chunks = np.asarray(spec.block_ids, dtype=np.int64)
        if not np.array_equal(chunks, stored.chunks[:blocks]):
            self.errors.append(f"{self.where}: the manager moved request {stored.number}'s chunks")
        stored.loading += 1
        self.tally.add(stray_bytes=self._stray(gpu))
        job_id = next(self.job_ids)
        src, dst = job_specs(gpu, chunks, gpu_to_cpu=False)
        submit(handlers.load, job_id, src, dst)
        in_flight[job_id] = Job(stored, gpu, chunks, blocks)
        self.tally.add(loads=1, load_calls=1, loaded_bytes=blocks * self.tensors * self.page_bytes)
        return True

    def finish(self, result: Any, job: Job, store: bool) -> None:
        """One job vLLM's worker got back from ``get_finished``."""
        nbytes = job.blocks * self.tensors * self.page_bytes
        if not result.success or result.transfer_size != nbytes:
            self.errors.append(
                f"{self.where}: job {result.job_id} reported success={result.success}, "
                f"{result.transfer_size} bytes; moved {nbytes}"
            )
        stored = job.stored
        if store:
            self.manager.complete_store(stored.keys, stored.ctx)
            stored.ready = True
            self.stored.append(stored)
        else:
            wrong = self._check_load(job)
            self.manager.complete_load(stored.keys[: job.blocks], stored.ctx)
            stored.loading -= 1
            first = not stored.verified
            stored.verified = True
            self.tally.add(reloads_checked=1, backups_verified=int(first), mismatched_bytes=wrong)
            if wrong and len(self.errors) < 20:
                self.errors.append(
                    f"{self.where}: load job {result.job_id} ({job.blocks} blocks): "
                    f"{wrong} bytes differ from what was stored"
                )
        self.gpu_blocks.free(job.gpu)

    # -- phases

    def phase(self, rule: bool, seconds: float) -> dict[str, Any]:
        handlers = make_handlers(self.pools, self.opts.device, self.mover, rule, self.compute)
        assert self.mover.metrics is not None
        before, handler_before = self.mover.metrics.snapshot(), handlers.metrics.snapshot()
        counts_before = self.tally.to_dict()
        # Read before and after the traffic: growth between phases is set-up (handlers
        # built), growth within one is the traffic's.
        pinned_at_start = pinned_in_use(self.device)
        stores: dict[int, Job] = {}
        loads: dict[int, Job] = {}
        started = time.perf_counter()
        deadline = started + seconds
        limit = self.opts.profile.max_in_flight
        try:
            while time.perf_counter() < deadline or not (
                self.tally.reloads_checked > counts_before["reloads_checked"]
            ):
                if time.perf_counter() > deadline + 60:
                    self.errors.append(f"{self.where}: no load was checked in the phase")
                    break
                self._step(handlers, stores, loads, limit)
            self._drain(handlers, stores, loads)
        except Exception:
            self.errors.append(failure_line(self.where))
            self._drain(handlers, stores, loads)
        elapsed = time.perf_counter() - started
        events = close_handlers(handlers)
        self.checkpoint()
        counts = self.tally.to_dict()
        return {
            "layout": self.where,
            "serve_rule": rule,
            "seconds": round(elapsed, 3),
            **{k: counts[k] - counts_before[k] for k in ("loads", "backups", "reloads_checked")},
            "stored_at_end": sum(not s.evicted for s in self.stored),
            "pinned_host_in_use_at_start": pinned_at_start,
            "pinned_host_in_use": pinned_in_use(self.device),
            "jobs_left_to_stock": kvcore_counts(handler_before, handlers.metrics.snapshot())[
                "fallbacks"
            ],
            "kvcore": kvcore_counts(before, self.mover.metrics.snapshot()),
            "events": events,
        }

    def _step(
        self, handlers: Handlers, stores: dict[int, Job], loads: dict[int, Job], limit: int
    ) -> None:
        """One worker step: maybe new jobs each way, then the finished ones collected."""
        # Requests evicted and not being read drop out of the list the loads pick from.
        self.stored = [s for s in self.stored if not s.evicted or s.loading]
        backlog = sum(s.ready and not s.verified and not s.evicted for s in self.stored)
        with _on(self.compute):
            if len(stores) < limit and backlog < 4 and self.rng.random() < 0.7:
                self.submit_store(handlers, stores)
            if len(loads) < limit and self.rng.random() < 0.8:
                self.submit_load(handlers, loads)
            if self.rng.random() < 0.2:
                for handler, jobs in ((handlers.store, stores), (handlers.load, loads)):
                    if jobs:
                        handler.wait({int(self.rng.choice(list(jobs)))})
            self._collect(handlers, stores, loads)
        if not stores and not loads:
            time.sleep(0.0005)

    def _collect(self, handlers: Handlers, stores: dict[int, Job], loads: dict[int, Job]) -> None:
        for handler, jobs, store in ((handlers.store, stores, True), (handlers.load, loads, False)):
            for result in handler.get_finished():
                job = jobs.pop(result.job_id, None)
                if job is None:
                    self.errors.append(f"{self.where}: job {result.job_id} reported twice")
                    continue
                self.finish(result, job, store)

    def _drain(self, handlers: Handlers, stores: dict[int, Job], loads: dict[int, Job]) -> None:
        """Every job in flight waited for and collected, as the worker does at shutdown."""
        with _on(self.compute):
            deadline = time.perf_counter() + 300
            while stores or loads:
                handlers.store.wait(set(stores))
                handlers.load.wait(set(loads))
                self._collect(handlers, stores, loads)
                if time.perf_counter() > deadline:
                    self.errors.append(f"{self.where}: {len(stores) + len(loads)} jobs lost")
                    break

    def reload_unverified(self, handlers: Handlers) -> None:
        """Every stored request not yet read back, loaded whole and checked."""
        loads: dict[int, Job] = {}
        with _on(self.compute):
            for stored in [s for s in self.stored if s.ready and not s.evicted]:
                if stored.verified:
                    continue
                gpu = None
                while gpu is None:
                    gpu = self.gpu_blocks.alloc(len(stored.keys))
                    if gpu is None:
                        self._drain(handlers, {}, loads)
                spec = self.manager.prepare_load(stored.keys, stored.ctx)
                chunks = np.asarray(spec.block_ids, dtype=np.int64)
                stored.loading += 1
                job_id = next(self.job_ids)
                src, dst = job_specs(gpu, chunks, gpu_to_cpu=False)
                submit(handlers.load, job_id, src, dst)
                loads[job_id] = Job(stored, gpu, chunks, len(stored.keys))
                nbytes = len(stored.keys) * self.tensors * self.page_bytes
                self.tally.add(loads=1, load_calls=1, loaded_bytes=nbytes)
        self._drain(handlers, {}, loads)

    def checkpoint(self) -> None:
        """Nothing in flight: every GPU block and every host chunk row holds its expected
        bytes."""
        sync(self.device)
        stray = 0
        pools = self.pools
        for a, b in self._block_chunks(pools.blocks):
            stray += _differing(pools.gpu_all[:, a:b], pools.gpu_ref[:, a:b])
            stray += _differing(pools.region[a:b].to(self.device), pools.host_ref[a:b])
        self.tally.add(stray_bytes=stray, checkpoints=1)
        if stray:
            self.errors.append(f"{self.where}: {stray} bytes outside every job changed")
            pools.gpu_all.copy_(pools.gpu_ref)
            pools.region.copy_(pools.host_ref)

    def flush(self, accounting: Accounting) -> None:
        """Every stored request evicted through the manager's own path, then the manager's
        pool against how it was built: all chunks free, allocatable as one ascending run."""
        shape = installed_shape()
        free = getattr(self.manager, shape.name("_get_num_free_chunks"))
        blocks = self.pools.blocks
        ctx = ReqContext(req_id="flush")
        self.manager.on_new_request(ctx)
        keys = [make_offload_key(f"flush-{self.opts.seed}-{i}".encode(), 0) for i in range(blocks)]
        out = self.manager.prepare_store(keys, ctx)
        one_run = out is not None and np.array_equal(
            np.asarray(out.store_spec.block_ids), np.arange(blocks)
        )
        if out is not None:
            self._evicted(out.evicted_keys)
            self.manager.complete_store(out.keys_to_store, ctx, success=False)
        where = self.where
        accounting.exact(f"{where} manager free chunks", blocks, free(), "public")
        accounting.exact(f"{where} whole pool allocatable as one run", True, one_run, "public")
        allocator = getattr(self.manager, "_allocator", None)
        released = getattr(self.manager, "_released", None)
        if allocator is None or released is None:
            accounting.skip(f"{where} kvcore allocator", "the manager's allocator is not readable")
        else:
            accounting.exact(
                f"{where} kvcore allocator free slots (with released ids)",
                blocks,
                allocator.available_size() + len(released),
                "private",
            )


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Bytes (int8 elements) that differ; equal tensors, the common case, cost one pass."""
    return 0 if torch.equal(a, b) else int((a != b).sum())


@dataclass
class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _on(stream: Any) -> Any:
    return _Null() if stream is None else torch.cuda.stream(stream)
