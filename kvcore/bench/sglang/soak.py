"""The SGLang soak: minutes of HiCache-shaped traffic through kvcore's hooks, every byte checked.

Pools are SGLang 0.5.23's own (MHA and MLA, ``layer_first`` and ``page_first``, page
sizes 64 and 1), built with kvcore's host-slot allocator installed as SGLang installs a
plugin (``kvcore_sglang.plugin`` through SGLang's ``HookRegistry``), so every host slot is
allocated and freed through the pool's own ``alloc``/``free``. The transfers are called as
the engine sweep calls them (:mod:`kvcore.bench.sglang.sweep`): kvcore's AROUND hook with
SGLang's method as ``original`` (a torch copy by SGLang's layout definition on a CPU, where
SGLang's kernels do not run), or the stock binding kvcore's rule set on the pool; the
``kernel`` io backend, indices where SGLang's controller puts them (host indices moved to
the GPU through kvcore's ``move_indices`` hook). Each pool runs twice, serve-or-pass rule
off (kvcore's own paths wherever it can) then on.

Three threads, as SGLang's cache controller and scheduler use them:

* backup: a request of random size (page multiples) gets host slots from ``pool.alloc``
  (evicting reloaded requests at random when full, and now and then anyway, so the free
  space fragments) and scattered device pages; fresh random bytes are written to those
  device rows on the forward stream, and the same bytes to the host mirror; then one
  ``backup_from_device_all_layer`` on the write stream, after the forward stream;
* load: a held request (not yet reloaded ones first), all of it or a prefix, into new
  scattered device pages: ``load_to_device_per_layer`` for every layer on the load stream,
  an event after each layer, new index tensors every request;
* forward (the main thread): per layer, waits for that layer's event and compares the
  loaded rows with the host mirror, byte for byte, then puts the rows' poison back.

Rows not named by a copy are checked too: device rows hold their poison whenever they
are free (checked before every reuse and at every checkpoint), and the whole host pool
equals its mirror at every checkpoint (the end of each phase, when nothing is in flight).
Before a pool goes, every request still held is reloaded and checked, then freed, and
the pool's slot state must be as it was built: every slot free, one free run, the whole
pool allocatable as one ascending run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvcore.bench.sglang.ab_paths import METHOD_NAMES
from kvcore.bench.sglang.import_stubs import install_torchvision_stub
from kvcore.bench.sglang.jit_kernels import on_stream, warm_jit
from kvcore.bench.sglang.pool_case import Options as CaseOptions
from kvcore.bench.sglang.pool_case import PoolCase, pool_case
from kvcore.bench.sglang.pool_rows import get_rows, host_rows
from kvcore.bench.sglang.sgl_kernel_stub import install_sgl_kernel_stub
from kvcore.bench.soak_report import Accounting, Tally, kvcore_counts
from kvcore.bench.soak_state import (
    CPU_ONLY,
    PhaseClock,
    RandomPages,
    Streams,
    holders,
    memory_state,
    mismatched,
    mover_state,
    other_threads,
    pinned_in_use,
    prepared_plan_holders,
    random_rows,
    settle,
    sync,
    with_index,
)
from kvcore.config import KVCoreConfig
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.path_policy import policy_from_config

BACKEND = "kernel"
KINDS = ("mha", "mla")
LAYOUTS = ("layer_first", "page_first")
PAGES = (64, 1)
RULES = (False, True)
# Wall seconds a pool takes besides its traffic at full size (build, final reloads,
# checkpoints, teardown), and about what the end accounting takes.
RESERVE_S = 12.0


@dataclass(frozen=True)
class Profile:
    """Sizes of one run: pools hold ``2 * pool_tokens`` tokens a side."""

    layers: dict[str, int]
    pool_tokens: int
    min_tokens: int
    max_tokens: int
    max_held: int
    """Host requests kept at most before the oldest reloaded ones are evicted."""


PROFILES = {
    # A Llama-8B-shaped MHA model and a DeepSeek-shaped MLA one, 64k tokens a side.
    "full": Profile({"mha": 32, "mla": 61}, 32768, 64, 16384, 48),
    # Small enough for compute-sanitizer, which slows every kernel down by 10-100x.
    "sanitize": Profile({"mha": 4, "mla": 4}, 4096, 64, 2048, 16),
    "cpu": Profile({"mha": 2, "mla": 2}, 2048, 64, 1024, 16),
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
    """Pool names (``mha/layer_first/p64``) to run, all of them when empty."""

    @property
    def pools(self) -> list[tuple[str, str, int]]:
        every = [(k, lay, p) for k in KINDS for lay in LAYOUTS for p in PAGES]
        return [pool for pool in every if not self.only or pool_name(*pool) in self.only]


def pool_name(kind: str, layout: str, page: int) -> str:
    return f"{kind}/{layout}/p{page}"


# --- pieces --------------------------------------------------------------------------------


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


# --- one pool ------------------------------------------------------------------------------


class PoolSoak:
    """The traffic over one pool pair, phase by phase."""

    def __init__(
        self, case: PoolCase, opts: Options, mover: Mover, tally: Tally, errors: list[str]
    ) -> None:
        from kvcore_sglang import transfers

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
        self.hooks = {
            op: transfers.HOOKS[f"{cls.__module__}.{cls.__qualname__}.{METHOD_NAMES[op]}"]
            for op in ("load", "backup")
        }
        if self.streams.cuda:
            self.originals = {op: vars(cls)[METHOD_NAMES[op]] for op in ("load", "backup")}
        else:
            self.originals = cpu_stock(case)
        self.transfers = transfers

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

        def move(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
            return h.to(self.device, non_blocking=True), d

        moved = self.transfers.move_indices_hook(move, None, host, device_rows)
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

    def _evict_one(self, rng: np.random.Generator) -> bool:
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
            if not self._evict_one(rng) and not wait():
                return None

    def _device_rows(self, tokens: int, wait: Waiting) -> Any:
        while True:
            rows = self.pages.alloc(tokens)
            if rows is not None or not wait():
                return rows

    def _backup(
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

    def _finish_backup(self, pending: PendingBackup) -> None:
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

    def _pick(self, rng: np.random.Generator) -> Held | None:
        with self.lock:
            if not self.held:
                return None
            fresh = [h for h in self.held if not h.verified and h.busy == 0]
            chosen = fresh[0] if fresh else self.held[int(rng.integers(len(self.held)))]
            chosen.busy += 1
            return chosen

    def _issue_load(self, held: Held, tokens: int, wait: Waiting) -> InFlight | None:
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

    def _consume(self, item: InFlight) -> None:
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

    # -- phases

    def phase(self, rule: bool, seconds: float) -> dict[str, Any]:
        """Backups and loads at once for ``seconds`` (at least one of each), then a
        checkpoint with nothing in flight."""
        self.transfers.serve_rule_enabled = lambda: rule  # type: ignore[assignment]
        assert self.mover.metrics is not None
        before, counts_before = self.mover.metrics.snapshot(), self.tally.to_dict()
        started = time.perf_counter()
        deadline = started + seconds
        stop = threading.Event()
        loads: queue.Queue[InFlight | None] = queue.Queue(maxsize=2)
        backed_up, backups_over = threading.Event(), threading.Event()
        threads = [
            threading.Thread(
                target=self._guarded(self._backup_loop, deadline, stop, backed_up, backups_over),
                daemon=True,
            ),
            threading.Thread(
                target=self._guarded(self._load_loop, deadline, stop, backups_over, loads),
                daemon=True,
            ),
        ]
        for thread in threads:
            thread.start()
        while (item := loads.get()) is not None:
            try:
                self._consume(item)
            except Exception:
                self._record_error("forward")
                stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        self.checkpoint()
        self.transfers.restore_bypassed()
        after = self.mover.metrics.snapshot()
        counts = self.tally.to_dict()
        return {
            "pool": self.where,
            "serve_rule": rule,
            "seconds": round(elapsed, 3),
            **{k: counts[k] - counts_before[k] for k in ("loads", "backups", "reloads_checked")},
            "held_at_end": len(self.held),
            # Read after every phase: a leak grows with traffic, a one-time cost does not.
            "pinned_host_in_use": pinned_in_use(self.device),
            "kvcore": kvcore_counts(before, after),
        }

    def _guarded(self, body: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                body(*args)
            except Exception:
                self._record_error(body.__name__)
                args[1].set()  # every loop's second argument: its stop event

        return run

    def _record_error(self, where: str) -> None:
        lines = traceback.format_exc().strip().splitlines()
        self.errors.append(f"{self.where} {where}: {' | '.join(lines[-3:])}"[:600])

    def _backup_loop(
        self,
        deadline: float,
        stop: threading.Event,
        backed_up: threading.Event,
        over: threading.Event,
    ) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.opts.seed + 1)
        rng = np.random.default_rng(self.opts.seed + 2)
        pending: list[PendingBackup] = []

        def reap() -> None:
            while pending and self.streams.query(pending[0].done):
                self._finish_backup(pending.pop(0))
                backed_up.set()
                if rng.random() < 0.25 or len(self.held) > self.opts.profile.max_held:
                    self._evict_one(rng)

        def wait() -> bool:
            # Backups in flight hold device rows until reaped; past the deadline, with one
            # backup done, a request that cannot get its slots is dropped.
            reap()
            if stop.is_set() or (time.perf_counter() > deadline and backed_up.is_set()):
                return False
            time.sleep(0.001)
            return True

        try:
            while not stop.is_set() and (time.perf_counter() < deadline or not backed_up.is_set()):
                if len(pending) >= 2:
                    self.streams.synchronize(pending[0].done)
                reap()
                issued = self._backup(gen, rng, wait)
                if issued is not None:
                    pending.append(issued)
        finally:
            for item in pending:
                self.streams.synchronize(item.done)
            reap()
            over.set()

    def _load_loop(
        self,
        deadline: float,
        stop: threading.Event,
        backups_over: threading.Event,
        loads: queue.Queue[InFlight | None],
    ) -> None:
        rng = np.random.default_rng(self.opts.seed + 3)
        issued = 0

        def wait() -> bool:
            # The forward thread frees the rows of the loads it has checked.
            if stop.is_set() or (time.perf_counter() > deadline and issued):
                return False
            time.sleep(0.001)
            return True

        try:
            while not stop.is_set() and (time.perf_counter() < deadline or issued == 0):
                held = self._pick(rng)
                if held is None:
                    if backups_over.is_set():
                        break  # nothing was backed up this phase and nothing will be
                    time.sleep(0.001)
                    continue
                tokens = len(held.host)
                if rng.random() < 0.5:  # a prefix, as a partial cache hit loads
                    tokens = int(rng.integers(1, tokens // self.page + 1)) * self.page
                item = self._issue_load(held, tokens, wait)
                if item is not None:
                    loads.put(item)
                    issued += 1
        finally:
            loads.put(None)

    def reload_unverified(self) -> None:
        """Every held request not yet read back, reloaded whole and checked."""
        for held in list(self.held):
            if held.verified:
                continue
            with self.lock:
                held.busy += 1
            # Nothing else is in flight: every device row is free.
            item = self._issue_load(held, len(held.host), lambda: False)
            if item is not None:
                self._consume(item)

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


# --- the run -------------------------------------------------------------------------------


@contextlib.contextmanager
def allocator_hooks() -> Iterator[Any]:
    """kvcore's host-slot hooks registered by its SGLang plugin and applied by SGLang's
    ``HookRegistry``, as a scheduler process does; all of it undone on exit."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcore_sglang import plugin

    if plugin.applied_status() is not None:
        raise RuntimeError("kvcore's SGLang hooks are installed in this process already")
    # Hooks other code registered stay out of the soak's way, and come back after it.
    saved_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    saved_env = os.environ.get("KVCORE_ENABLE")
    HookRegistry.reset()
    os.environ["KVCORE_ENABLE"] = "sglang"
    try:
        status = plugin.register_hooks(KVCoreConfig.from_env(), with_transfers=False)
        HookRegistry.apply_hooks()
        yield status
    finally:
        plugin.uninstall()
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
        if saved_env is None:
            os.environ.pop("KVCORE_ENABLE", None)
        else:
            os.environ["KVCORE_ENABLE"] = saved_env


