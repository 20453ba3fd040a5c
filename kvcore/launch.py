"""``kvcore launch ENGINE [--kvcore-...] -- ENGINE_ARGS``: check, then become the engine.

Before the engine starts, every kvcore setting (``KVCORE_*`` variables overridden by
``--kvcore-*`` flags) is checked, and a bad one stops the launch with one line. Each
thing in the engine's arguments or environment that would leave kvcore with nothing
to do gets one warning line, and the launch goes on: the user may know better. Then
this process becomes the engine's own server, with the settings as ``KVCORE_*``
variables so that every process the engine spawns reads them (an explicit
``--kvcore-enable 0`` is kept: the engine starts stock, after a note saying so). Only the
standard library and kvcore's torch-free modules are imported: the engine should not wait
for torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvcore.config import SETTINGS, KVCoreConfig, flag_overrides, settings_help
from kvcore.config_values import ENGINES, ConfigError
from kvcore.engine_args import EngineArgs
from kvcore.metrics_export import MULTIPROC_ENV, multiprocess_dir

ENGINE_ENTRY_MODULES: dict[str, str] = {
    "sglang": "sglang.launch_server",
    "vllm": "vllm.entrypoints.cli.main",
}
# Engine -> its adapter package; ``<adapter>.launch_checks`` knows what the engine needs.
ADAPTERS: dict[str, str] = {"sglang": "kvcore_sglang", "vllm": "kvcore_vllm"}
HELP_FLAGS = frozenset({"-h", "--help"})
ENABLE_SETTING = next(s for s in SETTINGS if s.name == "enable")
SEPARATOR = "--"


class LaunchError(Exception):
    """The launch command line is wrong, or the engine cannot start; the message says how."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``launch`` to kvcore's command parser."""
    launch = commands.add_parser(
        "launch",
        help="start an engine with kvcore enabled and configured",
        usage="kvcore launch ENGINE [--kvcore-...] [--dry-run] -- ENGINE_ARGS...",
        description=(
            "Check kvcore's settings (--kvcore-* flags over KVCORE_* variables already set)\n"
            "and ENGINE_ARGS, enable kvcore for ENGINE (unless --kvcore-enable 0 keeps it\n"
            "off: then the engine starts stock), and replace this process with the\n"
            "engine's own server. A bad setting stops the launch; engine arguments that\n"
            "would leave kvcore idle get a warning, and the launch goes on. With no '--',\n"
            "every argument that is not kvcore's goes to the engine. The engine's own help:\n"
            "kvcore launch sglang -- --help, kvcore launch vllm -- serve --help."
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    # One positional takes ENGINE and all that follows: argparse would drop a '--' that
    # came right after a positional of its own, and with it the line between kvcore's
    # flags and the engine's.
    launch.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        action=_EngineArguments,
        metavar="ENGINE",
        help=f"{' or '.join(ENGINES)}, then kvcore's flags, '--' and the engine's arguments",
    )
    launch.set_defaults(handler=run, engine=None)


def _epilog() -> str:
    engines = [
        f"  {engine:<7} python -m {module}\n          kvcore acts with {_needs(engine)}"
        for engine, module in ENGINE_ENTRY_MODULES.items()
    ]
    return (
        "engines:\n"
        + "\n".join(engines)
        + "\n\nkvcore settings (flag [variable; accepts; default]):\n"
        + settings_help()
    )


def _needs(engine: str) -> str:
    """What the engine needs for kvcore to act, from its adapter; where the adapter does not
    import (a broken install), that fact, so that every other command still runs."""
    module = ADAPTERS[engine] + ".launch_checks"
    try:
        return str(importlib.import_module(module).NEEDS)
    except ImportError as exc:
        return f"nothing here: {module} does not import ({exc}); reinstall kvcore"


class _EngineArguments(argparse.Action):
    """Splits ENGINE from what follows it, where argparse no longer looks for -h: --help
    before '--' (or anywhere, without one) is kvcore's, so help works for any engine
    named, installed or not."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        rest = list(values)
        kvcore_part = rest[: rest.index(SEPARATOR)] if SEPARATOR in rest else rest
        if HELP_FLAGS & set(kvcore_part):
            parser.print_help()
            parser.exit()
        if rest and not rest[0].startswith("-"):
            namespace.engine = rest.pop(0)
        setattr(namespace, self.dest, rest)


def run(args: argparse.Namespace) -> int:
    """Check, warn, then exec the engine (or print the plan); 2 for a usage or config error."""
    try:
        return _launch(args.engine, args.rest, args.dry_run)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kvcore launch: {problem}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"kvcore launch: {exc}", file=sys.stderr)
        return 2


def _launch(engine: str | None, rest: list[str], dry_run: bool) -> int:
    choices = " or ".join(ENGINES)
    if engine is None:
        raise LaunchError(f"name the engine to start: {choices} (kvcore launch --help)")
    if engine not in ENGINE_ENTRY_MODULES:
        raise LaunchError(f"unknown engine {engine!r}; choose {choices}")
    config, engine_args, dry_run_flag = split_args(rest)
    config.configure_logging()
    flags = flag_overrides(rest[: rest.index(SEPARATOR)] if SEPARATOR in rest else rest)
    turned_off = _turned_off(flags, os.environ)
    if turned_off is None:
        config = replace(config, enable=config.enable | {engine})
        for warning in idle_warnings(engine, engine_args, config, os.environ):
            print(f"kvcore launch: warning: {warning}", file=sys.stderr)
    else:
        print(
            f"kvcore launch: note: {turned_off} turns kvcore off: {engine} starts stock, "
            "without kvcore (drop it to start with kvcore)",
            file=sys.stderr,
        )
    command = [sys.executable, "-m", ENGINE_ENTRY_MODULES[engine], *engine_args]
    variables = _exported(config, flags, os.environ)
    installed = engine_installed(engine)
    if dry_run or dry_run_flag:
        _print_plan(variables, command)
        if not installed:
            print(f"kvcore launch: note: {engine} is not installed here", file=sys.stderr)
        return 0
    if not installed:
        raise LaunchError(f"{engine} is not installed for {sys.executable}; pip install {engine}")
    if turned_off is None and config.metrics and multiprocess_dir(os.environ) is None:
        # kvcore counts in the engine's worker processes; the engine serves /metrics from
        # another one, which reads them only in prometheus_client's multiprocess mode. A
        # fresh directory per launch, so no earlier run's values are summed in.
        variables[MULTIPROC_ENV[0]] = tempfile.mkdtemp(prefix="kvcore-metrics-")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, {**os.environ, **variables})


def _exported(
    config: KVCoreConfig, flags: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """The ``KVCORE_*`` variables the engine starts with: the engine list, each setting a flag
    gave and each variable already set (spelled as kvcore reads it back). A setting nobody
    gave stays unset, since unset can mean more than its default: vLLM's handlers copy
    blocks by DMA into place unless ``KVCORE_LONG_RUN_BYTES`` or ``KVCORE_MAX_BATCHED_RUNS``
    is set (:func:`kvcore.planning.path_policy.dma_in_place_policy`). ``flags``: what the
    ``--kvcore-*`` flags said (:func:`~kvcore.config.flag_overrides`)."""
    given = {ENABLE_SETTING.env} | {s.env for s in SETTINGS if s.name in flags}
    return {
        name: value for name, value in config.to_env().items() if name in given or environ.get(name)
    }


def _turned_off(flags: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """How the launch was told to keep kvcore off (``--kvcore-enable 0``, or
    ``KVCORE_ENABLE=0`` with no flag over it), else None.

    Only an explicit off counts: a setting that names other engines still has ENGINE
    added, as it always has, and an unset or empty variable means "not said".
    """
    setting = ENABLE_SETTING
    if setting.name in flags:
        off = not flags[setting.name]
        return f"{setting.flag} {setting.kind.render(flags[setting.name])}" if off else None
    value = environ.get(setting.env, "")
    if value and not setting.parse(value, setting.env):
        return f"{setting.env}={value}"
    return None


def split_args(rest: list[str]) -> tuple[KVCoreConfig, list[str], bool]:
    """(config, engine arguments, dry run) from what follows ENGINE.

    Before ``--`` only kvcore's flags are allowed; with no ``--`` every other
    argument goes to the engine.
    """
    has_separator = SEPARATOR in rest
    cut = rest.index(SEPARATOR) if has_separator else len(rest)
    config, leftover = KVCoreConfig.from_args(rest[:cut])
    dry_run = "--dry-run" in leftover
    leftover = [arg for arg in leftover if arg != "--dry-run"]
    if has_separator and leftover:
        raise LaunchError(
            f"unexpected {shlex.join(leftover)} before '--': only --kvcore-* flags and "
            "--dry-run go there; engine arguments go after '--'"
        )
    return config, leftover + rest[cut + 1 :], dry_run


def idle_warnings(
    engine: str, engine_args: Sequence[str], config: KVCoreConfig, environ: Mapping[str, str]
) -> list[str]:
    """One line per reason kvcore would do nothing in ``engine`` started this way."""
    try:
        adapter = importlib.import_module(ADAPTERS[engine])
        checks = importlib.import_module(ADAPTERS[engine] + ".launch_checks")
    except ImportError as exc:
        raise LaunchError(
            f"kvcore's {engine} adapter ({ADAPTERS[engine]}) does not import: {exc}; "
            "reinstall kvcore, which ships it"
        ) from exc
    status = adapter.status(config)
    warnings: list[str] = []
    if status.installed and not status.supported:
        warnings.append(
            f"{engine} {status.version} is not a version kvcore has tested "
            f"({', '.join(status.supported_versions)}), so it would run stock: "
            "install a tested one"
        )
    elif status.skipped_targets:
        first = status.skipped_targets[0]
        warnings.append(
            f"{len(status.skipped_targets)} {engine} functions kvcore relies on differ from "
            f"{engine} {status.version} as tested (first: {first['target']}: "
            f"{first['reason']}), so it would run stock"
        )
    return warnings + checks.idle_warnings(EngineArgs.of(engine_args), environ, config)


def engine_installed(engine: str) -> bool:
    # The top-level name only: finding a submodule would import the engine's package.
    return importlib.util.find_spec(engine) is not None


def _print_plan(variables: dict[str, str], command: list[str]) -> None:
    changed = {k: v for k, v in variables.items() if os.environ.get(k) != v}
    print("environment (set by kvcore launch):")
    for name, value in changed.items():
        print(f"  {name}={shlex.quote(value)}")
    if not changed:
        print("  (no change)")
    print("command:")
    print(f"  {shlex.join(command)}")
