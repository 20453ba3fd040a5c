"""State a soak compares before and after its traffic, and the helpers both engines' soaks use.

:func:`settle` runs one fixed sequence of small copies through every path of a mover.
It runs before the baseline and again before the end state is read, so that what the
mover builds on first use (its staging buffer, its index upload ring) exists at both
points and its bounded caches (the ring's recent uploads) hold entries of the same sizes
at both: the exact comparisons then see only what the traffic itself left behind.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.soak_report import OBSERVED
from kvcore.bench.measure import sync_device as sync
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.path_policy import TransferPath

# Rows and bytes a row of the settle copies: small, and the same every time.
_SETTLE_ROWS = 256
_SETTLE_ROW_BYTES = 256
# More gathers than the index uploader keeps recent uploads (8), so that each settle
# replaces every entry with one of its own.
_SETTLE_GATHERS = 24


def settle(mover: Mover, device: torch.device) -> None:
    """Every path of ``mover`` once each way, then a run of gathers with fresh indices, on
    a stream of its own (the batched copy API refuses the legacy default stream)."""
    streams = Streams(device)
    with streams.on(streams.new()):
        _settle(mover, device)
    sync(device)
    gc.collect()


def _settle(mover: Mover, device: torch.device) -> None:
    pin = device.type == "cuda"
    gen = torch.Generator().manual_seed(20240521)
    host = torch.randint(
        0, 256, (_SETTLE_ROWS, _SETTLE_ROW_BYTES), dtype=torch.uint8, generator=gen
    )
    if pin:
        host = host.pin_memory()
    dev = torch.zeros((_SETTLE_ROWS, _SETTLE_ROW_BYTES), dtype=torch.uint8, device=device)
    half = _SETTLE_ROWS // 2

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randperm(_SETTLE_ROWS, generator=gen)[:half], torch.randperm(
            _SETTLE_ROWS, generator=gen
        )[:half]

    contiguous = torch.arange(half)
    for path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS, TransferPath.STAGED):
        for src, dst, direction in ((host, dev, Direction.H2D), (dev, host, Direction.D2H)):
            src_idx, dst_idx = (
                (contiguous, contiguous.clone()) if path is (TransferPath.SINGLE_COPY) else fresh()
            )
            mover.transfer(src, dst, src_idx, dst_idx, direction=direction, force=path)
    for i in range(_SETTLE_GATHERS):
        src, dst, direction = (host, dev, Direction.H2D) if i % 2 else (dev, host, Direction.D2H)
        src_idx, dst_idx = fresh()
        mover.transfer(src, dst, src_idx, dst_idx, direction=direction, force=TransferPath.GATHER)
    sync(device)


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: threads set their device, and torch.cuda.set_device
    refuses a bare ``cuda``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def mover_state(mover: Mover, device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, how each was read) of what the mover keeps: its staging buffer, the leases
    on it, its pinned index ring and the plans it has prepared."""
    values: dict[str, Any] = {}
    reads: dict[str, str] = {}
    staging = mover.staging
    values["staging_bytes_reserved"] = staging.bytes_reserved
    reads["staging_bytes_reserved"] = "public"
    # A lease holds its device's lock from lease() until the copies are queued.
    locks = getattr(staging, "_locks", None)
    values["staging_leases_held"] = (
        None if locks is None else sum(lock.locked() for lock in list(locks.values()))
    )
    reads["staging_leases_held"] = "private"
    prepared = getattr(mover, "_prepared", None)
    values["mover_prepared_plans"] = None if prepared is None else len(prepared)
    reads["mover_prepared_plans"] = "private"
    uploaders = _uploaders(mover, device)
    if uploaders is not None:
        values["index_ring_pinned_bytes"] = sum(u.pinned_bytes for u in uploaders)
        reads["index_ring_pinned_bytes"] = "private"
        recent = [getattr(u, "_recent", None) for u in uploaders]
        lengths = [len(r) for r in recent if r is not None]
        values["index_ring_recent_uploads"] = sum(lengths) if len(lengths) == len(recent) else None
        reads["index_ring_recent_uploads"] = "private"
        # One event a ring slot once it has been used: the settle uses every slot.
        done = [getattr(u, "_done", None) for u in uploaders]
        values["index_ring_events"] = (
            sum(e is not None for ring in done for e in ring)  # type: ignore[union-attr]
            if all(ring is not None for ring in done)
            else None
        )
        reads["index_ring_events"] = "private"
    return values, reads


def _uploaders(mover: Mover, device: torch.device) -> list[Any] | None:
    """The CUDA kernel set's index upload rings (None on a CPU, where there are none)."""
    if device.type != "cuda":
        return None
    kernels = mover.kernels(device)
    found = getattr(kernels, "_uploaders", None)
    return None if found is None else list(found.values())


