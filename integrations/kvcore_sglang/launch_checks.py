"""What ``kvcore launch sglang`` checks before SGLang starts: arguments and variables that
would leave kvcore's hooks with nothing to do.

kvcore serves SGLang's HiCache host pools, which exist only with HiCache on (or on a
disaggregated decode server, which keeps one too). Its transfers serve some host
layouts and io backends (:mod:`kvcore_sglang.served_layouts`); the others copy the
stock way. Only the standard library and kvcore's torch-free modules are imported.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcore.config import KVCoreConfig
from kvcore.engine_args import EngineArgs

from .host_memory_choice import sglang_choice
from .served_layouts import IO_BACKENDS, SERVED_LAYOUTS

NEEDS = "HiCache on: --enable-hierarchical-cache"
PLUGIN = "kvcore"  # the entry point's name under sglang.srt.plugins (pyproject.toml)
NO_HICACHE = (
    "SGLang would run without HiCache, so kvcore would have nothing to serve: "
    "add --enable-hierarchical-cache"
)
HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--enable-hicache",
    "--disaggregation-decode-enable-offload-kvcache",
)


def idle_warnings(args: EngineArgs, environ: Mapping[str, str], config: KVCoreConfig) -> list[str]:
    """One line per reason kvcore would do nothing (or less than asked) in this SGLang."""
    warnings = _plugin_allowlist(environ)
    choice = sglang_choice(environ) if config.host_pool else None
    if choice is not None:
        warnings.append(
            f"{choice} is set, so SGLang obtains its host pools its own way and "
            f"KVCORE_HOST_POOL does nothing: unset {choice} for kvcore's"
        )
    if args.opaque:
        return warnings
    if not (args.has(*HICACHE_FLAGS) or args.value("--disaggregation-mode") == "decode"):
        return [*warnings, NO_HICACHE]
    if config.host_pool_pin_first and args.value("--hicache-io-backend") == "direct":
        warnings.append(PIN_FIRST_DIRECT)
    if config.transfers:
        warnings += _unserved_transfers(args)
        if config.sglang_dma_in_place and args.value("--page-size") == "1":
            warnings.append(ONE_TOKEN_PAGES)
    return warnings


PIN_FIRST_DIRECT = (
    "KVCORE_HOST_POOL_PIN_FIRST leaves the pool one registration per step, and SGLang's "
    "direct io backend copies with the copy engines, which cannot cross two: use "
    "--hicache-io-backend kernel with it, or KVCORE_HOST_POOL_PIN_FIRST=0"
)
ONE_TOKEN_PAGES = (
    "--page-size 1 leaves KVCORE_SGLANG_DMA_IN_PLACE nothing to copy by DMA (a token's row is "
    "too short): it takes pages of 128 KiB of a layer or more, --page-size 64 on an 8-head, "
    "128-dim bf16 model"
)


def _plugin_allowlist(environ: Mapping[str, str]) -> list[str]:
    # As SGLang reads it: unset or empty allows every plugin.
    allowed = environ.get("SGLANG_PLUGINS", "")
    if not allowed or PLUGIN in {name.strip() for name in allowed.split(",")}:
        return []
    return [f"SGLANG_PLUGINS={allowed!r} leaves out kvcore's plugin: add {PLUGIN} to it"]


def _unserved_transfers(args: EngineArgs) -> list[str]:
    warnings = []
    layout = args.value("--hicache-mem-layout")
    if layout is not None and layout not in SERVED_LAYOUTS:
        warnings.append(
            f"kvcore's transfers do not serve --hicache-mem-layout {layout}, so SGLang "
            f"copies its own way: use {', '.join(SERVED_LAYOUTS)}"
        )
    backend = args.value("--hicache-io-backend")
    if backend is not None and backend not in IO_BACKENDS:
        warnings.append(
            f"kvcore's transfers do not serve --hicache-io-backend {backend}, so SGLang "
            f"copies its own way: use {' or '.join(sorted(IO_BACKENDS))}"
        )
    return warnings
