"""What a patched vLLM source calls, and the adapter's description of its patch sets.

The patch ends ``vllm/v1/kv_offload/factory.py`` with one line that rebinds the spec
factory's entry for the default spec name through :func:`hook` (see patches/README.md).
When patched mode is on, :func:`hook` makes the plugin's own change (kvcore's spec
behind the default name, and registered as ``KVCoreCPUOffloadingSpec``) and returns
kvcore's loader; otherwise it returns the stock loader unchanged.

Patched mode is on in a patched build unless ``KVCORE_ENABLE`` is set and leaves vllm
out (``KVCORE_ENABLE=0`` turns it off), or a ``KVCORE_*`` variable is bad (one logged line
says which). The plugin's change is idempotent (the same loader, the explicit name
registered once), so the plugin enabled on a patched tree changes nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcore.config import engine_config
from kvcore.patching.mode import patched_mode_enabled as engine_patched_mode
from kvcore.patching.spec import EngineSpec, PatchTarget
from kvcore_vllm import guard, plugin
from kvcore_vllm.installation import INSTALLATION

logger = logging.getLogger("kvcore.vllm")


def patched_mode_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """On unless ``KVCORE_ENABLE`` is set and does not name vllm, or a variable is bad
    (:func:`kvcore.patching.mode.patched_mode_enabled`)."""
    return engine_patched_mode("vLLM", guard.ENGINE, environ)


def hook(target: str, original: Any) -> Any:
    """What the patched module binds in place of ``original`` (the stock ``target``)."""
    try:
        if target != plugin.REGISTRY_TARGET:
            raise KeyError(f"kvcore's vLLM adapter has no hook for {target}")
        config = engine_config("vLLM")
        if config is None or not patched_mode_enabled():
            return original
        config.configure_logging()
        # The plugin's own change, made while vLLM's factory module is still executing
        # (its class and the stock entries exist by the time the patch line runs).
        plugin.install_spec()
    except Exception:
        # A failure here must leave vLLM importable and stock, never stop it.
        logger.exception("kvcore: hooking %s failed; it stays stock", target)
        return original
    INSTALLATION.note_hooked(target)
    return plugin.load_spec


def hooked_targets() -> tuple[str, ...]:
    """The targets the patched source hooked in this process (until an uninstall)."""
    return INSTALLATION.hooked


def _targets(version: str) -> tuple[PatchTarget, ...]:
    return (PatchTarget.from_dotted(plugin.REGISTRY_TARGET),)


def _source_changes(version: str, root: Path) -> dict[str, str]:
    return guard.refusals(version, root=root)


PATCH_SPEC = EngineSpec(
    engine=guard.ENGINE,
    package="vllm",
    distribution=guard.DISTRIBUTION,
    hook_module=__name__,
    versions=guard.SUPPORTED_VERSIONS,
    targets=_targets,
    source_changes=_source_changes,
)