@contextlib.contextmanager
def soak_mover() -> Iterator[Mover]:
    """The hooks' process mover replaced by one counting into its own metrics (as the
    sweep's ``bench_mover`` does); the rule setting is put back on exit."""
    from kvcore_sglang import transfers

    mover = Mover(policy_from_config(KVCoreConfig.from_env()), metrics=Metrics())
    saved = transfers._mover, transfers.serve_rule_enabled
    transfers._mover = mover
    try:
        yield mover
    finally:
        transfers._mover, transfers.serve_rule_enabled = saved


@contextlib.contextmanager
def _quiet_passes(device: torch.device) -> Iterator[None]:
    """On a CPU the stock stand-ins cannot be bound on a pool, so every pass the rule
    decides logs its line; kvcore's log keeps warnings only there."""
    log = logging.getLogger("kvcore")
    level = log.level
    if device.type != "cuda":
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def index_caches() -> tuple[dict[str, Any], dict[str, str]]:
    """Sizes of what kvcore's SGLang adapter keeps between calls."""
    from kvcore_sglang import transfers

    values: dict[str, Any] = {
        "host_index_memo": len(transfers.HOST_INDEX_MEMO),
        "bypassed_pools": len(transfers.BYPASSED),
    }
    reads = {"host_index_memo": "public", "bypassed_pools": "public"}
    for name, memo in (
        ("pool_layers", transfers.POOL_LAYERS),
        ("layer_pairs", transfers.LAYER_PAIRS),
    ):
        by_pool = getattr(memo, "_by_pool", None)
        values[name] = None if by_pool is None else len(by_pool)
        reads[name] = "private"
    return values, reads


