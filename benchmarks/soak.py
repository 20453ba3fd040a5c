"""Minutes of engine-shaped traffic through an adapter's hooks, every reload checked, then an
exact accounting of what kvcore and the engine keep.

    python -m benchmarks.soak --engine sglang|vllm --seconds N --seed S --json OUT.json
        [--device cpu|cuda] [--profile full|sanitize|cpu]
    python -m benchmarks.soak --combine A.json B.json ... --json SUMMARY.json

``--engine sglang``: :mod:`benchmarks.sglang.soak` (SGLang's host pools, kvcore's
host-slot allocator and transfer hooks, loads and backups on their own streams from two
threads, a forward consumer waiting per layer). ``--engine vllm``:
:mod:`benchmarks.vllm.soak` (kvcore's offload handlers with store and load jobs in flight
at once, chunks from kvcore's offloading manager). Both end by comparing what the run left
(host slots, pinned bytes, staging leases, events, index caches, device memory) with a
baseline taken before the traffic (:mod:`benchmarks.soak_report`).

The JSON holds the duration, calls, bytes, the reloads checked, mismatched bytes, each
accounting item and the errors; the exit status is 0 only when no byte differed, no item
leaked and nothing failed. ``--combine`` merges the documents of several runs (the GPU
script's parts) into one summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.soak_report import document, summary_line, write_json
from kvcore.bench.measure import device_named

ENGINES = ("sglang", "vllm")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _engine(name: str) -> Any:
    """The engine's soak module, imported only when asked for (each imports its engine)."""
    if name == "sglang":
        from benchmarks.sglang import soak as sglang_soak

        return sglang_soak
    from benchmarks.vllm import soak as vllm_soak

    return vllm_soak


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's soak as ``args`` asks; its JSON document."""
    device = device_named(args.device)
    if isinstance(device, str):
        raise SystemExit(f"kvcore soak: {device}")
    profile_name = args.profile or ("full" if device.type == "cuda" else "cpu")
    progress = (lambda line: None) if args.quiet else _progress
    started = time.perf_counter()
    engine = _engine(args.engine)
    opts = engine.Options(
        seconds=args.seconds,
        seed=args.seed,
        device=device,
        profile=engine.PROFILES[profile_name],
        progress=progress,
        only=tuple(args.pools.split(",")) if args.pools else (),
        deadline=None if args.budget is None else started + args.budget,
    )
    result = engine.run(opts)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return document(
        engine=args.engine,
        device=name,
        seconds_requested=args.seconds,
        seconds=result["seconds"],
        tally=result["tally"],
        accounting=result["accounting"],
        errors=result["errors"],
        extra={
            "seed": args.seed,
            "profile": profile_name,
            "wall_seconds": round(time.perf_counter() - started, 3),
            **result["extra"],
        },
    )


def combine(paths: Sequence[str]) -> dict[str, Any]:
    """One summary of several soak documents (a missing or unreadable one is an error)."""
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    for path in paths:
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        runs += doc.get("runs", [doc])
    keys = ("seconds", "mismatches", "leaks")
    totals = {key: sum(r.get(key, 0) for r in runs) for key in keys}
    return {
        "runs": [
            {
                "engine": r.get("engine"),
                "device": r.get("device"),
                "profile": r.get("profile"),
                "sanitizer": r.get("sanitizer"),
                "sanitizer_errors": r.get("sanitizer_errors"),
                "seconds": r.get("seconds"),
                "calls": r.get("calls"),
                "bytes": r.get("bytes"),
                "reloads_checked": r.get("reloads_checked"),
                "mismatched_bytes": r.get("mismatched_bytes"),
                "stray_bytes": r.get("stray_bytes"),
                "mismatches": r.get("mismatches"),
                "leaks": r.get("leaks"),
                "not_checked": sorted(r.get("accounting", {}).get("not_checked", {})),
                "errors": r.get("errors", []),
                "ok": r.get("ok"),
            }
            for r in runs
        ],
        **totals,
        "errors": errors,
        "ok": bool(runs) and not errors and all(r.get("ok") for r in runs),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--seconds", type=float, default=60.0, help="traffic time (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the JSON document here")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--profile",
        choices=("full", "sanitize", "cpu"),
        help="pool and request sizes (default: full on CUDA, cpu on a CPU)",
    )
    p.add_argument(
        "--pools",
        metavar="NAMES",
        help="run only these pools (sglang: mha/layer_first/p64,...) or layouts (vllm: "
        "per-layer/32L/mha-32KiB,...), comma-separated; the seconds are shared among them",
    )
    p.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help="wall seconds the whole run may take; phases are cut short to fit (the JSON "
        "says how much traffic ran)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--sanitizer", help="the compute-sanitizer tool this run is under, recorded in the JSON"
    )
    p.add_argument("--combine", nargs="+", metavar="JSON", help="summarise these documents")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.combine:
        summary = combine(args.combine)
        if args.json:
            write_json(args.json, summary)
        print(json.dumps(summary, indent=2))
        return 0 if summary["ok"] else 1
    if args.engine is None:
        parser().error("--engine is required (or --combine)")
    doc = run(args)
    if args.sanitizer:
        doc["sanitizer"] = args.sanitizer
    if args.json:
        write_json(args.json, doc)
    print(summary_line(doc))
    for error in doc["errors"]:
        print(f"error: {error}", file=sys.stderr)
    for item in doc["accounting"]["items"]:
        if not item["ok"]:
            print(
                f"leak: {item['name']}: baseline {item['baseline']}, end {item['end']}",
                file=sys.stderr,
            )
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
