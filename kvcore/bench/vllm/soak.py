"""The vLLM soak: minutes of CPU-offload traffic through kvcore's handlers, every page checked.

One worker loop plays vLLM's offloading worker and its scheduler's side of the CPU tier:
each step it may submit store jobs (GPU blocks to host chunks) and load jobs (host chunks
back into new GPU blocks) to kvcore's two handlers
(:class:`kvcore_vllm.transfers.KVCoreOffloadingHandler`, built over vLLM's own
``SingleDirectionOffloadingHandler`` as :mod:`kvcore.bench.vllm.ab` builds them, one mover
shared as ``install_handlers`` shares it), keeps several of each in flight, polls
``get_finished`` and now and then ``wait``\\s on a job, as the worker does. Host chunk ids
come from kvcore's offloading manager (:class:`kvcore_vllm.manager.KVCoreCPUOffloadingManager`:
``prepare_store``/``complete_store``, ``prepare_load``/``complete_load``, its LRU evicting
when the pool is full), so the host side fragments as it does in vLLM; GPU blocks are
random. Jobs are 1 to 4096 blocks; each layout (vLLM's per-layer and cross-layer KV
tensors, MHA- and MLA-sized pages, one shared host region as vLLM lays it out) runs with
kvcore's stock-is-cheaper rules off, then on.

Every store's source blocks get fresh random bytes on the compute stream, and the same
bytes go to the host side's expected image; every load's pages are compared with that
image once the job is reported finished. Rows no job names must not change: GPU blocks
are compared with their expected bytes before every reuse, and at every checkpoint (the
end of each phase, nothing in flight) both sides are compared whole.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvcore.bench.host_buffers import HostBuffer, allocate_host_buffer
from kvcore.bench.soak_report import Accounting, Tally, kvcore_counts
from kvcore.bench.soak_state import (
    CPU_ONLY,
    PhaseClock,
    RandomPages,
    memory_state,
    mover_state,
    other_threads,
    pinned_in_use,
    prepared_plan_holders,
    settle,
    sync,
    with_index,
)
from kvcore.bench.vllm import ab
from kvcore.bench.vllm.sweep import MHA_PAGE_BYTES, MLA_PAGE_BYTES, ModelLayout
from kvcore.bench.vllm.sweep_pools import Pools
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.streams import CpuSyncStreams, CudaStreams, NamedStreams
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.transfers import KVCoreOffloadingHandler

RULES = (False, True)
# Wall seconds a layout takes besides its traffic at full size (pools, final reloads,
# checkpoints, teardown), and about what the end accounting takes.
RESERVE_S = 12.0
# Bytes of pages a check or a fill handles at a time, so that temporaries stay small.
_CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class Profile:
    layouts: tuple[ModelLayout, ...]
    blocks: int
    """GPU blocks, and host chunks (one block a chunk, as the sweep's pools)."""
    min_job: int
    max_job: int
    max_in_flight: int
    """Jobs in flight at most, per direction."""


PROFILES = {
    # The engine sweep's four model layouts, about 1 MiB a block over every layer.
    "full": Profile(
        (
            ModelLayout(False, 32, "mha", MHA_PAGE_BYTES),
            ModelLayout(False, 61, "mla", MLA_PAGE_BYTES),
            ModelLayout(True, 32, "mha", MHA_PAGE_BYTES),
            ModelLayout(True, 61, "mla", MLA_PAGE_BYTES),
        ),
        12288,
        1,
        4096,
        4,
    ),
    "sanitize": Profile(
        (ModelLayout(False, 4, "small", 4 << 10), ModelLayout(True, 4, "small", 4 << 10)),
        1024,
        1,
        256,
        3,
    ),
    # Per-layer jobs of 16 blocks and more reach kvcore's own paths with the rules on.
    "cpu": Profile(
        (ModelLayout(False, 32, "small", 1 << 10), ModelLayout(True, 8, "small", 1 << 10)),
        512,
        1,
        64,
        3,
    ),
}


@dataclass(frozen=True)
class Options:
    seconds: float
    seed: int
    device: torch.device
    profile: Profile
    progress: Callable[[str], None] = lambda line: None
    deadline: float | None = None
    """``time.perf_counter()`` by which the whole run must be over (phases are cut short)."""
    only: tuple[str, ...] = ()
    """Layout names (``per-layer/32L/mha-32KiB``) to run, all of the profile's when empty."""

    @property
    def layouts(self) -> tuple[ModelLayout, ...]:
        return tuple(m for m in self.profile.layouts if not self.only or m.name in self.only)


class CountingStreams:
    """A :class:`~kvcore.streams.NamedStreams` that counts the events its handler
    records and releases (outstanding = recorded - released), passing every call on."""

    def __init__(self, inner: NamedStreams) -> None:
        self.inner = inner
        self.recorded = 0
        self.released = 0

    def stream(self, name: Hashable) -> Any:
        return self.inner.stream(name)

    def record(self, stream: Any) -> Any:
        self.recorded += 1
        return self.inner.record(stream)

    def release(self, event: Any) -> None:
        self.released += 1
        self.inner.release(event)

    def query(self, event: Any) -> bool:
        return self.inner.query(event)

    def synchronize(self, event: Any) -> None:
        self.inner.synchronize(event)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.inner.wait_event(stream, event)

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        self.inner.run_on(stream, fn)

    @property
    def outstanding(self) -> int:
        return self.recorded - self.released


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
class Handlers:
    """One phase's pair of kvcore handlers, with what counts their events and passes."""

    store: KVCoreOffloadingHandler
    load: KVCoreOffloadingHandler
    stocks: dict[str, Any]
    streams: dict[str, CountingStreams]
    metrics: Metrics


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
        src, dst = ab.job_specs(gpu, chunks, gpu_to_cpu=True)
        handlers.store.transfer_async(job_id, src, dst)
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
        src, dst = ab.job_specs(gpu, chunks, gpu_to_cpu=False)
        handlers.load.transfer_async(job_id, src, dst)
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
            lines = traceback.format_exc().strip().splitlines()
            self.errors.append(f"{self.where}: {' | '.join(lines[-3:])}"[:600])
            self._drain(handlers, stores, loads)
        elapsed = time.perf_counter() - started
        events = self.close(handlers)
        self.checkpoint()
        counts = self.tally.to_dict()
        return {
            "layout": self.where,
            "serve_rule": rule,
            "seconds": round(elapsed, 3),
            **{k: counts[k] - counts_before[k] for k in ("loads", "backups", "reloads_checked")},
            "stored_at_end": sum(not s.evicted for s in self.stored),
            # Read after every phase: a leak grows with traffic, a one-time cost does not.
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

    def close(self, handlers: Handlers) -> dict[str, Any]:
        """Shut the phase's handlers down; what their events and stock's queues held."""
        out: dict[str, Any] = {}
        for name, handler in (("store", handlers.store), ("load", handlers.load)):
            stock = handlers.stocks[name]
            out[name] = {
                "kvcore_events_outstanding": handlers.streams[name].outstanding,
                "kvcore_jobs_queued": _length(handler, "_jobs"),
                "stock_transfers_queued": _length(stock, "_transfers"),
                "stock_transfer_events": _length(stock, "_transfer_events"),
            }
            handler.shutdown()
        return out

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
                src, dst = ab.job_specs(gpu, chunks, gpu_to_cpu=False)
                handlers.load.transfer_async(job_id, src, dst)
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


def _length(obj: Any, name: str) -> int | None:
    found = getattr(obj, name, None)
    return None if found is None else len(found)


def make_handlers(
    pools: Pools, device: torch.device, mover: Mover, rule: bool, compute: Any
) -> Handlers:
    """kvcore's store and load handlers over vLLM's own, as ``install_handlers`` builds
    them (one mover for both, streams of their own), their events counted."""
    metrics = Metrics()
    handlers: dict[str, KVCoreOffloadingHandler] = {}
    stocks: dict[str, Any] = {}
    counted: dict[str, CountingStreams] = {}
    for name, gpu_to_cpu in (("store", True), ("load", False)):
        stock = ab.stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=gpu_to_cpu)
        runnable = ab.runnable_stock(stock, device)
        inner: Any = CudaStreams(device) if device.type == "cuda" else CpuSyncStreams()
        streams = CountingStreams(inner)
        compute_stream = (
            (lambda s=compute: s)
            if compute is not None
            else (lambda s=streams: s.stream("compute"))
        )
        handlers[name] = KVCoreOffloadingHandler(
            runnable,
            mover=mover,
            streams=streams,
            compute_stream=compute_stream,
            name=name,
            metrics=metrics,
            stock_rules=rule,
        )
        stocks[name], counted[name] = runnable, streams
    return Handlers(handlers["store"], handlers["load"], stocks, counted, metrics)


def _host_region(nbytes: int, device: torch.device) -> HostBuffer:
    """Host memory for every layout's region in turn, pinned once as vLLM pins its region
    and registered as one range (as the sweep's)."""
    if device.type != "cuda":
        return allocate_host_buffer(nbytes, pin=False)
    return allocate_host_buffer(nbytes, pin=True, register_chunk_bytes=nbytes)


def run(opts: Options) -> dict[str, Any]:
    """The whole soak; returns the pieces of its JSON document."""
    import vllm

    tally, accounting = Tally(), Accounting()
    errors: list[str] = []
    phases: list[dict[str, Any]] = []
    opts = replace(opts, device=with_index(opts.device))
    device = opts.device
    profile = opts.profile
    mover = Mover(ab.env_policy(), metrics=Metrics())
    if not opts.layouts:
        raise ValueError(f"no layout is named {', '.join(opts.only)}")
    clock = PhaseClock(opts.seconds, len(opts.layouts) * len(RULES), opts.deadline)
    settle(mover, device)
    baseline, reads = _state(mover, device)
    rows = max(m.layout(profile.blocks).host_row_bytes for m in opts.layouts)
    host = _host_region(rows * profile.blocks, device)
    try:
        for number, model in enumerate(opts.layouts):
            opts.progress(f"-- {model.name}")
            try:
                phases += _soak_layout(
                    model,
                    replace(opts, seed=opts.seed * 1000 + number),
                    host,
                    mover,
                    tally,
                    accounting,
                    errors,
                    clock,
                )
            except Exception:
                lines = traceback.format_exc().strip().splitlines()
                errors.append(f"{model.name}: {' | '.join(lines[-3:])}"[:600])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        host.close()
    traffic_seconds = sum(phase["seconds"] for phase in phases)
    for phase in phases:
        _event_accounting(phase, accounting)
    settle(mover, device)
    end, _ = _state(mover, device)
    accounting.compare(
        baseline, end, reads, CPU_ONLY if device.type != "cuda" else "unreadable here"
    )
    left_held = prepared_plan_holders(mover) + other_threads() if accounting.leaks else []
    counts = tally.to_dict()
    return {
        "tally": tally,
        "accounting": accounting,
        "errors": errors,
        "seconds": traffic_seconds,
        "extra": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "vllm_compiled_ops": ab.compiled_ops_loaded(),
            "sizes": {
                "layouts": [m.name for m in opts.layouts],
                "blocks": profile.blocks,
                "job_blocks": [profile.min_job, profile.max_job],
                "max_in_flight_per_direction": profile.max_in_flight,
            },
            "stores_never_read_back": counts["backups"] - counts["backups_verified"],
            "phases": phases,
            "left_held": left_held,
        },
    }


