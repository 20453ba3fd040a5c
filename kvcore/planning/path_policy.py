"""The copy paths kvcore has and the thresholds that choose between them.

:class:`TransferPath` names each path, :class:`PathPolicy` holds the sizes the choice
is made from and :func:`policy_from_config` reads them from a :class:`KVCoreConfig`;
:func:`dma_in_place_policy` the same with paged rows copied by DMA straight into place;
:data:`FALLBACK_REASONS` are the reasons a plan takes the engine's stock path. They sit
apart from planning and execution because both (and the staging buffers, the adapters
and the benchmarks) read them, while they depend on neither.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from kvcore.config import KVCoreConfig

FALLBACK_REASONS = frozenset(
    {
        "dtype_mismatch",
        "row_shape_mismatch",
        "strided_rows",
        "overlapping_buffers",
        "unsupported_device",
        "forced",
    }
)


class TransferPath(str, Enum):
    SINGLE_COPY = "single_copy"
    STAGED = "staged"
    BATCHED_RUNS = "batched_runs"
    GATHER = "gather"
    FALLBACK = "fallback"


REGION_STAGED_PATHS: dict[str, frozenset[TransferPath]] = {
    "off": frozenset(),
    "gather": frozenset({TransferPath.GATHER}),
    "all": frozenset({TransferPath.GATHER, TransferPath.BATCHED_RUNS}),
}
"""The plans' paths whose page-ins :attr:`PathPolicy.stage_regions` stages by region."""

REGION_STAGING_EVIDENCE = (
    "docs/bench/h100-beside-compute-vllm-2026-12-06-stage-regions-default.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-stage-regions-all.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-stage-regions-off.json",
)
"""The beside-compute runs :attr:`PathPolicy.stage_regions`' default is judged from: at the
default, and under ``all`` and ``off`` on one machine."""


@dataclass(frozen=True)
class PathPolicy:
    """Thresholds for the path choice."""

    staging_bytes: int = 256 << 20
    """Capacity of the preallocated staging buffer per device."""
    long_run_bytes: int = 256 << 10
    """Average run size from which one copy per run (or batched DMA) reaches line rate."""
    gather_ctas: int = 8
    """CTAs (so SMs) the UVA gather kernel may occupy on CUDA where it writes device rows."""
    gather_ctas_to_host: int = 4
    """The same where it writes host rows: at 4 the device-to-host gathers run as fast as
    at 8 and leave a concurrent model more SMs; host-to-device gathers need 8
    (docs/lab/benchmarks.md, the vLLM sweep on 4 CTAs and the gather's SM share)."""
    gather_ctas_short_rows: int = 4
    """The same where it writes device rows shorter than :attr:`short_row_bytes`: token
    rows of MLA (1152 B) moved as fast on 4 CTAs as on 8, and a concurrent model kept its
    share of the GPU only on 4; MHA's 2 KiB rows lose a third on 4 (docs/lab/benchmarks.md,
    "The gather's SM share at 4, 6 and 8 CTAs")."""
    short_row_bytes: int = 2048
    """Device rows under this many bytes take :attr:`gather_ctas_short_rows`."""
    ring_scatter_ctas: int = 64
    """CTAs the layer ring's scatter (a slot's rows into their pages) may occupy on CUDA:
    beside a prefill on an H100 the forward lost less to a 32k reload on 64 than on 8, 16
    or 32, the reload itself as fast (docs/performance.md, "The ring's scatter CTAs")."""
    max_dma_runs: int = 16
    """Most host runs a staged copy takes: each is one torch copy_, whose host time adds up
    (docs/lab/benchmarks.md, "Host time to submit one layer")."""
    max_batched_runs: int = 256
    """Most runs one cudaMemcpyBatchAsync takes; past it the gather kernel costs less host
    time than the batch's per-run submission (docs/lab/benchmarks.md, "What the numbers say")."""
    staged_pieces: int = 1
    """Pieces a staged copy is cut into (none under 8 MiB), the device-side scatter of one
    overlapping the DMA of the next. One piece runs on one stream with no events, which
    costs far less host time for nearly the same bandwidth (docs/lab/benchmarks.md, "Lone and
    queued")."""
    stage_regions: str = "gather"
    """Page-ins over layer pairs whose sources are one host region's adjacent pages
    (:attr:`~kvcore.planning.layers.LayerPairs.src_region`, vLLM's CPU tier) go staged by
    whole chunks, then scattered from device memory (:mod:`kvcore.region_staging`), where the
    plan would take a path of :data:`REGION_STAGED_PATHS` under this name. The gather's
    place by default: beside the model's compute its loads ran nearer the link and the
    forward beside them lost less; one DMA a page keeps its place, as it leaves the forward
    untouched (:data:`REGION_STAGING_EVIDENCE`; docs/performance.md, "Reloads beside the
    model's compute")."""
    begin_region_loads: bool = False
    """Such page-ins may begin before they are planned
    (:meth:`kvcore.mover.Mover.begin_region_load`): off until an A/B on a GPU shows their
    first DMA sooner and no load slower."""
    address_ring: bool = True
    """Such page-ins issue their ring by address, a CUDA runtime call a copy, wait or record
    (``KernelSet.open_address_ring``), where the kernel set has it: torch's streams and
    events cost the host several times more a piece."""

    def __post_init__(self) -> None:
        sizes = (
            self.staging_bytes,
            self.long_run_bytes,
            self.gather_ctas,
            self.gather_ctas_to_host,
            self.gather_ctas_short_rows,
            self.short_row_bytes,
            self.ring_scatter_ctas,
            self.max_dma_runs,
            self.max_batched_runs,
            self.staged_pieces,
        )
        if min(sizes) < 1:
            raise ValueError(f"PathPolicy sizes must be positive, got {self}")
        if self.stage_regions not in REGION_STAGED_PATHS:
            raise ValueError(
                f"stage_regions must be one of {', '.join(REGION_STAGED_PATHS)}, "
                f"got {self.stage_regions!r}"
            )


