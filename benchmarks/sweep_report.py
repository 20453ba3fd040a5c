"""Rows of an engine-shaped sweep (``kvcore bench --engine NAME --sweep``): table, JSON, plot.

A sweep times what an engine does for one request (every call it makes: each layer's
load, the backup, a vLLM job through submit, wait and collect), stock against kvcore in
the same process on the same data, wall-clock from the first call until the copy is
complete. Every engine's sweep reports rows of one shape, :class:`SweepRow`'s fields,
so that one table, one JSON layout and one plot serve both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.paired_speed import PairedSpeed

NEVER_SLOWER = 0.97
"""kvcore / stock speed under which a cell counts as slower than stock."""


@dataclass
class SweepRow:
    """One cell: one request shape, stock and kvcore, same data, same process."""

    engine: str
    case: str
    """Everything but the request size: pool kind, layout, io backend, page size, host
    fragmentation, op; a line of the plot."""
    tokens: int
    layers: int
    nbytes: int
    stock_ms: float
    """Median wall-clock of one request, first call to copy complete, stock."""
    kvcore_ms: float
    stock_host_ms: float
    """Median host time of the request's calls alone (no wait for the copy)."""
    kvcore_host_ms: float
    identical: bool
    """Both sides' results matched the reference byte for byte, untouched rows untouched."""
    calls: int
    """Engine calls in one request."""
    kvcore_served: int
    """Of one kvcore request's calls, how many kvcore moved itself (the rest passed to stock)."""
    pass_reasons: dict[str, float] = field(default_factory=dict)
    """Why calls passed to stock: calls per request, by reason."""
    paths: list[str] = field(default_factory=list)
    ceiling_gbps: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    paired: PairedSpeed | None = None
    """kvcore's speed from the repeats timed in pairs, with its interval (None where a
    sweep has fewer than two)."""

    @property
    def ratio(self) -> float:
        """kvcore's speed over stock's (stock_ms / kvcore_ms): above 1 is faster."""
        return self.stock_ms / self.kvcore_ms if self.kvcore_ms > 0 else math.inf

    @property
    def resolvably_slower(self) -> bool:
        """The per-repeat speeds' interval lies wholly under :data:`NEVER_SLOWER`."""
        return self.paired is not None and self.paired.high < NEVER_SLOWER

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        return out


def report(device: str, rows: Sequence[SweepRow], **meta: Any) -> dict[str, Any]:
    """The JSON document: top-level ``device`` and ``rows``, plus whatever ``meta`` says."""
    return {"device": device, **meta, "rows": [row.as_json() for row in rows]}


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(document, fh, indent=2)
        fh.write("\n")


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6 if ms > 0 else 0.0


def format_table(rows: Iterable[SweepRow]) -> str:
    rows = list(rows)
    width = max([46, *(len(row.case) for row in rows)])
    header = (
        f"{'case':<{width}} {'tokens':>7} {'layers':>6} {'stock ms':>9} {'kvcore ms':>9} "
        f"{'x stock':>7} {'host ms s/k':>13} {'served':>7} {'GB/s s/k':>11} ok"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        host = f"{row.stock_host_ms:.2f}/{row.kvcore_host_ms:.2f}"
        served = f"{row.kvcore_served}/{row.calls}"
        rates = f"{_gbps(row.nbytes, row.stock_ms):.1f}/{_gbps(row.nbytes, row.kvcore_ms):.1f}"
        lines.append(
            f"{row.case:<{width}} {row.tokens:>7} {row.layers:>6} {row.stock_ms:>9.3f} "
            f"{row.kvcore_ms:>9.3f} {row.ratio:>6.2f}x {host:>13} {served:>7} {rates:>11} "
            f"{'yes' if row.identical else 'NO'}"
        )
    return "\n".join(lines)


LEGEND = (
    "x stock: kvcore's speed over stock's for the whole request (stock ms / kvcore ms), "
    f"under {NEVER_SLOWER} counts as slower. host ms: the calls' host time alone. served: "
    "calls kvcore moved itself / all calls (the rest passed to the engine's stock path). "
    "GB/s: request bytes over wall-clock. ok: every byte matched the reference. "
    "Resolvably under: the median of the per-repeat speeds (each repeat times both sides "
    "back to back) has a 95% bootstrap interval wholly under the line."
)


def summary(rows: Sequence[SweepRow]) -> str:
    """One paragraph: the worst and best cells, and how many fall under :data:`NEVER_SLOWER`."""
    if not rows:
        return "no cells ran"
    worst = min(rows, key=lambda r: r.ratio)
    best = max(rows, key=lambda r: r.ratio)
    slower = [r for r in rows if r.ratio < NEVER_SLOWER]
    resolved = [r for r in slower if r.resolvably_slower]
    wrong = [r for r in rows if not r.identical]
    return (
        f"{len(rows)} cells; kvcore / stock speed {worst.ratio:.2f}x (worst: {worst.case}, "
        f"{worst.tokens} tokens) to {best.ratio:.2f}x (best: {best.case}, {best.tokens} tokens); "
        f"{len(slower)} under {NEVER_SLOWER}x, {len(resolved)} of them resolvably (the paired "
        f"repeats' 95% interval wholly under); {len(wrong)} with wrong bytes"
    )


def plot(rows: Sequence[SweepRow], path: str, title: str = "") -> None:
    """kvcore / stock speed against request size, one line per case, one panel per engine
    and op; the 1.0 and :data:`NEVER_SLOWER` lines drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str], dict[str, list[SweepRow]]] = {}
    for row in rows:
        op = str(row.extra.get("op", ""))
        panels.setdefault((row.engine, op), {}).setdefault(row.case, []).append(row)
    count = max(len(panels), 1)
    columns = min(count, 2)
    lines = (count + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(7 * columns, 4.2 * lines), squeeze=False)
    for ax, ((engine, op), cases) in zip(axes.flat, sorted(panels.items()), strict=False):
        for case, cells in sorted(cases.items()):
            cells = sorted(cells, key=lambda r: r.tokens)
            ax.plot([r.tokens for r in cells], [r.ratio for r in cells], marker="o", label=case)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(NEVER_SLOWER, color="red", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (tokens)")
        ax.set_ylabel("kvcore / stock speed (x)")
        ax.set_title(f"{engine} {op}".strip())
        ax.legend(fontsize=6, loc="best")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
