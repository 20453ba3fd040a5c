"""A vLLM offload job planned from its block ids alone: row indices per KV tensor, the
tensors of one row geometry (a model's layers) in one submission.

Per batch of KV tensors whose pages give the same row indices, the job's GPU blocks and CPU
sub-blocks become rows (:mod:`kvcore_vllm.page_rows`), planned once between the first
tensor's buffers (checked on their first job only) and spread over every tensor of the
batch (:func:`kvcore.planning.submissions.submissions`). A load of one batch whose sources
are a host region's views may begin before it is planned (``begin``: its first DMAs then
run while the rest is planned); the plan hands the begun page-in on, or closes it where the
job goes another way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.direction import Direction
from kvcore.planning.layers import LayerPairs, layer_pairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.plans import plan_for
from kvcore.planning.submissions import Submission, submissions
from kvcore.planning.transfer_sides import CheckedSides, check_sides
from kvcore.region_staging import RegionLoad
from kvcore.runs import has_duplicates
from kvcore_vllm.job_groups import Group
from kvcore_vllm.job_segments import Segment
from kvcore_vllm.page_rows import PageRows

Begin = Callable[[torch.Tensor, torch.Tensor, LayerPairs], RegionLoad | None]
"""Begins a load (source rows, destination rows, pairs) before it is planned, or None."""

Batches = dict[tuple[Any, ...], list[int]]


@dataclass(frozen=True)
class JobPlan:
    """A job's submissions, or the reason it goes to stock; and the load begun for it, if
    one was (the submissions' only one's, open until executed or closed)."""

    work: list[Submission]
    reason: str | None
    begun: RegionLoad | None = None


class JobPlanner:
    """Plans the jobs of one handler: ``groups`` and ``rows`` as
    :func:`kvcore_vllm.job_groups.describe_groups` gives them, in ``direction``, under
    ``policy``; ``begin`` (loads only) begins a load of one batch before it is planned."""

    def __init__(
        self,
        groups: list[Group | str],
        rows: dict[int, PageRows],
        direction: Direction,
        policy: PathPolicy,
        begin: Begin | None = None,
    ) -> None:
        self._groups = groups
        self._rows = rows
        self._direction = direction
        self._policy = policy
        self._begin = begin
        self._pairs: dict[tuple[int, ...], LayerPairs] = {}
        self._checked_sides: dict[int, CheckedSides] = {}
        self._batches_by_groups: dict[tuple[int, ...], Batches] = {}

    def group(self, segment: Segment) -> Group:
        group = self._groups[segment.group]
        assert isinstance(group, Group)
        return group

    def batches(self, segments: list[Segment]) -> Batches:
        """The job's KV tensors grouped by what their row indices depend on: the tensors of
        one batch share one plan and move in one submission."""
        groups = tuple(s.group for s in segments)
        batches = self._batches_by_groups.get(groups)
        if batches is None:
            batches = {}
            for tensor in dict.fromkeys(t for s in segments for t in self.group(s).tensors):
                used = tuple(s.group for s in segments if tensor in self.group(s).tensors)
                batches.setdefault((self._rows[tensor].geometry, used), []).append(tensor)
            # Which groups a job copies decides its batches: a handful of combinations.
            self._batches_by_groups[groups] = batches
        return batches

    def plan(self, segments: list[Segment]) -> JobPlan:
        """The job's submissions, or why it goes to stock; raises where planning fails (the
        load begun for it closed first)."""
        batches = self.batches(segments)
        begin = self._begin if self._direction is Direction.H2D and len(batches) == 1 else None
        begun: RegionLoad | None = None
        work: list[Submission] = []
        try:
            for (_, used), tensors in batches.items():
                src_idx, dst_idx = self._indices(segments, used, self._rows[tensors[0]])
                layered = self._layer_pairs(tuple(tensors)) if len(tensors) > 1 else None
                # Pairs that cannot move in one submission would leave the load unfinished.
                if begin is not None and layered is not None and layered.reason is None:
                    begun = begin(src_idx, dst_idx, layered)
                decided = self._submissions(tensors, src_idx, dst_idx, layered)
                if isinstance(decided, str):
                    if begun is not None:
                        begun.close()
                    return JobPlan([], decided)
                work += decided
        except BaseException:
            if begun is not None:
                begun.close()
            raise
        if begun is not None and (len(work) != 1 or work[0].pairs is not begun.pairs):
            begun.close()
            begun = None
        return JobPlan(work, None, begun)

    def _indices(
        self, segments: list[Segment], used: tuple[int, ...], rows: PageRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The source and destination rows of the job's segments of groups ``used``."""
        gpu_rows, cpu_rows = [], []
        for segment in segments:
            if segment.group in used:
                gpu_rows.append(rows.gpu_pages.rows_of_array(segment.gpu_blocks))
                cpu_rows.append(rows.cpu_pages.rows_of_array(segment.cpu_sub_blocks))
        gpu_idx = torch.from_numpy(np.concatenate(gpu_rows))
        cpu_idx = torch.from_numpy(np.concatenate(cpu_rows))
        return (cpu_idx, gpu_idx) if self._direction is Direction.H2D else (gpu_idx, cpu_idx)

    def _submissions(
        self,
        tensors: list[int],
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        layered: LayerPairs | None,
    ) -> list[Submission] | str:
        """One batch's submissions, planned between its first tensor's buffers; or why the
        job goes to stock."""
        sides = self._checked_sides.get(tensors[0])
        if sides is None:  # the engine's buffers: checked on their first job only
            sides = check_sides(*self._sides(self._rows[tensors[0]]), self._direction)
            self._checked_sides[tensors[0]] = sides
        try:
            first = plan_for(sides, src_idx, dst_idx, policy=self._policy)
        except ValueError:
            # Planning checks for duplicates in the same pass as the runs; only a refused
            # plan pays for telling them apart from other errors.
            if has_duplicates(dst_idx):
                # Which copy lands last is undefined; stock races the same way.
                return "duplicate_destinations"
            raise
        if first.reason is not None:
            return first.reason
        buffers = (
            [(sides.src, sides.dst)]
            if layered is None
            else list(zip(layered.srcs, layered.dsts, strict=True))
        )
        return submissions(first, buffers, layered)

    def _layer_pairs(self, tensors: tuple[int, ...]) -> LayerPairs:
        pairs = self._pairs.get(tensors)
        if pairs is None:
            sides = [self._sides(self._rows[t]) for t in tensors]
            pairs = self._pairs[tensors] = layer_pairs(
                [src for src, _ in sides], [dst for _, dst in sides]
            )
        return pairs

    def _sides(self, rows: PageRows) -> tuple[torch.Tensor, torch.Tensor]:
        return (rows.cpu, rows.gpu) if self._direction is Direction.H2D else (rows.gpu, rows.cpu)

    def clear(self) -> None:
        """Drop what it keeps of the engine's buffers (its rows too)."""
        self._rows.clear()
        self._pairs.clear()
        self._checked_sides.clear()
