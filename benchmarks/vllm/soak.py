"""The vLLM soak: minutes of CPU-offload traffic through kvcore's handlers, every page checked.

One worker loop plays vLLM's offloading worker and its scheduler's side of the CPU tier:
each step it may submit store jobs (GPU blocks to host chunks) and load jobs (host chunks
back into new GPU blocks) to kvcore's two handlers
(:class:`kvcore_vllm.transfers.KVCoreOffloadingHandler`, built over vLLM's own
``SingleDirectionOffloadingHandler`` as :mod:`benchmarks.vllm.offload_handlers` builds
them, one mover shared as ``install_handlers`` shares it), keeps several of each in flight,
polls ``get_finished`` and now and then ``wait``\\s on a job, as the worker does. Host chunk
ids come from kvcore's offloading manager (:class:`kvcore_vllm.manager.KVCoreCPUOffloadingManager`:
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

One layout's traffic is :mod:`benchmarks.vllm.soak_layout`, the handlers of a phase
:mod:`benchmarks.vllm.soak_handlers`; this module holds the options and the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from benchmarks.soak_report import Accounting, Tally
from benchmarks.soak_state import (
    CPU_ONLY,
    PhaseClock,
    SoakOptions,
    failure_line,
    memory_state,
    mover_state,
    other_threads,
    prepared_plan_holders,
    settle,
    with_index,
)
from benchmarks.vllm.offload_handlers import compiled_ops_loaded, env_policy
from benchmarks.vllm.soak_handlers import close_handlers, make_handlers
from benchmarks.vllm.soak_layout import LayoutSoak
from benchmarks.vllm.sweep_plan import MHA_PAGE_BYTES, MLA_PAGE_BYTES, ModelLayout
from benchmarks.vllm.sweep_pools import Pools
from kvcore.bench.host_buffers import HostBuffer, allocate_host_buffer
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore_vllm.manager import KVCoreCPUOffloadingManager

RULES = (False, True)
# Wall seconds a layout takes besides its traffic at full size (pools, final reloads,
# checkpoints, teardown), and about what the end accounting takes.
RESERVE_S = 12.0


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
class Options(SoakOptions):
    profile: Profile

    @property
    def layouts(self) -> tuple[ModelLayout, ...]:
        return tuple(m for m in self.profile.layouts if not self.only or m.name in self.only)


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
    mover = Mover(env_policy(), metrics=Metrics())
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
                errors.append(failure_line(model.name))
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
            "vllm_compiled_ops": compiled_ops_loaded(),
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
    phases[-1]["events_final_reloads"] = close_handlers(handlers)
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