def _soak_layout(
    model: ModelLayout,
    opts: Options,
    host: HostBuffer,
    mover: Mover,
    tally: Tally,
    accounting: Accounting,
    errors: list[str],
    clock: PhaseClock,
) -> list[dict[str, Any]]:
    """One layout through both phases; nothing of it outlives the call."""
    profile = opts.profile
    generator = torch.Generator().manual_seed(opts.seed)
    pools = Pools(
        model.layout(profile.blocks), host.tensor.view(torch.int8), opts.device, generator
    )
    manager = KVCoreCPUOffloadingManager(profile.blocks)
    compute = torch.cuda.Stream(opts.device) if opts.device.type == "cuda" else None
    soak = LayoutSoak(
        model, pools, manager, opts, mover, tally, errors, np.random.default_rng(opts.seed), compute
    )
    phases = []
    for rule in RULES:
        # This layout's teardown, every later layout's whole life, the end accounting.
        reserve = RESERVE_S * (clock.left_phases // len(RULES) + 1)
        phases.append(soak.phase(rule, clock.next(reserve)))
        opts.progress(_phase_line(phases[-1]))
    handlers = make_handlers(pools, opts.device, mover, True, compute)
    soak.reload_unverified(handlers)
    phases[-1]["events_final_reloads"] = soak.close(handlers)
    soak.checkpoint()
    soak.flush(accounting)
    # Stores the manager could not take (its pool full of jobs in flight), and requests
    # its LRU evicted before any load read them back (their bytes were still compared
    # at the checkpoints while they stayed on the host).
    phases[-1]["stores_refused"] = soak.stores_refused
    phases[-1]["evicted_before_read_back"] = soak.evicted_unverified
    return phases


def _event_accounting(phase: dict[str, Any], accounting: Accounting) -> None:
    """What each of the phase's handlers held once its jobs were all reported: kvcore's
    events recorded and not released, its queued jobs, and stock's queued transfers."""
    rule = "on" if phase["serve_rule"] else "off"
    for group in ("events", "events_final_reloads"):
        for name, events in phase.get(group, {}).items():
            for key, value in events.items():
                label = f"{phase['layout']} rules {rule} {name} {key}"
                if group != "events":
                    label = f"{phase['layout']} final reloads {name} {key}"
                if value is None:
                    accounting.skip(label, "not readable on this vLLM release")
                else:
                    read = "public" if key == "kvcore_events_outstanding" else "private"
                    accounting.exact(label, 0, value, read)


def _state(mover: Mover, device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    values, reads = mover_state(mover, device)
    memory, memory_reads = memory_state(device)
    return {**values, **memory}, {**reads, **memory_reads}


def _phase_line(phase: dict[str, Any]) -> str:
    stock = sum(phase["jobs_left_to_stock"].values())
    return (
        f"{phase['layout']} rules {'on' if phase['serve_rule'] else 'off'}: "
        f"{phase['seconds']:.1f} s, {phase['backups']} stores, {phase['loads']} loads "
        f"({phase['reloads_checked']} checked), {stock} jobs left to stock"
    )


__all__ = ["PROFILES", "Options", "Profile", "run"]
