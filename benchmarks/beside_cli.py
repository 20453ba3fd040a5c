"""What both beside-compute benches (:mod:`benchmarks.sglang.beside`,
:mod:`benchmarks.vllm.beside`) do around their runs: the options they share, the JSON
document and its file, and the command's output and exit status."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.beside_rows import LINK_GBPS, summary_line

Progress = Callable[[str], None]


def shared_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options fields both benches take from ``kvcore bench``'s arguments, where given:
    ``kinds`` (--rows), ``tokens`` (--sizes), ``loads`` (--compute), ``repeats``,
    ``forward_span`` and ``partial_json`` (--json: the rows so far are written there as the
    run goes)."""
    fields: dict[str, Any] = {}
    if getattr(args, "rows", None):
        fields["kinds"] = tuple(args.rows.split(","))
    if getattr(args, "sizes", None):
        fields["tokens"] = tuple(int(size) for size in args.sizes.split(","))
    if getattr(args, "compute", None):
        fields["loads"] = tuple(args.compute.split(","))
    if getattr(args, "repeats", 0):
        fields["repeats"] = int(args.repeats)
    if getattr(args, "forward_span", None):
        fields["forward_span"] = float(args.forward_span)
    if getattr(args, "json", None):
        fields["partial_json"] = args.json
    return fields


def document(
    engine: str,
    device: torch.device,
    module: Any,
    rows: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    **settings: Any,
) -> dict[str, Any]:
    """A run's JSON: where it ran (``module`` is the engine's package), its settings (the
    ``KVCORE_*`` variables set among them), its rows and the cases that could not run."""
    return {
        "device": torch.cuda.get_device_name(device),
        "engine": engine,
        "version": getattr(module, "__version__", "unknown"),
        "torch": torch.__version__,
        "link_gbps": LINK_GBPS,
        "kvcore_variables": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("KVCORE_")
        },
        **settings,
        "rows": rows,
        "not_runnable": skipped,
    }


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")


def run_command(
    args: argparse.Namespace, run: Callable[[Progress], dict[str, Any]], script: str
) -> int:
    """``run`` as the command runs it: 2 without CUDA (naming ``script``, which runs it on a GPU
    machine), a line per row, the JSON where asked, 1 where any row moved a wrong byte."""
    if not torch.cuda.is_available():
        print(
            "kvcore bench --beside-compute: needs a CUDA GPU (the forward's graph, the copies' "
            f"streams); run it on a GPU machine, e.g. {script}",
            file=sys.stderr,
        )
        return 2
    quiet = bool(getattr(args, "no_progress", False))
    result = run((lambda line: None) if quiet else _print_err)
    for row in result["rows"]:
        print(summary_line(row))
    if getattr(args, "json", None):
        write_json(args.json, result)
    return 1 if any(not row["identical"] for row in result["rows"]) else 0


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
