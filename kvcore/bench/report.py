"""What `kvcore bench` prints: a summary per row kind and direction, the full table on
request, a word on timing noise and a legend of every column and label shown.

Everything here reads a report dict (``kvcore bench --json``), so older reports, which
lack the ceiling's repeats, are summarised too (their spread is over scenarios).
"""

from __future__ import annotations

import statistics
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NOISE_SHARE = 1.05
"""A path cannot beat a plain contiguous copy of the same bytes by more than timing noise:
over this share of its ceiling, a row is noise, not a win."""

NOISE_MARK = "~"
LEGEND_WIDTH = 100


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        ordered = sorted(values)
        return cls(ordered[0], statistics.median(ordered), ordered[-1])

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


def is_noise(result: dict[str, Any]) -> bool:
    """A measured path over ``NOISE_SHARE`` of its scenario's ceiling. Both directions at
    once (``h2d+d2h``) are left out: a full-duplex link carries up to twice one way's
    ceiling."""
    if result["kind"] == "ceiling" or is_both_directions(result):
        return False
    return bool(result.get("share_of_ceiling", 0.0) > NOISE_SHARE)


def is_both_directions(result: dict[str, Any]) -> bool:
    parts = str(result["scenario"]).split("/")
    return len(parts) > 1 and "+" in parts[1]


def is_cpu(report: dict[str, Any]) -> bool:
    return str(report["device"]) == "cpu"


def grid_key(scenario: str) -> tuple[str, str, str, str] | None:
    """(row kind, direction, host layout, device layout) of a grid scenario such as
    ``mha-4KiB/h2d/host-50%/device-scattered``; None for the other jobs."""
    parts = scenario.split("/")
    if len(parts) == 4 and parts[2].startswith("host-") and parts[3].startswith("device-"):
        return parts[0], parts[1], parts[2], parts[3]
    return None


def panels(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, list[dict[str, Any]]]]:
    """The grid's results by (row kind, direction), then by scenario, in run order."""
    out: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for result in report["results"]:
        key = grid_key(result["scenario"])
        if key is not None:
            out.setdefault(key[:2], {}).setdefault(result["scenario"], []).append(result)
    return out


def auto_path(result: dict[str, Any]) -> str:
    return str(result["path"]).removeprefix("kvcore:").removesuffix(" (auto)")


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per row kind and direction: the planner's paths, the ceiling's spread,
    and kvcore's auto path against the ceiling and against the best stock baseline."""
    summary = []
    for (row_kind, direction), scenarios in panels(report).items():
        paths: Counter[str] = Counter()
        ceiling_gbps: list[float] = []
        auto_gbps, shares, over_stock = [], [], []
        noise_rows = 0
        identical = True
        for results in scenarios.values():
            noise_rows += sum(is_noise(r) for r in results)
            identical = identical and all(r["identical"] for r in results)
            for r in results:
                if r["kind"] == "ceiling":
                    ceiling_gbps += r.get("repeats_gbps", [r["gbps"]])
            auto = [r for r in results if r["path"].endswith("(auto)")]
            if not auto:
                continue
            paths[auto_path(auto[0])] += 1
            auto_gbps.append(auto[0]["gbps"])
            shares.append(auto[0]["share_of_ceiling"])
            stock = [r["gbps"] for r in results if r["kind"] == "stock"]
            if stock and max(stock) > 0:
                over_stock.append(auto[0]["gbps"] / max(stock))
        if not auto_gbps:
            continue
        summary.append(
            {
                "row_kind": row_kind,
                "direction": direction,
                "scenarios": len(scenarios),
                "auto_paths": dict(paths.most_common()),
                "ceiling_gbps": Spread.of(ceiling_gbps).as_dict(),
                "kvcore_gbps": Spread.of(auto_gbps).as_dict(),
                "kvcore_share_of_ceiling": Spread.of(shares).as_dict(),
                "kvcore_over_best_stock": Spread.of(over_stock).as_dict() if over_stock else None,
                "noise_rows": noise_rows,
                "identical": identical,
            }
        )
    return summary


def noise(report: dict[str, Any]) -> dict[str, Any]:
    """Whether the figures are noisy, and why."""
    over = sum(is_noise(r) for r in report["results"])
    reasons = []
    if is_cpu(report):
        reasons.append(
            "timed on the CPU with wall-clock timers, on cores shared with everything else"
        )
    if over:
        reasons.append(f"{over} row{'s' if over > 1 else ''} over {NOISE_SHARE:.0%} of the ceiling")
    return {"noisy": bool(reasons), "reasons": reasons, "rows_over_ceiling": over}


