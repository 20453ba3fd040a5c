"""Markdown tables of an engine-shaped sweep's JSON (``kvcore bench --engine NAME --sweep``).

    python3 scripts/sweep_table.py docs/bench/h200-engine-sweep-2026-12-01.json [--own]

One row per case, one column per request size: kvcore / stock speed for the whole request,
``*`` where kvcore served the calls itself (unmarked cells passed to stock). ``--own`` adds
kvcore's own paths (the rule off), where the run timed them.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def table(rows: list[dict], own: bool) -> str:
    sizes = sorted({row["tokens"] for row in rows})
    cells: dict[str, dict[int, str]] = defaultdict(dict)
    for row in rows:
        served = "*" if row["kvcore_served"] else ""
        text = f"{row['ratio']:.2f}{served}"
        own_ms = row.get("extra", {}).get("own_ms")
        if own and own_ms:
            text += f" ({row['stock_ms'] / own_ms:.2f})"
        if not row["identical"]:
            text += " WRONG BYTES"
        cells[row["case"]][row["tokens"]] = text
    header = "| case | " + " | ".join(str(size) for size in sizes) + " |"
    lines = [header, "|---|" + "---|" * len(sizes)]
    for case in sorted(cells):
        values = " | ".join(cells[case].get(size, "-") for size in sizes)
        lines.append(f"| {case} | {values} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json")
    parser.add_argument("--own", action="store_true", help="add kvcore's own paths' ratio")
    args = parser.parse_args()
    with open(args.json) as fh:
        document = json.load(fh)
    print(table(document["rows"], args.own))


if __name__ == "__main__":
    main()
