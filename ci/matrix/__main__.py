"""``python -m ci.matrix {list,run,render}``: the engine compatibility matrix.

``run`` exits 1 when a selected lane could not run, fails a test that does not also fail
in its release's stock lane, or (drift) finds a changed target.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ci.matrix.lanes import DRIFT, Lane, Matrix, MatrixError, load_matrix
from ci.matrix.render import render_compat, stock_of
from ci.matrix.results import LaneResult, also_failing_on_stock, load_all, save
from ci.matrix.runner import REPO, Workspace, run_lane


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ci.matrix", description=__doc__)
    parser.add_argument("--matrix", type=Path, default=REPO / "ci" / "matrix.toml")
    parser.add_argument("--compat", type=Path, default=REPO / "docs" / "compat.md")
    parser.add_argument("--cache-dir", type=Path, help="overrides the matrix's cache_dir")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print every lane's name")
    run = commands.add_parser("run", help="run lanes, then rewrite docs/compat.md")
    run.add_argument("--lane", action="append", default=[], help="a lane name or glob; repeatable")
    run.add_argument("--all", action="store_true", help="every lane")
    commands.add_parser("render", help="rewrite docs/compat.md from the stored results")
    return parser


def lane_is_red(lane: Lane, result: LaneResult, results: dict[str, LaneResult]) -> bool:
    """Whether ``result`` should fail the run (see the module docstring)."""
    if result.status == "error":
        return True
    if lane.mode == DRIFT:
        return bool(result.changed_targets) or result.unsupported_newest
    unexplained = result.failed_ids() - also_failing_on_stock(result, stock_of(lane, results))
    return bool(unexplained)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        matrix = load_matrix(args.matrix)
        ws = Workspace(args.cache_dir or matrix.cache_dir)
        if args.command == "list":
            print("\n".join(lane.name for lane in matrix.lanes()))
            return 0
        selected = matrix.select(args.lane, args.all) if args.command == "run" else []
    except (MatrixError, OSError) as exc:
        print(f"ci.matrix: {exc}", file=sys.stderr)
        return 2
    for lane in selected:
        print(f"[{lane.name}] running", flush=True)
        result = run_lane(ws, matrix, lane)
        save(result, ws.results)
        print(f"[{lane.name}] {_describe(result)}", flush=True)
    results = load_all(ws.results)
    _write_compat(args.compat, matrix, results)
    red = [lane.name for lane in selected if lane_is_red(lane, results[lane.name], results)]
    if red:
        print(f"ci.matrix: red lanes: {', '.join(red)}", file=sys.stderr)
    return 1 if red else 0


def _describe(result: LaneResult) -> str:
    counts = f"{result.passed} passed, {result.failed} failed, {result.skipped} skipped"
    detail = f" ({result.message})" if result.message else ""
    return f"{result.status}: {counts} in {result.minutes:.1f} min{detail}"


def _write_compat(path: Path, matrix: Matrix, results: dict[str, LaneResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_compat(matrix.lanes(), results), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
