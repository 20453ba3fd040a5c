"""The beside-compute benches' rows (:mod:`benchmarks.sglang.beside`,
:mod:`benchmarks.vllm.beside`): one cell and situation each, with the fields issue 44 names,
kvcore's paths and passes, and paired intervals; the ideal pipeline a dependent forward is
compared with; the line printed per row."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.metric_deltas import paths_taken, served_per_request
from benchmarks.paired_speed import paired_speed

LINK_GBPS = 55.3
"""A pinned 1 GiB host-to-device copy on the lent H200 (docs/performance.md)."""


def ideal_pipeline_ms(layer_bytes: int, layers: int, layer_ms: float) -> float:
    """The hit's forward with every layer's copy at the link: the first layer's copy, then
    per layer the longer of its compute (``layer_ms``) and its copy."""
    copy_ms = layer_bytes / LINK_GBPS / 1e6
    return copy_ms + layers * max(layer_ms, copy_ms)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def alternated(sides: Sequence[Any], request: int) -> Sequence[Any]:
    """The sides in the order request number ``request`` runs them: reversed every other
    request, so that neither always goes first."""
    return sides if request % 2 == 0 else sides[::-1]


@dataclass(frozen=True)
class RowPlace:
    """Where a row's requests ran: the engine, the pool or layout case, the request size."""

    engine: str
    case: str
    tokens: int
    page_size: int
    layers: int
    row_bytes: int | None = None
    """Bytes of one token's row of one layer, where the case has such rows."""


def reload_row(
    place: RowPlace,
    situation: str,
    load: str,
    link_ms: float,
    times: dict[str, list[float]],
    forward_times: dict[str, list[float]],
    forward_alone_ms: float | None,
    identical: bool,
    tally: Tally | None = None,
) -> dict[str, Any]:
    paired = paired_speed([t / 1e3 for t in times["stock"]], [t / 1e3 for t in times["kvcore"]])
    row: dict[str, Any] = {
        "engine": place.engine,
        "case": place.case,
        "situation": situation,
        "compute": load,
        "tokens": place.tokens,
        "page_size": place.page_size,
        "layers": place.layers,
        "row_bytes": place.row_bytes,
        "stock_ms": median(times["stock"]),
        "kvcore_ms": median(times["kvcore"]),
        "link_ms": link_ms,
        "forward_alone_ms": forward_alone_ms,
        "forward_with_stock_ms": median(forward_times["stock"]) if forward_times else None,
        "forward_with_kvcore_ms": median(forward_times["kvcore"]) if forward_times else None,
        "identical": identical,
        "repeats": len(times["stock"]),
        "speed_paired": None if paired is None else [paired.median, paired.low, paired.high],
    }
    if tally is not None:
        row.update(tally.fields())
    if times.get("own"):
        row["own_ms"] = median(times["own"])
        own = paired_speed([t / 1e3 for t in times["stock"]], [t / 1e3 for t in times["own"]])
        row["own_speed_paired"] = None if own is None else [own.median, own.low, own.high]
        if forward_times.get("own"):
            row["forward_with_own_ms"] = median(forward_times["own"])
    return row


@dataclass
class Tally:
    """What kvcore's rule-on side did over a row's timed requests, from its mover's metrics:
    the paths it copied with and, per request, its passes to stock by reason. A row whose
    kvcore column ran stock throughout says so here."""

    metrics: Any
    requests: int = 0
    paths: set[str] = field(default_factory=set)
    passes: dict[str, float] = field(default_factory=dict)

    def timed(self, side: Any, call: Callable[[], Any]) -> Any:
        if getattr(side, "name", None) != "kvcore" or self.metrics is None:
            return call()
        before = self.metrics.snapshot()
        out = call()
        after = self.metrics.snapshot()
        self.requests += 1
        self.paths.update(paths_taken(before, after))
        for reason, count in served_per_request(before, after, 1)[1].items():
            self.passes[reason] = self.passes.get(reason, 0) + count
        return out

    def fields(self) -> dict[str, Any]:
        share = max(self.requests, 1)
        return {
            "kvcore_paths": sorted(self.paths),
            "kvcore_passes": {reason: n / share for reason, n in sorted(self.passes.items())},
        }


def summary_line(row: dict[str, Any]) -> str:
    forward = ""
    if row["forward_alone_ms"] is not None:
        forward = (
            f"  forward alone/ideal {row['forward_alone_ms']:.1f}"
            f" with stock {row['forward_with_stock_ms']:.1f}"
            f" with kvcore {row['forward_with_kvcore_ms']:.1f}"
        )
        if "forward_with_own_ms" in row:
            forward += f" with own {row['forward_with_own_ms']:.1f}"
        launches = row.get("forward_launch_host_ms")
        if launches:
            forward += " launch host " + "/".join(f"{ms:.2f}" for ms in launches.values())
        done = row.get("forward_done_ms")
        if done:
            forward += f" done alone {row['forward_done_alone_ms']:.1f} with " + "/".join(
                f"{ms:.1f}" for ms in done.values()
            )
        if "forward_harness_only_ms" in row:
            forward += f" in a request of no job {row['forward_harness_only_ms']:.1f}"
    own = f" own {row['own_ms']:.1f}" if "own_ms" in row else ""
    plain = f" (plain copy {row['plain_copy_gbps']:.1f} GB/s)" if "plain_copy_gbps" in row else ""
    submits = row.get("submit_host_ms")
    submit = " submit host " + "/".join(f"{ms:.2f}" for ms in submits.values()) if submits else ""
    case = f"{row['case']}/{row['op']}" if "op" in row else row["case"]
    return (
        f"{case} {row['tokens']} {row['situation']} {row['compute']}: link "
        f"{row['link_ms']:.1f} stock {row['stock_ms']:.1f} kvcore {row['kvcore_ms']:.1f}{own}"
        f"{plain}{submit}{forward} identical={row['identical']}"
    )


class SideSamples:
    """Per side, the values of a sample's named fields over a row's timed requests."""

    def __init__(self, sides: Sequence[str], fields: Sequence[str]) -> None:
        self._values: dict[str, dict[str, list[float]]] = {
            name: {side: [] for side in sides} for name in fields
        }

    def add(self, side: str, sample: object) -> None:
        """Each field's value in ``sample`` (an attribute of that name), under ``side``."""
        for name, by_side in self._values.items():
            by_side[side].append(getattr(sample, name))

    def __getitem__(self, name: str) -> dict[str, list[float]]:
        return self._values[name]

    def medians(self, name: str) -> dict[str, float]:
        return side_medians(self._values[name])


def side_medians(by_side: dict[str, list[float]]) -> dict[str, float]:
    """Each side's median."""
    return {side: median(values) for side, values in by_side.items()}