def _pct(share: float, noise: bool | None = None) -> str:
    """``share`` in percent, marked where it is noise (by default: over ``NOISE_SHARE``)."""
    marked = share > NOISE_SHARE if noise is None else noise
    return f"{100 * share:.0f}%" + (NOISE_MARK if marked else "")


def _share_cell(spread: dict[str, float]) -> str:
    return f"{_pct(spread['median'])} ({_pct(spread['min'])}-{_pct(spread['max'])})"


def _ratio_cell(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:.1f}x ({spread['min']:.1f}-{spread['max']:.1f}x)"


def _columns(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows padded to the widest cell of each column."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in [header, *rows]
    ]


def format_summary(report: dict[str, Any]) -> list[str]:
    summary = summarize(report)
    if not summary:
        return []
    rows = []
    for s in summary:
        ceiling = s["ceiling_gbps"]
        rows.append(
            [
                s["row_kind"],
                s["direction"],
                ", ".join(f"{path} x{n}" for path, n in s["auto_paths"].items()),
                f"{ceiling['min']:.1f} / {ceiling['median']:.1f} / {ceiling['max']:.1f}",
                _share_cell(s["kvcore_share_of_ceiling"]),
                _ratio_cell(s["kvcore_over_best_stock"]),
                str(s["noise_rows"]) if s["noise_rows"] else "",
                "yes" if s["identical"] else "NO",
            ]
        )
    header = [
        "rows",
        "dir",
        "planner's path x layouts",
        "ceiling GB/s min / med / max",
        "kvcore / ceiling",
        "kvcore / best stock",
        "noise",
        "ok",
    ]
    layouts = max(s["scenarios"] for s in summary)
    return [
        f"summary: the planner's path (auto) over {layouts} host and device layouts per row "
        "kind and direction; median (min-max) over those layouts",
        *_columns(header, rows, right={4, 5, 6}),
    ]


def format_other_jobs(report: dict[str, Any]) -> list[str]:
    """The jobs outside the grid: 32 layers at once, both directions at once, a fallback."""
    lines = []
    layered: dict[str, dict[str, dict[str, Any]]] = {}
    for r in report["results"]:
        scenario, path = r["scenario"], r["path"]
        if "-layers-" in scenario:
            direction = scenario.split("/")[1]
            how = "one" if path.endswith("in one submission") else "each"
            layered.setdefault(direction, {})[how] = r
        elif is_both_directions(r):
            lines.append(
                f"  both directions at once ({scenario.split('/')[0]}, one run each way): "
                f"{r['gbps']:.1f} GB/s in all, {r['share_of_ceiling']:.2f}x one way's median "
                "ceiling (a full-duplex link gives up to 2x)"
                + ("" if r["identical"] else ", bytes NOT identical")
            )
        elif grid_key(scenario) is None and path == "kvcore:fallback":
            lines.append(
                f"  {scenario}: handed to the stock path, "
                + ("bytes identical" if r["identical"] else "bytes NOT identical")
            )
    for direction, ways in layered.items():
        if {"one", "each"} <= set(ways):
            one, each = ways["one"], ways["each"]
            lines.append(
                f"  {one['scenario'].split('/')[2].split('-host')[0].replace('-', ' ')} at once, "
                f"{direction} "
                f"({one['path'].split(' ')[0].removeprefix('kvcore:')}): one submission "
                f"{one['gbps']:.1f} GB/s ({_pct(one['share_of_ceiling'])}), one per layer "
                f"{each['gbps']:.1f} GB/s ({_pct(each['share_of_ceiling'])})"
            )
    return ["other jobs:", *lines] if lines else []


def format_full_table(report: dict[str, Any]) -> list[str]:
    header = ["scenario", "path", "MiB", "GB/s", "ceil%", "submit us", "queued us", "ok"]
    rows = []
    for r in report["results"]:
        queued = r.get("submit_queued_us")
        share = r["share_of_ceiling"]
        rows.append(
            [
                r["scenario"],
                r["path"],
                f"{r['bytes'] / 2**20:.1f}",
                f"{r['gbps']:.2f}",
                _pct(share, is_noise(r)) if share else "-",
                f"{r['submit_us']:.1f}" if r["kind"] != "ceiling" else "",
                "" if queued is None else f"{queued:.1f}",
                "yes" if r["identical"] else "NO",
            ]
        )
    return ["every path of every scenario:", *_columns(header, rows, right={2, 3, 4, 5, 6})]


