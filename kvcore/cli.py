"""The ``kvcore`` command: ``doctor``, ``bench``, ``launch`` and ``patches``.

Only the standard library and kvcore's configuration are imported up front, so
``kvcore launch`` starts the engine without first paying for torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvcore import __version__, launch
from kvcore.config import SETTINGS, KVCoreConfig
from kvcore.config_values import ConfigError, format_size
from kvcore.engine_status import EngineStatus
from kvcore.patching import cli as patching_cli
from kvcore.patching.status import installed_patch_states
from kvcore.planning import serve_rule

ADAPTERS: tuple[str, ...] = ("kvcore_sglang", "kvcore_vllm")


# What a shell reports for a writer killed by SIGPIPE (128 + 13): `set -o pipefail` sees
# the output cut short, as it would for any other command whose reader went away.
BROKEN_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvcore`` command; returns the exit status (2 for a usage or config error,
    141 where the reader of stdout went away: ``kvcore doctor | head -3``)."""
    try:
        status = _run(argv)
        # Buffered output still unwritten would break the pipe at exit, past any handler.
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's own flush at exit would fail on the same pipe: point stdout elsewhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    return status


def _run(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_bench_options=_command_of(args_list) == "bench")
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command != "launch":
            # launch reads the variables with its --kvcore-* flags over them, and reports
            # the bad ones of both at once.
            KVCoreConfig.from_env().configure_logging()
        return int(args.handler(args))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kvcore {args.command}: {problem}", file=sys.stderr)
        return 2


def _command_of(argv: list[str]) -> str | None:
    # The top level has only -h and --version, so the first word is the command.
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(*, with_bench_options: bool = False) -> argparse.ArgumentParser:
    """The argument parser; bench's options are added only when asked, since they import torch."""
    parser = argparse.ArgumentParser(
        prog="kvcore", description="Line-rate KV-cache offloading for SGLang and vLLM."
    )
    parser.add_argument("--version", action="version", version=f"kvcore {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor", help="report versions, CUDA, engines and pinned-memory limits"
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--verbose", action="store_true", help="list every engine target, not only its group"
    )
    doctor.add_argument(
        "--pool-gib",
        type=_positive_gib,
        metavar="GIB",
        help="also measure how long a host pool of GIB GiB takes to pin on this machine",
    )
    doctor.set_defaults(handler=run_doctor)

    bench = commands.add_parser("bench", help="measure every transfer path against the link")
    if with_bench_options:
        from kvcore.bench import cli as bench_cli

        bench_cli.add_arguments(bench)
    bench.set_defaults(handler=run_bench)

    launch.add_parser(commands)
    patching_cli.add_parser(commands)
    return parser


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of GiB: {text!r}")
    return value


def run_bench(args: argparse.Namespace) -> int:
    from kvcore.bench import cli as bench_cli

    return bench_cli.run(args)


def run_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(KVCoreConfig.from_env(), pool_gib=args.pool_gib)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_doctor(report, verbose=args.verbose))
    return 0


def doctor_report(config: KVCoreConfig, pool_gib: float | None = None) -> dict[str, Any]:
    """Everything ``kvcore doctor`` knows, JSON-ready.

    Each engine's entry has the adapter's version guard run against the installed
    engine's source files (no engine module is imported): ``would_patch`` lists what its
    hooks would patch under ``config``, ``skipped_targets`` what they would not and why;
    ``patched_targets`` is what the plugin patched in this process, empty outside an
    engine (``plugin_applied`` says which). ``host`` is the machine's side of pinning the
    engines' host pools (:mod:`kvcore.host_report`); with ``pool_gib``, how long a pool of
    that size takes to pin here, measured.
    """
    # Imported here: it imports torch, which the other commands do without.
    from kvcore import host_report

    torch_report, cuda_report = _torch_and_cuda()
    return {
        "kvcore": {
            "version": __version__,
            "location": os.path.dirname(os.path.abspath(__file__)),
            "python": sys.version.split()[0],
        },
        "torch": torch_report,
        "cuda": cuda_report,
        "engines": [
            importlib.import_module(adapter).status(config).to_dict() for adapter in ADAPTERS
        ],
        "patches": installed_patch_states(),
        "pinned": _pinned_limits(),
        "host": host_report.host_report(pool_gib, config.host_pool_pin_first),
        "config": config.to_dict(),
        "serve_rule": {"enabled": config.serve_rule, "rules": serve_rule.describe()},
    }


def _torch_and_cuda() -> tuple[dict[str, Any], dict[str, Any]]:
    cuda: dict[str, Any] = {"available": False, "version": None, "device_count": 0, "devices": []}
    try:
        import torch
    except ImportError as exc:
        return {"version": None, "error": str(exc)}, cuda
    cuda["version"] = torch.version.cuda
    try:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            cuda.update(
                available=True,
                device_count=count,
                devices=[torch.cuda.get_device_name(i) for i in range(count)],
            )
    except RuntimeError as exc:
        # A broken driver is exactly what doctor is run to find out about.
        cuda["error"] = str(exc)
    return {"version": torch.__version__}, cuda


