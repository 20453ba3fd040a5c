"""A host index found to be one ascending run before it is planned, so that the plan
takes the run rather than reading the index again."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvcore.runs import Runs, check_index, span_and_one_run, version_of


@dataclass(frozen=True, eq=False)
class HostRunFound:
    """A host index that is one ascending run, found so before planning (an engine's
    serve-or-pass rule counts its runs on a request's first call): its span and its run,
    which :func:`plan_device_indexed_for` takes rather than reading the index again. They
    hold for ``index`` itself while its version counter is unchanged."""

    index: torch.Tensor
    version: int | None
    span: int
    runs: Runs

    def holds_for(self, index: torch.Tensor) -> bool:
        return (
            self.version is not None and self.index is index and version_of(index) == self.version
        )


def one_host_run(index: torch.Tensor) -> HostRunFound:
    """:class:`HostRunFound` of a CPU host index of two or more entries that its run count
    says is one run, bounded by nothing yet (the plan checks its buffer's rows). Raises
    ValueError where its ends are not a run apart, and as :func:`plan_device_indexed`
    would for an index it refuses: not a 1-D integer CPU tensor, or a negative start."""
    values = check_index(index, "the host index").numpy()
    # Ends a run apart are all a run needs of its ends; the count said the rest.
    if values.size < 2 or int(values[-1]) - int(values[0]) != values.size - 1:
        raise ValueError("the host index is not one run of two or more entries")
    span, runs = span_and_one_run(values, sys.maxsize, "the host index")
    return HostRunFound(index, version_of(index), span, runs)
