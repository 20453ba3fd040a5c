"""What ``kvcore launch vllm`` checks before vLLM starts: arguments and variables that
would leave kvcore's spec unused.

kvcore serves vLLM's native CPU offloading: the ``OffloadingConnector`` with the
default spec (or kvcore's, named explicitly). ``--kv-offloading-size`` turns that on
unless another backend or ``VLLM_USE_SIMPLE_KV_OFFLOAD`` picks another connector;
``--kv-transfer-config`` (JSON, or vLLM's dotted ``--kv-transfer-config.key value``)
can name the connector and spec itself. Only the standard library and kvcore's
torch-free modules are imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from kvcore.config import KVCoreConfig
from kvcore.engine_args import EngineArgs

from .plugin import DEFAULT_SPEC_NAME, SPEC_NAME

NEEDS = "CPU offloading on: serve <model> --kv-offloading-size <GiB>"
PLUGIN = "kvcore"  # the entry point's name under vllm.general_plugins (pyproject.toml)
NO_OFFLOADING = (
    "vLLM would run without CPU offloading, so kvcore would have nothing to serve: "
    "add --kv-offloading-size <GiB>"
)
ENGINE_COMMANDS = ("serve", "run-batch")  # vLLM commands that build an engine
CONNECTOR = "OffloadingConnector"
TRANSFER_CONFIG = "--kv-transfer-config"


def idle_warnings(args: EngineArgs, environ: Mapping[str, str], config: KVCoreConfig) -> list[str]:
    """One line per reason kvcore would do nothing in this vLLM (or leave a setting unused)."""
    warnings = _plugin_allowlist(environ)
    if args.opaque or args.command not in ENGINE_COMMANDS:
        return warnings
    return warnings + _offloading(args, environ)


def _plugin_allowlist(environ: Mapping[str, str]) -> list[str]:
    # As vLLM reads it: set, even empty, it names every plugin to load.
    if "VLLM_PLUGINS" not in environ or PLUGIN in environ["VLLM_PLUGINS"].split(","):
        return []
    allowed = environ["VLLM_PLUGINS"]
    return [f"VLLM_PLUGINS={allowed!r} leaves out kvcore's plugin: add {PLUGIN} to it"]


def _offloading(args: EngineArgs, environ: Mapping[str, str]) -> list[str]:
    transfer = _transfer_config(args)
    if transfer is None:
        return []  # vLLM refuses an unreadable config itself
    if args.has("--kv-offloading-size"):
        backend = args.value("--kv-offloading-backend") or "native"
        if backend != "native":
            return [
                f"--kv-offloading-backend {backend} offloads through another connector, "
                "which kvcore does not serve: use --kv-offloading-backend native"
            ]
        if _simple_offload(environ):
            return [
                "VLLM_USE_SIMPLE_KV_OFFLOAD picks SimpleCPUOffloadConnector, which kvcore "
                "does not serve: unset it"
            ]
        # vLLM makes the top-level connector the offloading one, keeping its extra config.
        connectors = [transfer]
    else:
        connectors = list(_offloading_connectors(transfer))
        if not connectors:
            return [NO_OFFLOADING]
    names = [_spec_name(connector) for connector in connectors]
    if not {DEFAULT_SPEC_NAME, SPEC_NAME} & set(names):
        return [
            f"{TRANSFER_CONFIG} names spec_name {names[0]!r}, which kvcore leaves alone: "
            f"drop spec_name, or name {SPEC_NAME}"
        ]
    return []


def _transfer_config(args: EngineArgs) -> dict[str, Any] | None:
    """The connector config vLLM would read ({} for none); None when it cannot be read."""
    dotted = args.dotted(TRANSFER_CONFIG)
    if not dotted:
        text = args.value(TRANSFER_CONFIG)
        try:
            config = {} if text is None else json.loads(text)
        except ValueError:
            return None
        return config if isinstance(config, dict) else None
    # vLLM turns the dotted keys into one JSON value placed last, which then wins.
    config = {}
    for keys, text in dotted:
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                return None
        try:
            node[keys[-1]] = json.loads(text)
        except ValueError:
            node[keys[-1]] = text
    return config


def _offloading_connectors(node: Any) -> Iterator[dict[str, Any]]:
    # Anywhere in the config, so that a MultiConnector's offloading member counts.
    if isinstance(node, dict):
        if node.get("kv_connector") == CONNECTOR:
            yield node
        for value in node.values():
            yield from _offloading_connectors(value)
    elif isinstance(node, list):
        for value in node:
            yield from _offloading_connectors(value)


def _spec_name(connector: dict[str, Any]) -> str:
    extra = connector.get("kv_connector_extra_config")
    name = extra.get("spec_name") if isinstance(extra, dict) else None
    return name if isinstance(name, str) else DEFAULT_SPEC_NAME


def _simple_offload(environ: Mapping[str, str]) -> bool:
    # As vLLM reads it: an integer, non-zero for on (vLLM refuses anything else itself).
    try:
        return bool(int(environ.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0")))
    except ValueError:
        return False