def _pinned_limits() -> dict[str, Any]:
    """RLIMIT_MEMLOCK (bytes or "unlimited") and whether we are root, which lifts it."""
    limits: dict[str, Any] = {"memlock_soft": None, "memlock_hard": None}
    try:
        import resource
    except ImportError:  # not a Unix
        return {**limits, "root": False}
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def bytes_or_unlimited(value: int) -> int | str:
        return "unlimited" if value == resource.RLIM_INFINITY else value

    return {
        "memlock_soft": bytes_or_unlimited(soft),
        "memlock_hard": bytes_or_unlimited(hard),
        "root": os.geteuid() == 0,
    }


def format_doctor(report: dict[str, Any], *, verbose: bool = False) -> str:
    """The report as a short aligned table for people: each engine's line is followed by
    one indented line per target group (``verbose``: and one per target)."""
    kv, torch_report, cuda, pinned = (
        report["kvcore"],
        report["torch"],
        report["cuda"],
        report["pinned"],
    )
    rows = [
        ("kvcore", f"{kv['version']} ({kv['location']}), Python {kv['python']}"),
        ("torch", torch_report["version"] or f"not importable: {torch_report.get('error')}"),
        ("CUDA", _describe_cuda(cuda)),
    ]
    rows += [(status["engine"], _describe_engine(status, verbose)) for status in report["engines"]]
    patches = [f"{engine} {state}" for engine, state in report["patches"].items() if state]
    rows.append(("patches", "; ".join(patches) or "no engine installed"))
    rows.append(("memlock", _describe_memlock(pinned)))
    rows.append(("host", _describe_host(report["host"])))
    estimate = report["host"]["pin_estimate"]
    if estimate is not None:
        text = _describe_estimate(estimate)
        available = report["host"]["available_bytes"]
        if available is not None and estimate["pool_bytes"] > available:
            text += f"; more than the {_gib(available)} available"
        rows.append((f"pin {_gib(estimate['pool_bytes'])}", text))
    rows.append(("config", _describe_config(report["config"])))
    width = max(len(label) for label, _ in rows)
    # An engine's group lines sit under its text, two columns further in.
    lines = [
        f"{label:<{width}}  {text}".replace("\n", "\n" + " " * (width + 4)) for label, text in rows
    ]
    return "\n".join([*lines, "", *_describe_serve_rule(report["serve_rule"])])