def format_noise(report: dict[str, Any]) -> list[str]:
    flagged = noise(report)
    if not flagged["noisy"]:
        return []
    lines = [f"NOISY: {'; '.join(flagged['reasons'])}."]
    if is_cpu(report):
        lines.append(
            "  CPU figures only show the paths are correct and roughly ordered; the link's "
            "figures come from a GPU run."
        )
    lines.append(
        f"  A row over {NOISE_SHARE:.0%} of its ceiling is marked {NOISE_MARK}: noise, not a win; "
        "see the ceiling's min / med / max."
    )
    return lines


_PATHS = {
    "single_copy": "one copy (one run on both sides)",
    "batched_runs": "one copy per run, in one batch",
    "staged": "one copy into a device staging buffer, then a scatter on the device "
    "(page-out: the reverse)",
    "gather": "a kernel that reads or writes the scattered host rows directly",
    "fallback": "handed to the engine's stock path (kvcore cannot prove it correct)",
}


def format_legend(report: dict[str, Any], full: bool) -> list[str]:
    """Every column and label that the printed summary (and full table) use."""
    kinds = sorted({r["scenario"].split("/")[0] for r in report["results"]})
    entries = [
        (
            "rows",
            f"the row kind, one token's KV bytes: {', '.join(kinds)} (MLA: one latent "
            "row; MHA: K and V of 8 heads)",
        ),
        ("dir", "h2d: host to device (a reload); d2h: device to host (a page-out)"),
        (
            "ceiling",
            "a plain contiguous copy of the same bytes between the same buffers, "
            "timed in the same run: the most the link gives",
        ),
        (
            "min / med / max",
            "the ceiling's spread over its repeats, in every layout of that row kind and direction",
        ),
        (
            "planner's path",
            "the path kvcore's planner picks (auto); "
            + "; ".join(f"{name}: {what}" for name, what in _PATHS.items() if name != "fallback"),
        ),
        ("kvcore / ceiling", "the planner's path's GB/s as a share of the ceiling"),
        (
            "kvcore / best stock",
            "its GB/s over the faster stock baseline: "
            "stock:advanced_indexing (dst[idx] = src[idx] in torch) or stock:per_page_copy "
            "(one copy per 64-token page, only where every page is one run)",
        ),
        (
            "noise",
            f"rows (any path) over {NOISE_SHARE:.0%} of their ceiling; "
            f"{NOISE_MARK} marks such a share",
        ),
        ("ok", "every result byte-identical to a per-index reference"),
    ]
    if full:
        entries += [
            (
                "scenario",
                "ROWS/DIR/HOST/DEVICE: host-0%, -50%, -100%: that share of the "
                "64-token pages moved away from one contiguous run in host memory; host-tokens: "
                "every token on its own; device-contiguous: one run on the GPU; "
                "device-scattered: every page moved",
            ),
            (
                "path",
                "ceiling:contiguous_copy: the ceiling; kvcore:NAME: a kvcore path, "
                "(auto) where the planner picked it, forced otherwise (fallback: "
                f"{_PATHS['fallback']}); stock:NAME: a stock baseline; xN: N transfers at "
                "once (h2d+d2h: both directions together, up to twice one way's ceiling)",
            ),
            ("MiB, GB/s", "bytes moved; bytes over the median time"),
            ("ceil%", "GB/s as a share of the same scenario's ceiling"),
            ("submit us", "median host time to issue one transfer, its plan made"),
            (
                "queued us",
                "the same, issued back to back as an engine issues layer after "
                "layer (the planner's path only)",
            ),
        ]
    else:
        entries.append(("--full", "prints every path of every scenario"))
    entries.append(
        (
            "one-run share",
            "allocator churn: the share of successful allocations that got one contiguous run "
            "of slots (kvcore's allocator against the engines' stock free list, same trace)",
        )
    )
    width = max(len(label) for label, _ in entries)
    lines = ["legend:"]
    for label, text in entries:
        lines += textwrap.wrap(
            text,
            LEGEND_WIDTH,
            initial_indent=f"  {label:<{width}}  ",
            subsequent_indent=" " * (width + 4),
            break_on_hyphens=False,
        )
    return lines
