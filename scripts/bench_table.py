"""Print the markdown table of docs/lab/benchmarks.md from a ``kvcore bench --json`` report.

One row per scenario: the same run's ceiling, the planner's path, its share of the ceiling,
host submit and plan time, and the best naive stock baseline beside it.

    python scripts/bench_table.py docs/bench/h200-full-2026-11-29.json [--rows mla-1152B]
    python scripts/bench_table.py report.json --layers      # the 32-layer jobs
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def table(report: dict, row_kind: str | None) -> str:
    by_scenario: dict[str, list[dict]] = defaultdict(list)
    for result in report["results"]:
        if row_kind is None or result["scenario"].startswith(f"{row_kind}/"):
            by_scenario[result["scenario"]].append(result)
    lines = [
        "| scenario | ceiling | kvcore path (auto) | GB/s | of ceiling | submit µs (lone / queued)"
        " | plan µs (first / again) | best stock baseline | GB/s | kvcore / stock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, results in by_scenario.items():
        auto = [r for r in results if r["path"].endswith("(auto)")]
        ceiling = [r for r in results if r["kind"] == "ceiling"]
        stock = [r for r in results if r["kind"] == "stock"]
        if not (auto and ceiling and stock):
            continue
        best = max(stock, key=lambda r: r["gbps"])
        path = auto[0]["path"].removeprefix("kvcore:").removesuffix(" (auto)")
        lines.append(
            f"| {scenario} | {ceiling[0]['gbps']:.1f} | {path} | {auto[0]['gbps']:.1f}"
            f" | {auto[0]['share_of_ceiling']:.0%} | {_submit_cell(auto[0])}"
            f" | {_plan_cell(auto[0])}"
            f" | {best['path'].removeprefix('stock:')} | {best['gbps']:.1f}"
            f" | {auto[0]['gbps'] / best['gbps']:.1f}x |"
        )
    return "\n".join(lines)


def _submit_cell(auto: dict) -> str:
    """A lone transfer's host µs, and the same queued behind others where the report has it
    (since 2026-12-01)."""
    lone = f"{auto['submit_us']:.0f}"
    queued = auto.get("submit_queued_us")
    return lone if queued is None else f"{lone} / {queued:.0f}"


def _plan_cell(auto: dict) -> str:
    """The first plan's µs, and the same plan's again where the report has it (since
    2026-12-01)."""
    first = f"{auto.get('plan_us', float('nan')):.0f}"
    again = auto.get("plan_warm_us")
    return first if again is None else f"{first} / {again:.0f}"


def layers_table(report: dict) -> str:
    """The 32-layer jobs: every layer in one submission against one submission per layer."""
    lines = [
        "| scenario | how | GB/s | of ceiling | submit µs | identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "-layers-" in r["scenario"]:
            lines.append(
                f"| {r['scenario']} | {r['path'].removeprefix('kvcore:')} | {r['gbps']:.1f}"
                f" | {r['share_of_ceiling']:.0%} | {r['submit_us']:.0f}"
                f" | {'yes' if r['identical'] else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--rows", help="only this row kind, e.g. mla-1152B")
    parser.add_argument("--layers", action="store_true", help="the 32-layer jobs instead")
    args = parser.parse_args()
    with open(args.report) as fh:
        report = json.load(fh)
    print(layers_table(report) if args.layers else table(report, args.rows))


if __name__ == "__main__":
    main()
