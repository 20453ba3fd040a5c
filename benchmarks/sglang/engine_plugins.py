"""SGLang's plugins loaded as a scheduler process loads them, kvcore's among them.

SGLang finds general plugins through the ``sglang.srt.plugins`` entry point group and
``load_plugins()`` runs each, then applies the hooks they registered. On the GPU machine
kvcore is not installed as a distribution (the repo is on ``PYTHONPATH``), so nothing
declares its entry point there: :func:`declare_kvcore_entry_point` then declares it from a
temporary ``.dist-info`` on ``sys.path``, the same line ``pyproject.toml`` installs, so
SGLang's own discovery finds it.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

GROUP = "sglang.srt.plugins"
KVCORE_ENTRY = "kvcore_sglang.plugin:load"
_PROBE_DIST = "kvcore_live_entry"

# What each mode sets before SGLang loads its plugins (None: unset, so kvcore's default
# holds: the kvcore mode runs what an operator gets from KVCORE_ENABLE alone).
_SHARE = "KVCORE_STOCK_SHARE"
MODE_ENV: dict[str, dict[str, str | None]] = {
    "stock": {"KVCORE_ENABLE": "0", "KVCORE_TRANSFERS": "0", _SHARE: None},
    "kvcore": {"KVCORE_ENABLE": "sglang", "KVCORE_TRANSFERS": None, _SHARE: None},
    # kvcore's host-slot allocator alone: tells its share of a difference from the hooks'.
    "kvcore-allocator": {"KVCORE_ENABLE": "sglang", "KVCORE_TRANSFERS": "0", _SHARE: None},
    # kvcore with its transfers, its pools' warm-up skipped: tells the warm-up's share.
    "kvcore-no-warm-up": {"KVCORE_ENABLE": "sglang", "KVCORE_TRANSFERS": None, _SHARE: None},
    # Half the load-backs kvcore would serve drawn for stock's copy: the two copies
    # compared inside one process, free of the drift between processes.
    "kvcore-ab": {"KVCORE_ENABLE": "sglang", "KVCORE_TRANSFERS": None, _SHARE: "0.5"},
}
NO_WARM_UP_MODES = frozenset({"kvcore-no-warm-up"})


def kvcore_entry_declared() -> bool:
    return any(ep.value == KVCORE_ENTRY for ep in entry_points(group=GROUP))


def declare_kvcore_entry_point() -> str | None:
    """Make kvcore's entry point discoverable; the folder declaring it, None if one was."""
    if kvcore_entry_declared():
        return None
    root = Path(tempfile.mkdtemp(prefix="kvcore-entry-"))
    info = root / f"{_PROBE_DIST}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {_PROBE_DIST}\nVersion: 0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        f"[{GROUP}]\nkvcore = {KVCORE_ENTRY}\n", encoding="utf-8"
    )
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return str(root)


def _skip_warm_up(adapter: Any, pool: Any) -> None:
    """Stands in for :func:`kvcore_sglang.pool_warm_up.warm_up_pool`: the pool's paths
    are set up on their first use instead."""


def load_sglang_plugins(mode: str) -> dict[str, Any]:
    """Set ``mode``'s KVCORE_* variables, then run SGLang's ``load_plugins()``.

    Returns what happened: the variables, where the entry point was declared, and
    kvcore's status in this process (the targets it patched).
    """
    env = MODE_ENV[mode]
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    declared_in = declare_kvcore_entry_point()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import kvcore_sglang

    if mode in NO_WARM_UP_MODES:
        from kvcore_sglang import pool_warm_up

        pool_warm_up.warm_up_pool = _skip_warm_up
    status = kvcore_sglang.status()
    return {
        "env": dict(env),
        "entry_point_declared_in": declared_in,
        "enabled": status.enabled,
        "plugin_applied": status.plugin_applied,
        "patched_targets": list(status.patched_targets),
        "skipped_targets": list(status.skipped_targets),
    }
