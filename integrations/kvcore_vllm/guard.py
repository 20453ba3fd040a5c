"""Version guard: the vLLM code the adapter relies on, fingerprinted per tested release.

kvcore does not replace vLLM functions in place; it subclasses vLLM's CPU offloading spec
and manager and puts the subclass where vLLM's spec factory looks for the default spec,
and swaps the worker's transfer handler objects for its own. The subclasses override some
methods and rely on what others do with the state they share, and the handler reads the
stock one's state and calls its descriptor fill, so each of those methods is a target.
Fingerprints (:mod:`kvcore.fingerprint`) are read from the installed files without
importing vLLM: `kvcore doctor` and the plugin reach the same verdict, and the doctor
stays fast.

Targets are named as vLLM 0.33 names them; :mod:`kvcore_vllm.releases` maps them to
each release's names and leaves out the fill methods of a release that fills inline.
Only the standard library and kvcore's core are imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kvcore import fingerprint
from kvcore_vllm.releases import shape_of

ENGINE = "vllm"
DISTRIBUTION = "vllm"


@dataclass(frozen=True)
class Target:
    """One function of vLLM that the adapter overrides (in a subclass) or depends on."""

    module: str
    qualname: str
    overridden: bool = False
    fill: bool = False
    """A descriptor fill method: releases that fill inside transfer_async have none."""
    pointers: bool = False
    """How the connector resolves device pointers: only releases that pass them (0.34)."""
    own_region: bool = False
    """How the worker takes a region: only releases whose worker gets kvcore's host
    mapping (0.25.1, :mod:`kvcore_vllm.host_region`)."""
    shared_region: bool = False
    """How vLLM's shared region faults itself in: only releases that map one (0.32 and
    later, :mod:`kvcore_vllm.region_faulting`)."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_MANAGER = "vllm.v1.kv_offload.cpu.manager"
_SPEC = "vllm.v1.kv_offload.cpu.spec"
_FACTORY = "vllm.v1.kv_offload.factory"
_WORKER = "vllm.v1.kv_offload.cpu.gpu_worker"
_POLICIES = "vllm.v1.kv_offload.cpu.policies.base"
_POINTERS = "vllm.v1.kv_offload.pointer_utils"
_REGION = "vllm.v1.kv_offload.cpu.shared_offload_region"