def _describe_serve_rule(rule: dict[str, Any]) -> list[str]:
    """The table the serve-or-pass rule decides each call from (first match wins)."""
    state = "on" if rule["enabled"] else "off (KVCORE_SERVE_RULE=0: kvcore serves what it can)"
    lines = [f"serve-or-pass rule: {state}; first matching row decides"]
    columns = ("engine", "pool", "op", "io_backend", "layout", "page_sizes", "serves", "reason")
    table = [columns, *[tuple(str(row[c]) for c in columns) for row in rule["rules"]]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        cells = "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True))
        lines.append(f"  {cells}".rstrip())
    return lines


def _describe_cuda(cuda: dict[str, Any]) -> str:
    if "error" in cuda:
        return f"error: {cuda['error']}"
    if not cuda["available"]:
        built = f"torch built for CUDA {cuda['version']}" if cuda["version"] else "CPU-only torch"
        return f"not available ({built})"
    names = ", ".join(sorted(set(cuda["devices"])))
    return f"CUDA {cuda['version']}, {cuda['device_count']} device(s): {names}"


def _setting_text(value: bool | float) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _describe_engine(status: dict[str, Any], verbose: bool) -> str:
    """The summary line, then a line per target group and, ``verbose``, per target."""
    line = EngineStatus(**status).summary()
    if status["settings"]:
        line += "; " + ", ".join(
            f"{name.replace('_', ' ')} {_setting_text(value)}"
            for name, value in status["settings"].items()
        )
    skipped_by_group: dict[str, list[dict[str, str]]] = {}
    for entry in status["skipped_targets"]:
        skipped_by_group.setdefault(entry.get("group", "other"), []).append(entry)
    lines = [line]
    for group, targets in status["target_groups"].items():
        skipped = skipped_by_group.pop(group, [])
        lines.append(_describe_group(status, group, targets, skipped))
        if verbose and group not in status["groups_off"]:
            reasons = {entry["target"]: entry["reason"] for entry in skipped}
            lines += [f"  {_target_state(status, target, reasons)}" for target in targets]
            # vLLM's guard also reads functions it does not patch; a changed one is named.
            lines += [
                f"  not patched {target}: {reason}"
                for target, reason in reasons.items()
                if target not in targets
            ]
    for group, entries in skipped_by_group.items():
        lines.append(f"{group} ({len(entries)}): {_distinct_reasons(entries, verbose)}")
        if verbose:
            lines += [f"  {entry['target']}" for entry in entries]
    return "\n".join(lines)


def _describe_group(
    status: dict[str, Any], group: str, targets: list[str], skipped: list[dict[str, str]]
) -> str:
    head = f"{group} ({len(targets)} target{'' if len(targets) == 1 else 's'})"
    if group in status["groups_off"]:
        return f"{head}: off ({status['groups_off'][group]}), not checked"
    parts = []
    if status["plugin_applied"]:
        patched = sum(target in status["patched_targets"] for target in targets)
        parts.append(f"patched {patched} in this process")
    would = sum(target in status["would_patch"] for target in targets)
    parts.append(f"would patch {would}" + (", fingerprints match" if not skipped else ""))
    if skipped:
        parts.append(f"skipped {len(skipped)}: {_distinct_reasons(skipped, False)}")
    return f"{head}: " + "; ".join(parts)


def _target_state(status: dict[str, Any], target: str, reasons: dict[str, str]) -> str:
    if target in status["patched_targets"]:
        return f"patched {target}"
    if target in status["would_patch"]:
        return f"would patch {target}"
    if target in reasons:
        return f"skipped {target}: {reasons[target]}"
    return f"not patched {target}"


def _distinct_reasons(entries: list[dict[str, str]], every: bool, shown: int = 2) -> str:
    """Each distinct reason once, after the function it was first given for."""
    first: dict[str, str] = {}
    for entry in entries:
        first.setdefault(entry["reason"], _function_name(entry["target"]))
    texts = [f"{name}: {reason}" for reason, name in first.items()]
    if every or len(texts) <= shown:
        return "; ".join(texts)
    return "; ".join(texts[:shown]) + f"; and {len(texts) - shown} more reasons (--verbose)"


def _function_name(target: str) -> str:
    """``Class.method`` of a dotted target (from its first capitalised part), else its
    last part."""
    parts = target.split(".")
    start = next((i for i, part in enumerate(parts) if part[:1].isupper()), len(parts) - 1)
    return ".".join(parts[start:])


def _describe_memlock(pinned: dict[str, Any]) -> str:
    def spell(value: int | str | None) -> str:
        return str(value) if not isinstance(value, int) else format_size(value)

    text = f"soft {spell(pinned['memlock_soft'])}, hard {spell(pinned['memlock_hard'])}"
    if pinned["root"]:
        return text + " (running as root, which may pin past it)"
    if pinned["memlock_soft"] != "unlimited":
        return text + " (pinning more fails; raise it with `ulimit -l unlimited`)"
    return text


def _describe_host(host: dict[str, Any]) -> str:
    available = host["available_bytes"]
    parts = [
        "available memory unknown" if available is None else f"{_gib(available)} available",
        f"{host['usable_cpus']} usable CPUs",
        "NUMA " + ", ".join(f"node {n['node']} ({n['cpus']} CPUs)" for n in host["nodes"]),
    ]
    parts += [
        f"GPU {i} on {'an unknown node' if node is None else f'node {node}'}"
        for i, node in enumerate(host["gpu_nodes"])
    ]
    return "; ".join(parts)


def _describe_estimate(estimate: dict[str, Any]) -> str:
    text = (
        f"about {estimate['kvcore_seconds']:.0f} s with kvcore: pages faulted in at "
        f"{estimate['fault_gib_per_s']:.1f} GiB/s by {estimate['threads']} threads "
        f"(one thread: {estimate['fault_one_thread_gib_per_s']:.1f} GiB/s)"
    )
    if estimate["register_gib_per_s"] is None:
        return text + "; registration not measured (no CUDA)"
    text = (
        f"{text}, registered at {estimate['register_gib_per_s']:.1f} GiB/s; the engines' way "
        f"(registration faulting every page on one thread) about "
        f"{estimate['stock_seconds']:.0f} s (scaled from {_gib(estimate['sample_bytes'])})"
    )
    usable = estimate["kvcore_usable_seconds"]
    if usable is None:
        return text
    return (
        f"{text}; with its first {_gib(estimate['first_bytes'])} pinned "
        f"(KVCORE_HOST_POOL_PIN_FIRST), SGLang's pool usable after about {usable:.0f} s "
        f"(every page faulted in first), vLLM's shared tier after about "
        f"{estimate['vllm_region_usable_seconds']:.1f} s (that share's pages alone)"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.3g} GiB"


def _describe_config(values: dict[str, Any]) -> str:
    changed = [
        f"{s.env}={s.kind.render(values[s.name])}"
        for s in SETTINGS
        if s.parse(values[s.name]) != s.default
    ]
    return " ".join(changed) or "all defaults (kvcore is not enabled)"
