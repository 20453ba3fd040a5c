"""`kvcore bench --plot`: one panel per row kind and direction, every kvcore path and stock
baseline of each layout beside that layout's own ceiling (needs matplotlib)."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvcore.bench import report as bench_report

# kvcore's paths in colour, the stock baselines in greys, in the order bars stand in a group.
PATH_COLOURS = {
    "kvcore:single_copy": "tab:blue",
    "kvcore:batched_runs": "tab:green",
    "kvcore:staged": "tab:purple",
    "kvcore:gather": "tab:orange",
    "stock:advanced_indexing": "dimgrey",
    "stock:per_page_copy": "silver",
}
DIRECTIONS = {"h2d": "host to device", "d2h": "device to host"}
# The panel's top, over its tallest ceiling median: taller bars (noise) are cut there and
# labelled with their share of the ceiling; a wide ceiling band runs off the top.
HEADROOM = 1.3
FONT_PT = 10


def _layout_label(scenario: str) -> str:
    key = bench_report.grid_key(scenario)
    assert key is not None
    device = key[3].removeprefix("device-")
    return f"{key[2].removeprefix('host-')}\n{'contig.' if device == 'contiguous' else device}"


def _panel(ax: Any, scenarios: dict[str, list[dict[str, Any]]], title: str) -> None:
    present = {r["path"].removesuffix(" (auto)") for rs in scenarios.values() for r in rs}
    paths = [p for p in PATH_COLOURS if p in present]
    width = 0.8 / max(len(paths), 1)
    top = HEADROOM * max(
        r["gbps"] for rs in scenarios.values() for r in rs if r["kind"] == "ceiling"
    )
    for x, results in enumerate(scenarios.values()):
        ceiling = next(r for r in results if r["kind"] == "ceiling")
        repeats = ceiling.get("repeats_gbps", [ceiling["gbps"]])
        ax.fill_between(
            [x - 0.45, x + 0.45], min(repeats), max(repeats), color="gold", alpha=0.35, lw=0
        )
        ax.hlines(ceiling["gbps"], x - 0.45, x + 0.45, color="black", lw=1.5)
        by_path = {r["path"].removesuffix(" (auto)"): r for r in results}
        for i, path in enumerate(paths):
            r = by_path.get(path)
            if r is None:
                continue
            bar_x = x - 0.4 + (i + 0.5) * width
            auto = r["path"].endswith("(auto)")
            ax.bar(
                bar_x,
                min(r["gbps"], top),
                width,
                color=PATH_COLOURS[path],
                edgecolor="black" if auto else "none",
                linewidth=1.6 if auto else 0,
                hatch="///" if bench_report.is_noise(r) else None,
            )
            if r["gbps"] > top:
                ax.annotate(
                    f"{r['share_of_ceiling']:.1f}x ceil.",
                    (bar_x, top),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=FONT_PT - 1,
                )
    ax.set_ylim(0, top * 1.08)
    ax.set_xticks(range(len(scenarios)), [_layout_label(s) for s in scenarios])
    ax.tick_params(labelsize=FONT_PT - 1)
    ax.set_ylabel("GB/s", fontsize=FONT_PT)
    ax.set_xlabel("host pages moved / device layout", fontsize=FONT_PT - 1)
    ax.set_title(title, fontsize=FONT_PT + 1)
    ax.grid(axis="y", alpha=0.3)


def _legend_handles(report: dict[str, Any]) -> list[Any]:
    present = {r["path"].removesuffix(" (auto)") for r in report["results"]}
    handles: list[Any] = [
        Patch(color=colour, label=path) for path, colour in PATH_COLOURS.items() if path in present
    ]
    handles += [
        Patch(facecolor="white", edgecolor="black", linewidth=1.6, label="planner's pick (auto)"),
        Line2D([], [], color="black", lw=1.5, label="ceiling: contiguous copy, median"),
        Patch(color="gold", alpha=0.35, label="ceiling: min-max of its repeats"),
        Patch(
            facecolor="white",
            edgecolor="black",
            hatch="///",
            label=f"over {bench_report.NOISE_SHARE:.0%} of ceiling: noise",
        ),
    ]
    return handles


def write(report: dict[str, Any], path: str) -> None:
    panels = bench_report.panels(report)
    kinds = list(dict.fromkeys(kind for kind, _ in panels))
    directions = [d for d in DIRECTIONS if any(d == direction for _, direction in panels)]
    fig, axes = plt.subplots(
        len(kinds),
        len(directions),
        figsize=(14, 2.9 * len(kinds) + 1.7),
        squeeze=False,
    )
    for row, kind in enumerate(kinds):
        for col, direction in enumerate(directions):
            ax = axes[row][col]
            if (kind, direction) not in panels:
                ax.set_visible(False)
                continue
            _panel(ax, panels[kind, direction], f"{kind}, {direction}: {DIRECTIONS[direction]}")
    title = f"kvcore bench on {report['device']}: each layout's paths beside its own ceiling"
    if bench_report.noise(report)["noisy"] and bench_report.is_cpu(report):
        title += "\nNOISY: timed on the CPU with wall-clock timers"
    fig.suptitle(title, fontsize=FONT_PT + 2)
    fig.legend(
        handles=_legend_handles(report),
        loc="lower center",
        ncol=5,
        fontsize=FONT_PT - 1,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.09 if len(kinds) < 3 else 0.065, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