CPU_ONLY = "a CPU run: no device memory, no pinned memory, no CUDA events"


def memory_state(device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, reads) of torch's device allocator and pinned host allocator (the bytes in
    use, its cache apart), in bytes; on a CPU, None for each (listed as not checked)."""
    if device.type != "cuda":
        names = (
            "cuda_memory_allocated",
            "pinned_host_in_use",
            "pinned_tensors_alive",
            "index_ring_pinned_bytes",
            "index_ring_recent_uploads",
            "index_ring_events",
        )
        return dict.fromkeys(names), dict.fromkeys(names, "public")
    pinned = pinned_in_use(device)
    values: dict[str, Any] = {"cuda_memory_allocated": torch.cuda.memory_allocated(device)}
    values["pinned_host_in_use"] = pinned
    values["pinned_tensors_alive"] = pinned_census()
    reads = dict.fromkeys(values, "public")
    reads["pinned_host_in_use"] = OBSERVED
    return values, reads


def pinned_in_use(device: torch.device) -> int | None:
    """Bytes of pinned host blocks handed out and not yet given back, with nothing in
    flight on ``device``; None where this torch cannot say (or on a CPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    # Blocks freed while a stream still used them return to the allocators' counts only
    # when those allocators next look at their events. The device allocator looks on any
    # allocation; the pinned host allocator only where its free lists cannot serve one,
    # which a small allocation never forces, but emptying its cache always does.
    torch.empty(1, device=device)
    flushed = flush_pinned_frees()
    sync(device)
    if not flushed:
        # Unflushed, the count would hold blocks already freed.
        return None
    try:
        # The allocator's ``allocated_bytes`` also counts the free blocks it caches for
        # reuse, which grow with every new block size anyone pins: a cache, not a leak.
        return torch.cuda.host_memory_stats().get("active_bytes.current")
    except (RuntimeError, AttributeError):
        return None


def flush_pinned_frees() -> bool:
    """Let torch's pinned host allocator retire the blocks freed while a stream used them
    (their events have completed once the device is synchronized), by emptying its cache
    of free blocks; False where this torch offers no way to."""
    for empty in (
        getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
        getattr(torch._C, "_host_emptyCache", None),
    ):
        if callable(empty):
            empty()
            return True
    return False


def holders(target: Any, depth: int = 4, width: int = 3, limit: int = 12) -> list[str]:
    """What keeps ``target`` alive, as chains of type names (``A <- B``: B refers to A),
    ``depth`` steps back and ``width`` referrers a step; for a report where something
    outlived the traffic. A thread's frame shows as ``frame <name> <file>:<line>``."""
    gc.collect()
    walker = {_walk_holders.__code__, holders.__code__}
    chains: list[str] = []
    _walk_holders(target, [_holder_name(target)], depth, width, walker, set(), chains)
    return chains[:limit]


def other_threads() -> list[str]:
    """Every live thread but the caller's, with where it is now (its innermost frames):
    a soak's traffic threads must all have ended before its end accounting."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        where: list[str] = []
        below: types.FrameType | None = frame
        while below is not None and len(where) < 4:
            where.append(f"{below.f_code.co_name} {below.f_code.co_filename}:{below.f_lineno}")
            below = below.f_back
        lines.append(f"thread {names.get(ident, ident)} at " + " <- ".join(where))
    return sorted(lines)


def _walk_holders(
    obj: Any,
    chain: list[str],
    depth: int,
    width: int,
    walker: set[Any],
    own_lists: set[int],
    chains: list[str],
) -> None:
    """``own_lists``: ids of the lists of referrers the walk itself holds on this path,
    which refer to every object below them and are no one's reason to keep it."""
    if depth == 0 or len(chains) >= 64:
        chains.append(" <- ".join(chain))
        return
    found = [
        r
        for r in gc.get_referrers(obj)
        if not (isinstance(r, types.FrameType) and r.f_code in walker) and id(r) not in own_lists
    ]
    if not found:
        if isinstance(obj, types.FrameType):
            # A finished call's frame that no collected object refers to is kept by C code
            # (a thread's exception state, an extension); its reference count says how much.
            chain = [*chain, f"(no collected referrer; {sys.getrefcount(obj) - 3} references)"]
        chains.append(" <- ".join(chain))
        return
    chosen = found[:width]
    below = own_lists | {id(found), id(chosen)}
    for referrer in chosen:
        name = _holder_name(referrer)
        _walk_holders(referrer, [*chain, name], depth - 1, width, walker, below, chains)


def _holder_name(obj: Any) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} {obj.f_code.co_filename}:{obj.f_lineno}"
    if isinstance(obj, dict):
        keys = [str(k)[:24] for k in list(obj)[:3]]
        return f"dict{keys}"
    return type(obj).__name__


