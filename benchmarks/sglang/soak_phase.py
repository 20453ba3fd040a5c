"""One phase of the SGLang soak over a pool: backups and loads at once, from two threads.

:func:`run_phase` issues a :class:`~benchmarks.sglang.soak_pool.PoolSoak`'s backups from
one thread and its reloads from another, as SGLang's cache controller does, while the
calling thread plays the forward pass and checks each reload; then a checkpoint with
nothing in flight. The steps themselves are :mod:`benchmarks.sglang.soak_pool`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.sglang.soak_pool import InFlight, PendingBackup, PoolSoak
from benchmarks.soak_report import kvcore_counts
from benchmarks.soak_state import failure_line, pinned_in_use


def run_phase(soak: PoolSoak, rule: bool, seconds: float) -> dict[str, Any]:
    """Backups and loads at once for ``seconds`` (at least one of each), then a
    checkpoint with nothing in flight."""
    from benchmarks.sglang.hook_adapter import bench_adapter

    bench_adapter().serve_rule = rule
    assert soak.mover.metrics is not None
    before, counts_before = soak.mover.metrics.snapshot(), soak.tally.to_dict()
    # Read before and after the traffic: growth between phases is set-up (a pool built),
    # growth within one is the traffic's.
    pinned_at_start = pinned_in_use(soak.device)
    started = time.perf_counter()
    deadline = started + seconds
    stop = threading.Event()
    loads: queue.Queue[InFlight | None] = queue.Queue(maxsize=2)
    backed_up, backups_over = threading.Event(), threading.Event()
    threads = [
        threading.Thread(
            target=_guarded(soak, _backup_loop, deadline, stop, backed_up, backups_over),
            daemon=True,
        ),
        threading.Thread(
            target=_guarded(soak, _load_loop, deadline, stop, backups_over, loads),
            daemon=True,
        ),
    ]
    for thread in threads:
        thread.start()
    while (item := loads.get()) is not None:
        try:
            soak.consume(item)
        except Exception:
            _record_error(soak, "forward")
            stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    soak.checkpoint()
    bench_adapter().bindings.restore()
    after = soak.mover.metrics.snapshot()
    counts = soak.tally.to_dict()
    return {
        "pool": soak.where,
        "serve_rule": rule,
        "seconds": round(elapsed, 3),
        **{k: counts[k] - counts_before[k] for k in ("loads", "backups", "reloads_checked")},
        "held_at_end": len(soak.held),
        "pinned_host_in_use_at_start": pinned_at_start,
        "pinned_host_in_use": pinned_in_use(soak.device),
        "kvcore": kvcore_counts(before, after),
    }


def _guarded(soak: PoolSoak, body: Callable[..., None], *args: Any) -> Callable[[], None]:
    def run() -> None:
        try:
            body(soak, *args)
        except Exception:
            _record_error(soak, body.__name__)
            args[1].set()  # every loop's stop event, after its deadline

    return run


def _record_error(soak: PoolSoak, where: str) -> None:
    soak.errors.append(failure_line(f"{soak.where} {where}"))


def _backup_loop(
    soak: PoolSoak,
    deadline: float,
    stop: threading.Event,
    backed_up: threading.Event,
    over: threading.Event,
) -> None:
    gen = torch.Generator(device=soak.device).manual_seed(soak.opts.seed + 1)
    rng = np.random.default_rng(soak.opts.seed + 2)
    pending: list[PendingBackup] = []

    def reap() -> None:
        while pending and soak.streams.query(pending[0].done):
            soak.finish_backup(pending.pop(0))
            backed_up.set()
            if rng.random() < 0.25 or len(soak.held) > soak.opts.profile.max_held:
                soak.evict_one(rng)

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
                soak.streams.synchronize(pending[0].done)
            reap()
            issued = soak.backup(gen, rng, wait)
            if issued is not None:
                pending.append(issued)
    finally:
        for item in pending:
            soak.streams.synchronize(item.done)
        reap()
        over.set()


def _load_loop(
    soak: PoolSoak,
    deadline: float,
    stop: threading.Event,
    backups_over: threading.Event,
    loads: queue.Queue[InFlight | None],
) -> None:
    rng = np.random.default_rng(soak.opts.seed + 3)
    issued = 0

    def wait() -> bool:
        # The forward thread frees the rows of the loads it has checked.
        if stop.is_set() or (time.perf_counter() > deadline and issued):
            return False
        time.sleep(0.001)
        return True

    try:
        while not stop.is_set() and (time.perf_counter() < deadline or issued == 0):
            held = soak.pick(rng)
            if held is None:
                if backups_over.is_set():
                    break  # nothing was backed up this phase and nothing will be
                time.sleep(0.001)
                continue
            tokens = len(held.host)
            if rng.random() < 0.5:  # a prefix, as a partial cache hit loads
                tokens = int(rng.integers(1, tokens // soak.page + 1)) * soak.page
            item = soak.issue_load(held, tokens, wait)
            if item is not None:
                loads.put(item)
                issued += 1
    finally:
        loads.put(None)