# Overridden: the chunk pool methods and get_manager. Depended on: the manager's
# constructor and the methods that call the chunk pool or read its counters, and the
# factory methods that resolve the default spec name through the registry.
TARGETS: tuple[Target, ...] = (
    Target(_MANAGER, "CPUOffloadingManager.__init__"),
    Target(_MANAGER, "CPUOffloadingManager._get_num_free_chunks", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager._allocate_chunks", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager._free_chunk", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager.prepare_store"),
    Target(_MANAGER, "CPUOffloadingManager.complete_store"),
    Target(_MANAGER, "CPUOffloadingManager.reset_cache", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager.get_stats"),
    # kvcore's chunk pool builds the manager's chunk records itself.
    Target(_POLICIES, "ChunkStatus.__init__"),
    Target(_SPEC, "CPUOffloadingSpec.get_manager", overridden=True),
    Target(_FACTORY, "OffloadingSpecFactory.register_spec"),
    Target(_FACTORY, "OffloadingSpecFactory.get_spec_cls"),
    Target(_FACTORY, "OffloadingSpecFactory.create_spec"),
    # The worker's transfer handlers are replaced after the stock create_worker built
    # them: kvcore's handler reads the stock one's state, keeps its contract, pairs pages
    # as its transfer_async and sub-block pointers do, and hands the jobs it does not copy
    # to the stock handler (transfer_async, get_finished, wait, shutdown). The A/B bench
    # issues stock's descriptors through the fill __init__ binds as _fill_group_ops (0.25
    # fills inline, through compute_sub_block_ptrs); the handler tells the copy op that
    # _select_swap_blocks_fn picks apart (a partial for the Triton load kernel).
    Target(_SPEC, "CPUOffloadingSpec.create_worker", overridden=True),
    Target(_WORKER, "CPUOffloadingWorker.__init__"),
    Target(_WORKER, "CPUOffloadingWorker.submit_store"),
    Target(_WORKER, "CPUOffloadingWorker.submit_load"),
    Target(_WORKER, "CPUOffloadingWorker.get_finished"),
    Target(_WORKER, "CPUOffloadingWorker.wait"),
    Target(_WORKER, "CPUOffloadingWorker.shutdown"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.__init__"),
    Target(_WORKER, "SingleDirectionOffloadingHandler._estimate_max_copy_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler._fill_direct_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler._fill_canonical_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler.transfer_async"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.get_finished"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.wait"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.shutdown"),
    Target(_WORKER, "compute_sub_block_ptrs"),
    Target(_WORKER, "_select_swap_blocks_fn"),
    # kvcore's handler reads a job's GPU blocks back from the pointers the connector
    # resolves (one per block and layer reference, group by group) and enters the first
    # CPU chunk of a group as the pointer groups do.
    Target(_POINTERS, "resolve_device_pointers", pointers=True),
    Target(_POINTERS, "iter_pointer_groups", pointers=True),
    # The worker registers kvcore's host mapping as it would its own region.
    Target(_WORKER, "pin_mmap_region", own_region=True),
    # The shared region is faulted in by kvcore in place of vLLM's own faulting, which asks
    # the module for its populate function once per region.
    Target(_REGION, "_get_populate_write_fn", shared_region=True),
    Target(_REGION, "SharedOffloadRegion.__init__", shared_region=True),
)

# Release -> target qualname (in the release's names) -> fingerprint, one data file per
# release, kvcore_vllm/fingerprints/RELEASE.json: ``python -m kvcore_vllm.guard RELEASE
# [ROOT]`` prints it (the installed vLLM by default).
FINGERPRINTS: dict[str, dict[str, str]] = fingerprint.recorded_releases("kvcore_vllm")
# The tested releases are exactly those with fingerprints.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(FINGERPRINTS)


def targets_for(release: str) -> tuple[Target, ...]:
    """The targets as ``release`` names them, without the fill methods it lacks."""
    shape = shape_of(release)
    return tuple(
        replace(t, qualname=shape.qualname(t.qualname))
        for t in TARGETS
        if not (t.fill and shape.fills_in_transfer_async)
        and not (t.pointers and not shape.device_pointers)
        and not (t.own_region and not shape.worker_pins_each_tensor)
        and not (t.shared_region and shape.worker_pins_each_tensor)
    )


def current_fingerprints(release: str, root: Path | None = None) -> dict[str, str]:
    """Target qualname -> fingerprint, as ``release`` names its targets, for the installed
    vLLM (or the tree at ``root``)."""
    return {t.qualname: fingerprint.fingerprint_target(t.name, root) for t in targets_for(release)}


def refusals(
    version: str,
    fingerprints: Mapping[str, Mapping[str, str]] = FINGERPRINTS,
    root: Path | None = None,
) -> dict[str, str]:
    """Target name -> why it cannot be trusted on ``version`` (a release string) in the
    source tree ``root`` (the installed vLLM's by default); empty when every target
    matches the fingerprint recorded for that release."""
    recorded = fingerprints.get(version)
    if recorded is None:
        return {target.name: f"no fingerprints recorded for vLLM {version}" for target in TARGETS}
    targets = targets_for(version)
    by_name = {t.name: recorded[t.qualname] for t in targets if t.qualname in recorded}
    return fingerprint.drift(by_name, root, targets=(t.name for t in targets))


def main(argv: list[str] | None = None) -> int:
    """Print a release's fingerprint file: ``RELEASE [ROOT]``, ``ROOT`` the directory that
    holds the ``vllm`` package (the installed one by default); the release decides the
    targets' names."""
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m kvcore_vllm.guard RELEASE [ROOT]", file=sys.stderr)
        return 2
    root = Path(args[1]) if len(args) > 1 else None
    return fingerprint.print_release_file(
        lambda: current_fingerprints(args[0], root), "vLLM", "kvcore_vllm.guard"
    )


if __name__ == "__main__":
    raise SystemExit(main())