def policy_from_config(config: KVCoreConfig) -> PathPolicy:
    """The path policy that a KVCoreConfig (KVCORE_* variables) asks for."""
    return PathPolicy(
        staging_bytes=config.staging_bytes,
        long_run_bytes=config.long_run_bytes,
        max_batched_runs=config.max_batched_runs,
        gather_ctas=config.gather_ctas,
        gather_ctas_to_host=config.gather_ctas_to_host,
        gather_ctas_short_rows=config.gather_ctas_short_rows,
        ring_scatter_ctas=config.ring_scatter_ctas,
        staged_pieces=config.staged_pieces,
        stage_regions=config.stage_regions,
        begin_region_loads=config.begin_region_loads,
        address_ring=config.address_ring,
    )


DMA_IN_PLACE_RUN_BYTES = 32 << 10
"""The shortest run :func:`dma_in_place_policy` copies by DMA straight into place: the
shortest measured so beside the model's compute (vLLM's 32 KiB MHA blocks,
docs/performance.md, "Reloads beside the model's compute")."""
VLLM_STORE_DMA_IN_PLACE_RUN_BYTES = 16 << 10
"""The same for vLLM's stores: beside the model's compute, MLA's 18 KiB blocks stored this
way moved at least as fast as stock's copy with another batch's forward untouched, where
kvcore's gather slowed it; loaded this way they ran at about half the gather's speed
(docs/performance.md, "Reloads beside the model's compute")."""
SGLANG_DMA_IN_PLACE_RUN_BYTES = 128 << 10
"""The same for SGLang's pages (``KVCORE_SGLANG_DMA_IN_PLACE``): beside the model's compute,
MHA's 128 KiB pages went by DMA with every forward as fast as beside stock's kernel, while
pages of 32 KiB (MHA, 16 tokens) and 18-72 KiB (MLA) left the hit's own forward up to 1.5x
slower (docs/performance.md, "Pages by DMA straight into place")."""
DMA_IN_PLACE_MOST_RUNS = 1 << 16
"""The most runs of one layer it copies that way (131072 tokens of 16-token pages)."""
DMA_IN_PLACE_OVERRIDES = ("KVCORE_LONG_RUN_BYTES", "KVCORE_MAX_BATCHED_RUNS")
"""The settings that, when set, keep the policy as configured."""


def dma_in_place_policy(
    config: KVCoreConfig,
    environ: Mapping[str, str] | None = None,
    *,
    shortest_run: int = DMA_IN_PLACE_RUN_BYTES,
) -> PathPolicy:
    """``config``'s path policy with runs of ``shortest_run`` bytes and more copied
    by DMA straight into place (one ``cudaMemcpyBatchAsync`` descriptor a run, no kernel on
    any stream), unless the environment sets one of :data:`DMA_IN_PLACE_OVERRIDES` (an empty
    variable counts as unset): the operator's thresholds then stand as configured.

    vLLM's handlers always copy with it: a job moves whole blocks (16 tokens of one layer,
    18-64 KiB on common models), and beside the model's compute blocks of 32 KiB copied this
    way left another batch's forward as fast as beside stock's copy, for loads as fast as
    the gather's. MLA's 18 KiB blocks stay under the threshold: by DMA their loads ran at
    about half the gather's speed. SGLang's hooks use it under
    ``KVCORE_SGLANG_DMA_IN_PLACE``, from :data:`SGLANG_DMA_IN_PLACE_RUN_BYTES`."""
    environ = os.environ if environ is None else environ
    policy = policy_from_config(config)
    if any(environ.get(name) for name in DMA_IN_PLACE_OVERRIDES):
        return policy
    return replace(policy, long_run_bytes=shortest_run, max_batched_runs=DMA_IN_PLACE_MOST_RUNS)


def vllm_handler_policy(
    config: KVCoreConfig, *, gpu_to_cpu: bool, environ: Mapping[str, str] | None = None
) -> PathPolicy:
    """The thresholds a vLLM handler plans its jobs with (:func:`dma_in_place_policy`): DMA
    into place from :data:`DMA_IN_PLACE_RUN_BYTES`, for stores from
    :data:`VLLM_STORE_DMA_IN_PLACE_RUN_BYTES`."""
    shortest = VLLM_STORE_DMA_IN_PLACE_RUN_BYTES if gpu_to_cpu else DMA_IN_PLACE_RUN_BYTES
    return dma_in_place_policy(config, environ, shortest_run=shortest)
