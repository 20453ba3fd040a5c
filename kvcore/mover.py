"""Execute planned row transfers between host and device memory.

A transfer copies rows: ``dst[dst_idx[k]] = src[src_idx[k]]``, a row being everything
after dim 0. :func:`kvcore.planning.plans.plan` validates the request and picks the path;
:class:`Mover` executes a plan through the kernels registered for the device side
(:mod:`kvcore.kernels`) and records what it did. The path policy, planning and staging
buffers have their own modules (:mod:`kvcore.planning.path_policy`, :mod:`kvcore.planning.plans`,
:mod:`kvcore.staging`); nothing of theirs is re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcore.direction import Direction
from kvcore.kernels import (
    GatherPrepared,
    KernelFactory,
    KernelSet,
    PreparedGather,
    StageInPrepared,
    gather_pairs,
    registered,
)
from kvcore.kernels.reference import index_copy_rows, staging_words
from kvcore.metrics import Metrics
from kvcore.planning.path_choice import rules_out_dma
from kvcore.planning.path_policy import REGION_STAGED_PATHS, PathPolicy, TransferPath
from kvcore.planning.plans import TransferPlan, plan
from kvcore.planning.staged_chunks import StagedChunk, staged_chunks
from kvcore.planning.submissions import layers_mismatch
from kvcore.region_staging import RegionLoad, RegionStaging
from kvcore.row_words import row_word_bytes, rows_as_words
from kvcore.staging import StagingBuffers

if TYPE_CHECKING:
    from kvcore.planning.layers import LayerPairs

__all__ = ["Mover", "PreparedLayers"]


@dataclass(frozen=True, eq=False)
class PreparedLayers:
    """A plan made ready once for every layer of one request (an engine's reload comes as
    one call per layer, all with the same indices): :meth:`Mover.prepare_layers` puts its
    indices on the device where its kernels gather, so that a layer costs one launch, and
    a staged page-in's chunks in the form its copies take them, so that a layer costs its
    copies and one scatter."""

    plan: TransferPlan
    rows: object | None
    """The kernel set's prepared indices (a gather's, or a staged page-in's chunks); None
    where each layer is copied as :meth:`Mover.execute` copies pairs (other paths, kernels
    without the op)."""
    run: GatherPrepared | None
    """Copies one layer's pairs with ``rows``; set with them."""
    fits: dict[int, weakref.ref[LayerPairs]] = dataclasses.field(default_factory=dict)
    """Pairs whose destinations share memory already found to fit the plan
    (:func:`layers_mismatch`), by id, each held weakly so that an id names its pairs only
    while they live (a plain dict and weak references cost a request a fraction of a
    WeakSet's Python-level methods). Whether the plan's rows collide there depends on the
    request's indices, so this answer is the request's alone; other pairs keep theirs
    across requests (:func:`_fits`)."""


@dataclass(frozen=True)
class _Prepared:
    """What executing a plan again reuses: its row views in words, and its gather set up."""

    src_words: torch.Tensor
    dst_words: torch.Tensor
    gather: PreparedGather | None


