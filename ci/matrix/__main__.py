"""``python -m ci.matrix {list,run,render,gpu-record}``: the engine compatibility matrix.

``gpu-record FOLDER`` stores a GPU lane's run (``scripts/vllm_upstream_gpu.sh run``'s
``$OUT``, fetched from the GPU machine) in ``ci/gpu_lanes/`` and rewrites only the GPU
section of docs/compat.md.
``run`` exits 1 when a selected lane could not run, fails a test that does not also fail
in its release's stock lane, or (drift) finds a changed target.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

from ci.matrix.gpu_lanes import (
    GpuLaneError,
    GpuLaneRun,
    load_runs,
    read_run,
    record_path,
    splice_gpu_lanes,
)
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
    gpu = commands.add_parser(
        "gpu-record", help="store a GPU lane's run, then rewrite docs/compat.md"
    )
    gpu.add_argument("folder", type=Path, help="scripts/vllm_upstream_gpu.sh run's $OUT")
    gpu.add_argument("--date", default=datetime.date.today().isoformat(), help="YYYY-MM-DD")
    gpu.add_argument(
        "--produced-by",
        default="scripts/vllm_upstream_gpu.sh run",
        help="the command that produced the folder",
    )
    parser.add_argument("--gpu-lanes", type=Path, default=REPO / "ci" / "gpu_lanes")
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
        if args.command == "gpu-record":
            run = read_run(args.folder, args.date, args.produced_by)
            args.gpu_lanes.mkdir(parents=True, exist_ok=True)
            stored = record_path(args.gpu_lanes, run)
            stored.write_text(run.to_json(), encoding="utf-8")
            compat = args.compat.read_text(encoding="utf-8")
            runs = load_runs(args.gpu_lanes)
            args.compat.write_text(splice_gpu_lanes(compat, runs), encoding="utf-8")
            print(f"ci.matrix: stored {stored}; {args.compat} shows {len(runs)} GPU run(s)")
            return 0
        gpu_runs = load_runs(args.gpu_lanes)
    except (MatrixError, GpuLaneError, OSError) as exc:
        print(f"ci.matrix: {exc}", file=sys.stderr)
        return 2
    for lane in selected:
        print(f"[{lane.name}] running", flush=True)
        result = run_lane(ws, matrix, lane)
        save(result, ws.results)
        print(f"[{lane.name}] {_describe(result)}", flush=True)
    results = load_all(ws.results)
    _write_compat(args.compat, matrix, results, gpu_runs)
    red = [lane.name for lane in selected if lane_is_red(lane, results[lane.name], results)]
    if red:
        print(f"ci.matrix: red lanes: {', '.join(red)}", file=sys.stderr)
    return 1 if red else 0


def _describe(result: LaneResult) -> str:
    counts = f"{result.passed} passed, {result.failed} failed, {result.skipped} skipped"
    detail = f" ({result.message})" if result.message else ""
    return f"{result.status}: {counts} in {result.minutes:.1f} min{detail}"


def _write_compat(
    path: Path, matrix: Matrix, results: dict[str, LaneResult], gpu_runs: list[GpuLaneRun]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_compat(matrix.lanes(), results, gpu_runs), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
