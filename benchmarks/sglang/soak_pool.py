"""One pool pair's traffic in the SGLang soak (:mod:`benchmarks.sglang.soak`), step by step.

:class:`PoolSoak` makes SGLang's calls as its cache controller makes them (kvcore's AROUND
hook, or the stock binding kvcore's rule set on the pool): a backup (host slots from
``pool.alloc``, fresh random rows, one ``backup_from_device_all_layer``), a reload (one
``load_to_device_per_layer`` a layer, an event after each), the forward pass's check of a
reload against the host mirror, and the checks with nothing in flight. The threads of a
phase that drive these steps are :mod:`benchmarks.sglang.soak_phase`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.sglang.ab_paths import METHOD_NAMES
from benchmarks.sglang.jit_kernels import on_stream
from benchmarks.sglang.pool_case import PoolCase
from benchmarks.sglang.pool_rows import get_rows, host_rows
from benchmarks.soak_report import Tally
from benchmarks.soak_state import RandomPages, Streams, mismatched, random_rows, sync
from kvcore.mover import Mover

if TYPE_CHECKING:
    # The soak's options stay in benchmarks.sglang.soak, where benchmarks.soak reads
    # them; that module imports this one.
    from benchmarks.sglang.soak import Options

BACKEND = "kernel"


def pool_name(kind: str, layout: str, page: int) -> str:
    """A pool's name, as ``--pools`` names it."""
    return f"{kind}/{layout}/p{page}"


@dataclass(eq=False)
class Held:
    """A backed-up request whose host slots the soak holds."""

    number: int
    host: torch.Tensor
    """Its host slots (CPU int64), as ``pool.alloc`` gave them."""
    verified: bool = False
    busy: int = 0


@dataclass
class InFlight:
    """A reload issued on the load stream, for the forward thread to check."""

    held: Held
    host: torch.Tensor
    rows: np.ndarray
    device_rows: torch.Tensor
    events: list[Any]
    stray: torch.Tensor


Waiting = Callable[[], bool]
"""Called while a request waits for slots or rows: waits a little and says whether to go
on waiting (False: give the request up)."""


@dataclass
class PendingBackup:
    held: Held
    rows: np.ndarray
    device_rows: torch.Tensor
    done: Any
    stray: torch.Tensor