class Mover:
    """Executes plans through the kernels of each plan's device side."""

    def __init__(
        self,
        policy: PathPolicy = PathPolicy(),
        *,
        metrics: Metrics | None = None,
        staging: StagingBuffers | None = None,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.staging = StagingBuffers(policy.staging_bytes) if staging is None else staging
        # A factory's set for this mover's policy, kept with the entry it came from.
        self._built: dict[str, tuple[KernelFactory, KernelSet]] = {}
        # Per live plan: engines and benchmarks execute one plan again and again (a layer
        # at a time), and each set-up skipped is host time saved on every one of them.
        self._prepared: weakref.WeakKeyDictionary[TransferPlan, _Prepared] = (
            weakref.WeakKeyDictionary()
        )
        self._prepared_lock = threading.Lock()
        self._regions = RegionStaging(self.staging)

    def kernels(self, device: torch.device) -> KernelSet:
        """The registry's kernel set for ``device``; one a factory builds (CUDA's, which
        imports Triton) is built on first use and kept while the entry stays registered."""
        entry = registered(device.type)
        if isinstance(entry, KernelSet):
            return entry
        built = self._built.get(device.type)
        if built is None or built[0] is not entry:
            built = self._built[device.type] = (entry, entry(self.policy))
        return built[1]

    def transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        *,
        direction: Direction | None = None,
        stock: Callable[[], None] | None = None,
        force: TransferPath | None = None,
    ) -> TransferPlan:
        """Plan and execute; returns the plan so that callers can log its path."""
        chosen = plan(
            src, dst, src_idx, dst_idx, direction=direction, policy=self.policy, force=force
        )
        self.execute(chosen, stock=stock)
        return chosen

    def begin_region_load(
        self,
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        pairs: LayerPairs,
        plan_policy: PathPolicy | None = None,
    ) -> RegionLoad | None:
        """A page-in over ``pairs`` staged by region (:meth:`RegionStaging.begin`) begun before
        it is planned, where its plan (under ``plan_policy``, this mover's by default) will
        surely be staged so (and ``PathPolicy.begin_region_loads`` is on): its first DMAs then
        run while the caller plans, and the :meth:`execute` handed it finishes it. None where
        not: the indices' own rows decide, unchecked (the DMAs read the region's spans only,
        inside its bounds, and write the staging buffer only). The caller closes it whatever
        happens to the plan."""
        policy = self.policy if plan_policy is None else plan_policy
        if not self.policy.begin_region_loads:
            return None
        if TransferPath.GATHER not in REGION_STAGED_PATHS[self.policy.stage_regions]:
            return None
        if src_idx.dtype != torch.int64 or src_idx.device.type != "cpu":
            return None
        starts = self._regions.starts_of(src_idx.numpy(), pairs)
        if starts is None or src_idx.numel() != dst_idx.numel():
            return None
        if not rules_out_dma(starts.size, src_idx.numel() * pairs.row_bytes, policy):
            return None
        device = pairs.dsts[0].device
        return self._regions.begin(starts, dst_idx, pairs, self.kernels(device), device, src_idx)

    def execute(
        self,
        plan: TransferPlan,
        pairs: LayerPairs | None = None,
        *,
        stock: Callable[[], None] | None = None,
        begun: RegionLoad | None = None,
    ) -> None:
        """Run ``plan`` over its own buffers or, given ``pairs``, its rows between every pair
        of them: one submission for all where the device's kernels have one, one per pair
        where not (``plan`` made for one pair of the same layout: engines plan the first
        layer). A FALLBACK over its own buffers runs ``stock`` (the engine's own path) or,
        without one, copies the rows unchanged by torch indexing.

        Raises :class:`StalePlanError` where the plan's indices were written since planning
        (unless ``stock`` runs: it reads the engine's own), TypeError or ValueError where a
        FALLBACK without ``stock`` would need a conversion or a broadcast. With ``pairs``,
        raises ValueError when ``plan`` does not fit them or either says the copy must take
        the engine's stock path (the caller runs that path instead), or where ``stock`` is
        given too. ``begun``: the page-in :meth:`begin_region_load` began for ``plan`` over
        ``pairs``, finished here where the plan is staged by region and its source rows are
        the page-in's, else closed first (its DMAs wasted, the plan run as usual); where
        this raises first, the caller closes it.
        """
        if pairs is not None:
            if stock is not None:
                raise ValueError("stock runs in place of a plan over its own buffers only")
            self.execute_prepared(PreparedLayers(plan, None, None), pairs, begun)
            return
        if begun is not None:
            begun.close()
        started = time.perf_counter()
        if plan.path is TransferPath.FALLBACK and stock is not None:
            stock()
        else:
            plan.check_indices()
            if plan.path is TransferPath.FALLBACK:
                index_copy_rows(plan.src, plan.dst, plan.src_idx, plan.dst_idx)
        degraded = None
        if plan.path is not TransferPath.FALLBACK and plan.rows and plan.row_bytes:
            degraded = self._copy(plan)
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            direction, path = plan.direction._value_, plan.path._value_
            self.metrics.record_transfer(direction, path, plan.nbytes, seconds)
            for reason in (plan.reason, degraded):
                if reason is not None:
                    self.metrics.record_fallback(reason)

    def prepare_layers(
        self, plan: TransferPlan, *, src_idx_on_device: torch.Tensor | None = None
    ) -> PreparedLayers:
        """``plan`` ready for :meth:`execute_prepared` on each layer of one request.

        ``src_idx_on_device``: the engine's own copy of ``plan.src_idx`` on the plan's
        device (SGLang moves a reload's host indices to the GPU itself), used instead of an
        upload; int64 and contiguous, else it is not used. Raises :class:`StalePlanError`
        where the plan's indices were written since planning.
        """
        plan.check_indices()
        if not (plan.rows and plan.row_bytes):
            return PreparedLayers(plan, None, None)
        device = plan.device
        kernels = self.kernels(device)
        if plan.path is TransferPath.GATHER:
            if kernels.prepare_rows is not None and kernels.gather_prepared is not None:
                src_idx = _stand_in_on(src_idx_on_device, plan.src_idx, device)
                rows = kernels.prepare_rows(src_idx, plan.dst_idx, device)
                return PreparedLayers(plan, rows, kernels.gather_prepared)
        elif plan.path is TransferPath.STAGED:
            ready = self._stage_in_ready(plan, kernels)
            if ready is not None:
                chunks, stage_in = ready
                return PreparedLayers(plan, chunks, functools.partial(self._stage_in, stage_in))
        return PreparedLayers(plan, None, None)

    def _stage_in_ready(
        self, plan: TransferPlan, kernels: KernelSet
    ) -> tuple[object, StageInPrepared] | None:
        """A staged page-in's chunks made ready by ``kernels`` and the op that takes them;
        None for a page-out, or kernels without the ops."""
        prepare, stage_in = kernels.prepare_stage_in, kernels.stage_in_prepared
        if plan.direction is not Direction.H2D or prepare is None or stage_in is None:
            return None
        return prepare(self._chunks_fitting(plan), plan.dst_idx, plan.device), stage_in

    def _stage_in(
        self, stage_in: StageInPrepared, pairs: LayerPairs, prepared: object
    ) -> str | None:
        """A prepared staged page-in of one layer, through one lease of the staging buffer."""
        with self.staging.lease(pairs.dsts[0].device) as buffer:
            stage_in(pairs, prepared, buffer)
        return None

    def _chunks_fitting(self, plan: TransferPlan) -> tuple[StagedChunk, ...]:
        """The plan's staged chunks, cut again where this mover's staging buffer is smaller
        than the plan's policy assumed; ValueError where one row does not fit it."""
        chunk_rows = self.staging.capacity_bytes // plan.row_bytes
        if chunk_rows == 0:
            raise ValueError(
                f"a row of {plan.row_bytes} B does not fit the "
                f"{self.staging.capacity_bytes} B staging buffer"
            )
        chunks = plan.staged_chunks
        if not chunks or chunks[0].end - chunks[0].begin > chunk_rows:
            return staged_chunks(plan.host_runs, chunk_rows, plan.rows)
        return chunks

    def execute_prepared(
        self, prepared: PreparedLayers, pairs: LayerPairs, begun: RegionLoad | None = None
    ) -> None:
        """:meth:`execute` over ``pairs`` for one layer of a prepared request; raises as it does,
        but looks at all :func:`layers_mismatch` asks only where no earlier answer holds
        (:func:`_fits`)."""
        plan = prepared.plan
        plan.check_indices()
        if not _fits(prepared, plan, pairs):
            problem = layers_mismatch(plan, pairs)
            if problem is not None:
                raise ValueError(problem)
            _remember_fit(prepared, plan, pairs)
        started = time.perf_counter()
        degraded = None
        path = plan.path
        if begun is not None and not self._finishes(begun, plan, pairs):
            begun.close()
            begun = None
        if begun is not None:
            path = TransferPath.STAGED
            degraded = begun.finish(plan.dst_idx)
        elif prepared.rows is not None and prepared.run is not None:
            degraded = prepared.run(pairs, prepared.rows)
        elif self._stages_region(plan, pairs):
            path = TransferPath.STAGED
            degraded = self._regions.stage_in(plan, pairs, self.kernels(plan.device))
        elif plan.rows and plan.row_bytes:
            degraded = self._copy_layers(plan, pairs)
        self._record_layers(plan, pairs, time.perf_counter() - started, degraded, path)

    def _stages_region(self, plan: TransferPlan, pairs: LayerPairs) -> bool:
        """Whether a page-in over ``pairs`` goes staged by whole chunks of their host region
        (``PathPolicy.stage_regions``) in place of the gather or one DMA a page."""
        return (
            pairs.src_region is not None
            and plan.direction is Direction.H2D
            and plan.path in REGION_STAGED_PATHS[self.policy.stage_regions]
            and plan.rows > 0
            and self._regions.takes(plan, pairs)
        )

    def _finishes(self, begun: RegionLoad, plan: TransferPlan, pairs: LayerPairs) -> bool:
        """Whether the page-in ``begun`` copies ``plan`` over ``pairs``: a page-in staged by
        region (:meth:`_stages_region`, the plan's runs being the page-in's)."""
        return (
            plan.direction is Direction.H2D
            and plan.path in REGION_STAGED_PATHS[self.policy.stage_regions]
            and begun.copies(plan.src_idx, pairs)
        )

    def _record_layers(
        self,
        plan: TransferPlan,
        pairs: LayerPairs,
        seconds: float,
        degraded: str | None,
        taken: TransferPath,
    ) -> None:
        if self.metrics is not None:
            nbytes = plan.nbytes * len(pairs.srcs)
            # _value_ is the members' plain attribute: .value is a Python-level descriptor,
            # two calls a read on every layer.
            direction, path = plan.direction._value_, taken._value_
            self.metrics.record_transfer(direction, path, nbytes, seconds)
            if degraded is not None:
                self.metrics.record_fallback(degraded)

    def _copy_layers(self, plan: TransferPlan, pairs: LayerPairs) -> str | None:
        kernels = self.kernels(plan.device)
        runs_path = plan.path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS)
        if runs_path and kernels.copy_runs_layers is not None:
            return kernels.copy_runs_layers(pairs, plan.runs)
        if plan.path is TransferPath.GATHER:
            return gather_pairs(kernels, pairs, plan.src_idx, plan.dst_idx, plan.device)
        if plan.path is TransferPath.STAGED:
            ready = self._stage_in_ready(plan, kernels)
            if ready is not None:
                # Every pair takes the same chunks: made ready once, not once per pair.
                chunks, stage_in = ready
                return self._stage_in(stage_in, pairs, chunks)
            self._staged_pairs(
                plan, kernels, list(zip(pairs.src_words, pairs.dst_words, strict=True))
            )
            return None
        degraded = None
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            degraded = self._copy_words(plan, kernels, src_words, dst_words) or degraded
        return degraded

    def _copy(self, plan: TransferPlan) -> str | None:
        """Issue the plan's copies; returns why a slower way was taken, if one was."""
        kernels = self.kernels(plan.device)
        prepared = self._prepared.get(plan)
        if prepared is None:
            prepared = self._prepare(plan, kernels)
        if prepared.gather is not None:
            return prepared.gather(plan.src_idx, plan.dst_idx)
        return self._copy_words(plan, kernels, prepared.src_words, prepared.dst_words)

    def _prepare(self, plan: TransferPlan, kernels: KernelSet) -> _Prepared:
        src_words, dst_words = _word_views(plan.src, plan.dst)
        gather = None
        if plan.path is TransferPath.GATHER:
            gather = kernels.prepare_gather(src_words, dst_words)
        # Views of the plan's tensors, never of the plan: the entry goes when the plan does.
        prepared = _Prepared(src_words, dst_words, gather)
        with self._prepared_lock:
            self._prepared[plan] = prepared
        return prepared

    def _copy_words(
        self,
        plan: TransferPlan,
        kernels: KernelSet,
        src_words: torch.Tensor,
        dst_words: torch.Tensor,
    ) -> str | None:
        if plan.path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS):
            return kernels.copy_runs(src_words, dst_words, plan.runs)
        self._staged_pairs(plan, kernels, [(src_words, dst_words)])
        return None

    def _staged_pairs(
        self,
        plan: TransferPlan,
        kernels: KernelSet,
        word_pairs: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """The staged copy of ``plan``'s rows for each (source, destination) in word views,
        one after another through one lease of the device's staging buffer."""
        page_in = plan.direction is Direction.H2D
        chunks = self._chunks_fitting(plan)
        with self.staging.lease(plan.device) as buffer:
            for src_words, dst_words in word_pairs:
                for chunk in chunks:
                    begin, end = chunk.begin, chunk.end
                    staging = staging_words(buffer, end - begin, src_words)
                    if page_in:
                        kernels.stage_in(
                            src_words, chunk.host_runs, staging, dst_words, plan.dst_idx[begin:end]
                        )
                    else:
                        kernels.stage_out(
                            src_words, plan.src_idx[begin:end], staging, dst_words, chunk.host_runs
                        )


def _fits(prepared: PreparedLayers, plan: TransferPlan, pairs: LayerPairs) -> bool:
    """Whether an earlier :func:`layers_mismatch` found nothing that would still hold.

    Apart from the plan's fallback reason and spans, which are compared here, its answer
    depends on the pairs (frozen), the devices of ``plan.src`` and ``plan.dst`` (fixed for
    a tensor's life) and ``plan.row_bytes``, unless the pairs' destinations share memory:
    then it depends on the plan's destination rows too, and holds for one request only. A
    request's plan keeps row-less stand-ins shared by every plan of their kind
    (:meth:`TransferPlan.without_buffers`), so one answer serves every later request.
    """
    if pairs.shared_dsts:
        fitted = prepared.fits.get(id(pairs))
        return fitted is not None and fitted() is pairs
    kept = pairs.fitted_kind
    if not kept or plan.reason is not None:
        return False
    src, dst, kept_row_bytes = kept[-1]
    return (
        src() is plan.src
        and dst() is plan.dst
        and kept_row_bytes == plan.row_bytes
        and pairs.src_rows >= plan.src_span
        and pairs.dst_rows >= plan.dst_span
    )


def _remember_fit(prepared: PreparedLayers, plan: TransferPlan, pairs: LayerPairs) -> None:
    """Keep what :func:`_fits` reads, once ``pairs`` were found to fit ``plan``."""
    if pairs.shared_dsts:
        prepared.fits[id(pairs)] = weakref.ref(pairs)
    else:
        # One tuple, replaced whole: a thread reading the list sees one answer or another.
        pairs.fitted_kind[:] = ((weakref.ref(plan.src), weakref.ref(plan.dst), plan.row_bytes),)


def _stand_in_on(
    candidate: torch.Tensor | None, index: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """``candidate`` where it can stand for ``index`` on ``device`` (its values are the
    caller's word: the kernels' index form, as long), else ``index`` itself."""
    if (
        candidate is not None
        and candidate.device == device
        and candidate.dtype == torch.int64
        and candidate.dim() == 1
        and candidate.numel() == index.numel()
        and (candidate.numel() < 2 or candidate.stride(0) == 1)
    ):
        return candidate
    return index


def _word_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer row views of both sides with one word type that fits both alignments."""
    src_width = row_word_bytes(src)
    dst_width = row_word_bytes(dst)
    if src_width is None or dst_width is None:
        raise ValueError("the plan's tensors no longer have dense rows; plan again")
    width = min(src_width, dst_width)
    return rows_as_words(src, width), rows_as_words(dst, width)
