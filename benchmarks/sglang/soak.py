"""The SGLang soak: minutes of HiCache-shaped traffic through kvcore's hooks, every byte checked.

Pools are SGLang 0.5.23's own (MHA and MLA, ``layer_first`` and ``page_first``, page
sizes 64 and 1), built with kvcore's host-slot allocator installed as SGLang installs a
plugin (``kvcore_sglang.plugin`` through SGLang's ``HookRegistry``), so every host slot is
allocated and freed through the pool's own ``alloc``/``free``. The transfers are called as
the engine sweep calls them (:mod:`benchmarks.sglang.sweep`): kvcore's AROUND hook with
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

The traffic over one pool is :mod:`benchmarks.sglang.soak_pool` (its steps) and
:mod:`benchmarks.sglang.soak_phase` (a phase's threads), what the end accounting reads
:mod:`benchmarks.sglang.soak_accounting`; this module holds the options and the run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks.sglang.import_stubs import install_torchvision_stub
from benchmarks.sglang.jit_kernels import warm_jit
from benchmarks.sglang.pool_case import Options as CaseOptions
from benchmarks.sglang.pool_case import pool_case
from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub
from benchmarks.sglang.soak_accounting import slot_accounting, slot_state, state
from benchmarks.sglang.soak_phase import run_phase
from benchmarks.sglang.soak_pool import BACKEND, PoolSoak, pool_name
from benchmarks.soak_report import Accounting, Tally
from benchmarks.soak_state import (
    CPU_ONLY,
    PhaseClock,
    SoakOptions,
    failure_line,
    holders,
    other_threads,
    prepared_plan_holders,
    settle,
    with_index,
)
from kvcore.config import KVCoreConfig
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import policy_from_config

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
class Options(SoakOptions):
    profile: Profile

    @property
    def pools(self) -> list[tuple[str, str, int]]:
        every = [(k, lay, p) for k in KINDS for lay in LAYOUTS for p in PAGES]
        return [pool for pool in every if not self.only or pool_name(*pool) in self.only]


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
    from benchmarks.sglang.hook_adapter import using_mover

    mover = Mover(policy_from_config(KVCoreConfig.from_env()), metrics=Metrics())
    with using_mover(mover):
        yield mover


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


def run(opts: Options) -> dict[str, Any]:
    """The whole soak; returns the pieces of its JSON document."""
    stub = install_sgl_kernel_stub()
    install_torchvision_stub()
    import sglang

    from benchmarks.sglang.hook_adapter import bench_adapter

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
        load_requests = bench_adapter().load_requests
        load_requests_before = len(load_requests)
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
                errors.append(failure_line(f"{kind}/{layout}/p{page}"))
            gc.collect()
        traffic_seconds = sum(phase["seconds"] for phase in phases)
        # The adapter keeps the latest load request of each (host pool, device pool) pair
        # (kvcore_sglang.load_requests); a pool SGLang drops leaves its entry until cleared.
        accounting.bounded(
            "load_requests",
            load_requests_before,
            len(load_requests),
            load_requests_before + len(opts.pools),
            "public",
            "one entry per pool pair by design; cleared afterwards as the sweep's pool "
            "release clears it, before the exact comparisons",
        )
        load_requests.clear()
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
    from benchmarks.sglang.hook_adapter import bench_adapter

    lines = prepared_plan_holders(mover)
    memo = bench_adapter().host_indices
    remembered = [entry[0]() for entry in list(getattr(memo, "_moved", {}).values())]
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
            phases.append(run_phase(soak, rule, clock.next(reserve)))
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