def prepared_plan_holders(mover: Mover, plans: int = 2) -> list[str]:
    """:func:`holders` of a few of the plans ``mover`` still keeps prepared forms of."""
    prepared = getattr(mover, "_prepared", None)
    kept = list(prepared.keys())[:plans] if prepared else []
    lines = []
    while kept:
        lines += holders(kept.pop())
    return lines


def pinned_census() -> list[str]:
    """Every pinned CPU tensor Python can still reach, as sorted ``dtype[shape] nbytes``
    lines: when torch's pinned byte count differs from the baseline but this list does
    not, the bytes are held below Python (an allocator block waiting on an event, or
    native code), not by a tensor someone kept."""
    gc.collect()
    alive = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and _is_pinned(obj):
            shape = "x".join(str(size) for size in obj.shape)
            alive.append(f"{obj.dtype}[{shape}] {obj.untyped_storage().nbytes()}")
    return sorted(alive)


def _is_pinned(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False


def mismatched(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Count of differing bytes, as a 0-d tensor on the tensors' device (no host sync)."""
    return (actual.reshape(-1).view(torch.uint8) != expected.reshape(-1).view(torch.uint8)).sum()


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes shaped ``shape`` of ``dtype``, drawn on the generator's device."""
    tail = 1
    for size in shape[1:]:
        tail *= size
    nbytes = shape[0] * tail * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=gen.device, generator=gen)
    return raw.view(dtype).view(shape)


def failure_line(where: str) -> str:
    """The exception being handled as one line of the soak's errors: where it happened and
    its traceback's last three lines."""
    lines = traceback.format_exc().strip().splitlines()
    return f"{where}: {' | '.join(lines[-3:])}"[:600]


@dataclass(frozen=True)
class SoakOptions:
    """What an engine's soak runs (each engine's ``Options`` adds what it picks from
    ``only``): for how long, from which seed, on which device, at which profile."""

    seconds: float
    seed: int
    device: torch.device
    profile: Any
    progress: Callable[[str], None] = lambda line: None
    deadline: float | None = None
    """``time.perf_counter()`` by which the whole run must be over (phases are cut short)."""
    only: tuple[str, ...] = ()
    """The pools or layouts (by name) to run, all of them when empty."""


class Streams:
    """The streams and events a soak orders its work with; on a CPU, where every copy is
    done when its call returns, streams are None and events are always complete."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def new(self) -> Any:
        return torch.cuda.Stream(self.device) if self.cuda else None

    def record(self, stream: Any) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if self.cuda and event is not None:
            stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``, as SGLang's transfer
        engine does for the indices it hands its streams."""
        if self.cuda and tensor.is_cuda:
            tensor.record_stream(stream)


class RandomPages:
    """Pages of a device pool handed out at random, as an engine's allocator leaves them
    under churn (a quarter of the requests get theirs in ascending order, still scattered);
    the first ``reserved`` pages are never handed out."""

    def __init__(
        self, rows: int, page: int, rng: np.random.Generator, *, reserved: int = 0
    ) -> None:
        self.page = page
        self._used = np.zeros(rows // page, dtype=bool)
        self._used[:reserved] = True
        self._rng = rng
        self._lock = threading.Lock()

    def alloc(self, rows: int) -> np.ndarray | None:
        """Row ids (int64) of ``rows // page`` random free pages, or None when short."""
        pages = rows // self.page
        with self._lock:
            free = np.flatnonzero(~self._used)
            if len(free) < pages:
                return None
            chosen = self._rng.choice(free, size=pages, replace=False)
            if self._rng.random() < 0.25:
                chosen.sort()
            self._used[chosen] = True
        return (chosen[:, None] * self.page + np.arange(self.page)).ravel().astype(np.int64)

    def free(self, rows: np.ndarray) -> None:
        with self._lock:
            self._used[rows[:: self.page] // self.page] = False


class PhaseClock:
    """How long each phase of a soak runs: the traffic seconds shared evenly among the
    phases, cut short where a wall-clock deadline (set-up, pool builds and checks
    included) would run out first, so that a run under a device time limit still writes
    its report. Each phase's share is taken when it starts."""

    def __init__(self, seconds: float, phases: int, deadline: float | None) -> None:
        self.left_seconds = seconds
        self.left_phases = phases
        self.deadline = deadline

    def next(self, reserve_s: float) -> float:
        """The next phase's seconds; ``reserve_s``: what the rest of the run needs besides
        traffic (pools still to build and tear down, the end accounting)."""
        share = self.left_seconds / max(self.left_phases, 1)
        if self.deadline is not None:
            wall = self.deadline - time.perf_counter() - reserve_s
            share = max(0.5, min(share, wall / max(self.left_phases, 1)))
        self.left_phases -= 1
        self.left_seconds = max(0.0, self.left_seconds - share)
        return share