def state(mover: Mover, device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    values, reads = {}, {}
    for part in (mover_state(mover, device), memory_state(device), index_caches()):
        values.update(part[0])
        reads.update(part[1])
    return values, reads


def slot_state(pool: Any) -> dict[str, Any]:
    """The pool's slot state as SGLang and kvcore's allocator report it."""
    from kvcore_sglang import host_slots

    allocator = host_slots.slots_of(pool)
    return {
        "host slots free": pool.available_size(),
        "slot_used flags set": int(torch.as_tensor(pool.slot_used).sum()),
        "kvcore allocator free runs": None
        if allocator is None
        else [list(run) for run in allocator.free_runs_snapshot()],
    }


def slot_accounting(pool: Any, accounting: Accounting, built: dict[str, Any], where: str) -> None:
    """The pool's slot state against the state it was built with, and the whole pool
    allocatable as one ascending run through ``pool.alloc``."""
    end = slot_state(pool)
    for name, before in built.items():
        if before is None:
            accounting.skip(f"{where} {name}", "the pool runs SGLang's own allocator")
        else:
            accounting.exact(f"{where} {name}", before, end[name], "public")
    capacity = built["host slots free"]
    whole = pool.alloc(capacity)
    one_run = whole is not None and bool(torch.equal(whole, torch.arange(capacity)))
    accounting.exact(f"{where} whole pool allocatable as one run", True, one_run, "public")
    if whole is not None:
        pool.free(whole)


def run(opts: Options) -> dict[str, Any]:
    """The whole soak; returns the pieces of its JSON document."""
    stub = install_sgl_kernel_stub()
    install_torchvision_stub()
    import sglang

    from kvcore_sglang import transfers

    tally, accounting = Tally(), Accounting()
    errors: list[str] = []
    phases: list[dict[str, Any]] = []
    opts = replace(opts, device=with_index(opts.device))
    device = opts.device
    jit = warm_jit(CaseOptions(device=device))
    if not opts.pools:
        raise ValueError(f"no pool is named {', '.join(opts.only)}")
    clock = PhaseClock(opts.seconds, len(opts.pools) * len(RULES), opts.deadline)
    with allocator_hooks() as status, soak_mover() as mover, _quiet_passes(device):
        if not any(t.endswith(".alloc") for t in status.patched_targets):
            errors.append(f"kvcore's host-slot hooks were not applied: {status.summary()}")
        settle(mover, device)
        baseline, reads = state(mover, device)
        load_requests_before = len(transfers.LOAD_REQUESTS)
        for number, (kind, layout, page) in enumerate(opts.pools):
            opts.progress(f"-- {kind} {layout} page {page}")
            try:
                phases += _soak_pool(
                    kind,
                    layout,
                    page,
                    _seeded(opts, number),
                    mover,
                    tally,
                    accounting,
                    errors,
                    clock,
                )
            except Exception:
                lines = traceback.format_exc().strip().splitlines()
                errors.append(f"{kind}/{layout}/p{page}: {' | '.join(lines[-3:])}"[:600])
            gc.collect()
        traffic_seconds = sum(phase["seconds"] for phase in phases)
        # The adapter keeps the latest load request of each (host pool, device pool) pair
        # (kvcore_sglang.load_requests); a pool SGLang drops leaves its entry until cleared.
        accounting.bounded(
            "load_requests",
            load_requests_before,
            len(transfers.LOAD_REQUESTS),
            load_requests_before + len(opts.pools),
            "public",
            "one entry per pool pair by design; cleared afterwards as the sweep's pool "
            "release clears it, before the exact comparisons",
        )
        transfers.LOAD_REQUESTS.clear()
        gc.collect()
        settle(mover, device)
        end, _ = state(mover, device)
        accounting.compare(
            baseline, end, reads, CPU_ONLY if device.type != "cuda" else "unreadable here"
        )
        left_held = _left_held(mover) if accounting.leaks else []
        accounting.skip(
            "events",
            "SGLang's hooks keep no events of their own beyond the staging buffer's one a "
            "device (its leases are checked); SGLang's events are its own",
        )
    counts = tally.to_dict()
    if counts["backups"] != counts["backups_verified"]:
        errors.append(
            f"{counts['backups'] - counts['backups_verified']} backups were never read back"
        )
    return {
        "tally": tally,
        "accounting": accounting,
        "errors": errors,
        "seconds": traffic_seconds,
        "extra": {
            "sglang": getattr(sglang, "__version__", "unknown"),
            "torch": torch.__version__,
            "sgl_kernel": "stub (not installed)" if stub else "installed",
            "jit_modules": jit,
            "io_backend": BACKEND,
            "sizes": {
                "layers": opts.profile.layers,
                "pool_tokens_a_side": 2 * opts.profile.pool_tokens,
                "request_tokens": [opts.profile.min_tokens, opts.profile.max_tokens],
            },
            "phases": phases,
            "left_held": left_held,
        },
    }


def _left_held(mover: Mover) -> list[str]:
    """What holds a prepared plan, and a device index the adapter still remembers, where
    the end accounting found state the traffic left behind."""
    from kvcore_sglang import transfers

    lines = prepared_plan_holders(mover)
    remembered = [
        entry[0]() for entry in list(getattr(transfers.HOST_INDEX_MEMO, "_moved", {}).values())
    ]
    alive = [tensor for tensor in remembered if tensor is not None][:1]
    del remembered
    while alive:
        lines += holders(alive.pop())
    return lines + other_threads()


def _soak_pool(
    kind: str,
    layout: str,
    page: int,
    opts: Options,
    mover: Mover,
    tally: Tally,
    accounting: Accounting,
    errors: list[str],
    clock: PhaseClock,
) -> list[dict[str, Any]]:
    """One pool pair through both phases; nothing of it outlives the call."""
    base = CaseOptions(
        tokens=opts.profile.pool_tokens,
        layers=opts.profile.layers[kind],
        device=opts.device,
        seed=opts.seed,
    )
    phases = []
    with pool_case(kind, layout, page, base) as case:
        built = slot_state(case.pool)
        soak = PoolSoak(case, opts, mover, tally, errors)
        for rule in RULES:
            # This pool's teardown, every later pool's whole life, the end accounting.
            reserve = RESERVE_S * (clock.left_phases // len(RULES) + 1)
            phases.append(soak.phase(rule, clock.next(reserve)))
            opts.progress(_phase_line(phases[-1]))
        soak.reload_unverified()
        soak.free_all()
        soak.checkpoint()
        slot_accounting(case.pool, accounting, built, soak.where)
    return phases


def _seeded(opts: Options, number: int) -> Options:
    return replace(opts, seed=opts.seed * 1000 + number * 10)


def _phase_line(phase: dict[str, Any]) -> str:
    served = sum(n for key, n in phase["kvcore"]["decisions"].items() if key.startswith("serve:"))
    return (
        f"{phase['pool']} rule {'on' if phase['serve_rule'] else 'off'}: "
        f"{phase['seconds']:.1f} s, {phase['backups']} backups, {phase['loads']} loads "
        f"({phase['reloads_checked']} checked), kvcore served {served} requests"
    )


__all__ = ["PROFILES", "Options", "Profile", "run"]