def cpu_stock(case: PoolCase) -> dict[str, Callable[..., None]]:
    """Stand-ins for SGLang's transfer methods on a CPU, where its kernels do not run: the
    rows its layout definition says each call copies, one torch copy per layer and buffer."""

    def load(
        pool: Any,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        for c in case.components:
            rows = get_rows(c.host, case.layout, case.page_size, layer_id, host_indices)
            c.devices[layer_id][device_indices] = rows

    def backup(
        pool: Any,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        for c in case.components:
            for layer, device in enumerate(c.devices):
                view, index = host_rows(c.host, case.layout, case.page_size, layer, host_indices)
                view[index] = device[device_indices]

    return {"load": load, "backup": backup}


class PoolSoak:
    """The traffic over one pool pair, step by step; the threads of a phase
    (:func:`~benchmarks.sglang.soak_phase.run_phase`) take the steps."""

    def __init__(
        self, case: PoolCase, opts: Options, mover: Mover, tally: Tally, errors: list[str]
    ) -> None:
        from benchmarks.sglang.hook_adapter import pool_method_hook

        self.case, self.opts, self.mover, self.tally, self.errors = case, opts, mover, tally, errors
        self.device = opts.device
        self.streams = Streams(self.device)
        self.forward, self.load_stream, self.write_stream = (self.streams.new() for _ in range(3))
        self.layers = len(case.components[0].devices)
        self.page = case.page_size
        rng = np.random.default_rng(opts.seed)
        # Page 0 stays out, as SGLang keeps its padding slot.
        self.pages = RandomPages(case.components[0].devices[0].shape[0], self.page, rng, reserved=1)
        self.held: list[Held] = []
        self.lock = threading.Lock()
        self.numbers = iter(range(1 << 62))
        cls = type(case.pool)
        self.hooks = {op: pool_method_hook(cls, METHOD_NAMES[op]) for op in ("load", "backup")}
        if self.streams.cuda:
            self.originals = {op: vars(cls)[METHOD_NAMES[op]] for op in ("load", "backup")}
        else:
            self.originals = cpu_stock(case)

    # -- calls as SGLang makes them

    def _call(self, op: str, *args: Any) -> None:
        # As Python looks the method up: a stock binding kvcore's rule set on the pool first.
        bound = self.case.pool.__dict__.get(METHOD_NAMES[op])
        if bound is not None:
            bound(*args)
            return
        self.hooks[op](self.originals[op], self.case.pool, *args)

    def _indices(
        self, op: str, host: torch.Tensor, rows: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's indices where SGLang's controller puts them (on the forward stream):
        the device allocator's on the device, the host ones moved there through kvcore's
        ``move_indices`` hook, except for page_first's staged write-back."""
        device_rows = torch.from_numpy(rows)
        if not self.streams.cuda:
            return host, device_rows
        device_rows = device_rows.to(self.device)
        staged_write_back = (
            op == "backup"
            and self.case.layout == "page_first"
            and getattr(self.case.pool, "can_use_write_back_jit", False)
        )
        if staged_write_back:
            return host, device_rows

        from benchmarks.sglang.hook_adapter import move_indices

        def move(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
            return h.to(self.device, non_blocking=True), d

        moved = move_indices(move, None, host, device_rows)
        return moved[0], moved[1]

    @contextlib.contextmanager
    def _issuing(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        torch.cuda.set_device(self.device)
        with on_stream(stream):
            yield

    # -- backups

    def _size(self, rng: np.random.Generator) -> int:
        low, high = self.opts.profile.min_tokens, self.opts.profile.max_tokens
        tokens = int(np.exp(rng.uniform(np.log(low), np.log(high))))
        return max(self.page, tokens // self.page * self.page)

    def evict_one(self, rng: np.random.Generator) -> bool:
        """Free a random reloaded, idle request's host slots through ``pool.free``."""
        with self.lock:
            idle = [i for i, h in enumerate(self.held) if h.verified and h.busy == 0]
            if not idle:
                return False
            victim = self.held.pop(int(rng.choice(idle)))
        self.case.pool.free(victim.host)
        return True

    def _host_slots(self, tokens: int, rng: np.random.Generator, wait: Waiting) -> Any:
        """Host slots from ``pool.alloc``, evicting reloaded requests while it is full."""
        while True:
            host = self.case.pool.alloc(tokens)
            if host is not None:
                return host
            if not self.evict_one(rng) and not wait():
                return None

    def _device_rows(self, tokens: int, wait: Waiting) -> Any:
        while True:
            rows = self.pages.alloc(tokens)
            if rows is not None or not wait():
                return rows

    def backup(
        self, gen: torch.Generator, rng: np.random.Generator, wait: Waiting
    ) -> PendingBackup | None:
        tokens = self._size(rng)
        host = self._host_slots(tokens, rng, wait)
        if host is None:
            return None
        rows = self._device_rows(tokens, wait)
        if rows is None:
            self.case.pool.free(host)
            return None
        streams, case = self.streams, self.case
        with self._issuing(self.forward):
            d = torch.from_numpy(rows).to(self.device)
            h = host.to(self.device)
            stray = torch.zeros((), dtype=torch.int64, device=self.device)
            for c in case.components:
                for layer, (device, poison) in enumerate(zip(c.devices, c.poison, strict=True)):
                    stray += mismatched(device[d], poison[d])
                    fresh = random_rows((len(rows), *device.shape[1:]), device.dtype, gen)
                    device[d] = fresh
                    view, index = host_rows(c.mirror, case.layout, self.page, layer, h)
                    view[index] = fresh
            host_idx, dev_idx = self._indices("backup", host.clone(), rows)
            start = streams.record(self.forward)
        with self._issuing(self.write_stream):
            streams.wait(self.write_stream, start)
            self._call("backup", case.device_pool, host_idx, dev_idx, BACKEND)
            done = streams.record(self.write_stream)
            for index in (host_idx, dev_idx):
                streams.keep(index, self.write_stream)
        self.tally.add(backups=1, backed_up_bytes=tokens * case.row_bytes * self.layers)
        return PendingBackup(Held(next(self.numbers), host), rows, d, done, stray)

    def finish_backup(self, pending: PendingBackup) -> None:
        """The backup's copy is complete: its device rows get their poison back (on the
        forward stream, after the copy) and go free; the request is held."""
        with self._issuing(self.forward):
            self.streams.wait(self.forward, pending.done)
            self._poison(pending.device_rows)
        # Read on this thread's stream, yet final: it was counted on the forward stream
        # before the backup's start event, which the finished backup waited for.
        self.tally.add(stray_bytes=int(pending.stray))
        self.pages.free(pending.rows)
        with self.lock:
            self.held.append(pending.held)

    def _poison(self, d: torch.Tensor) -> None:
        for c in self.case.components:
            for device, poison in zip(c.devices, c.poison, strict=True):
                device[d] = poison[d]

    # -- loads

    def pick(self, rng: np.random.Generator) -> Held | None:
        with self.lock:
            if not self.held:
                return None
            fresh = [h for h in self.held if not h.verified and h.busy == 0]
            chosen = fresh[0] if fresh else self.held[int(rng.integers(len(self.held)))]
            chosen.busy += 1
            return chosen

    def issue_load(self, held: Held, tokens: int, wait: Waiting) -> InFlight | None:
        rows = self._device_rows(tokens, wait)
        if rows is None:
            with self.lock:
                held.busy -= 1
            return None
        streams, case = self.streams, self.case
        host = held.host[:tokens].clone()  # a new index tensor every request
        with self._issuing(self.forward):
            d = torch.from_numpy(rows).to(self.device)
            stray = torch.zeros((), dtype=torch.int64, device=self.device)
            for c in case.components:
                for device, poison in zip(c.devices, c.poison, strict=True):
                    stray += mismatched(device[d], poison[d])
            host_idx, dev_idx = self._indices("load", host, rows)
            start = streams.record(self.forward)
        events = []
        with self._issuing(self.load_stream):
            streams.wait(self.load_stream, start)
            for layer in range(self.layers):
                self._call("load", case.device_pool, host_idx, dev_idx, layer, BACKEND)
                events.append(streams.record(self.load_stream))
            for index in (host_idx, dev_idx):
                streams.keep(index, self.load_stream)
        self.tally.add(
            loads=1,
            load_calls=self.layers,
            loaded_bytes=tokens * case.row_bytes * self.layers,
        )
        return InFlight(held, host, rows, d, events, stray)

    def consume(self, item: InFlight) -> None:
        """The forward pass: each layer read once its load is done, compared with what was
        backed up; then the rows go back to their poison and free."""
        case, streams = self.case, self.streams
        with self._issuing(self.forward):
            h = item.host.to(self.device)
            d = item.device_rows
            wrong = torch.zeros((), dtype=torch.int64, device=self.device)
            for layer in range(self.layers):
                streams.wait(self.forward, item.events[layer])
                for c in case.components:
                    expected = get_rows(c.mirror, case.layout, self.page, layer, h)
                    wrong += mismatched(c.devices[layer][d], expected)
            self._poison(d)
            done = streams.record(self.forward)
        streams.synchronize(done)
        wrong_bytes, stray = int(wrong), int(item.stray)
        self.pages.free(item.rows)
        with self.lock:
            first = not item.held.verified
            item.held.verified = True
            item.held.busy -= 1
        self.tally.add(
            reloads_checked=1,
            backups_verified=int(first),
            mismatched_bytes=wrong_bytes,
            stray_bytes=stray,
        )
        if wrong_bytes and len(self.errors) < 20:
            self.errors.append(
                f"{self.where}: reload of request {item.held.number} ({len(item.host)} tokens): "
                f"{wrong_bytes} bytes differ from what was backed up"
            )

    @property
    def where(self) -> str:
        return pool_name(self.case.kind, self.case.layout, self.page)

    # -- with nothing in flight

    def reload_unverified(self) -> None:
        """Every held request not yet read back, reloaded whole and checked."""
        for held in list(self.held):
            if held.verified:
                continue
            with self.lock:
                held.busy += 1
            # Nothing else is in flight: every device row is free.
            item = self.issue_load(held, len(held.host), lambda: False)
            if item is not None:
                self.consume(item)

    def free_all(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for each in held:
            self.case.pool.free(each.host)

    def checkpoint(self) -> None:
        """Nothing in flight: every device row holds its poison, the host pool its mirror."""
        sync(self.device)
        stray = 0
        for c in self.case.components:
            for device, poison in zip(c.devices, c.poison, strict=True):
                stray += int(mismatched(device, poison))
            stray += _host_mismatch(c.host, c.mirror)
        self.tally.add(stray_bytes=stray, checkpoints=1)
        if stray:
            self.errors.append(f"{self.where}: {stray} bytes outside every copy changed")
            self.case.restore_device()
            self.case.restore_host()


_CHECK_CHUNK = 256 << 20


def _host_mismatch(host: torch.Tensor, mirror: torch.Tensor) -> int:
    """Differing bytes between a host buffer and its mirror, compared a chunk at a time on
    the mirror's device."""
    a = host.reshape(-1).view(torch.uint8)
    b = mirror.reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, a.numel(), _CHECK_CHUNK):
        end = min(start + _CHECK_CHUNK, a.numel())
        total += int((a[start:end].to(b.device) != b[start:end]).sum())
    return total
