"""What an adapter tells the patch machinery: the engine's package and the targets to hook."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Engine -> the adapter module whose PATCH_SPEC describes that engine's patches.
ADAPTER_SPECS: dict[str, str] = {
    "sglang": "kvcore_sglang.patched",
    "vllm": "kvcore_vllm.patched",
}


@dataclass(frozen=True)
class PatchTarget:
    """One binding the patched module rebinds to ``hook(target, <stock value>)``."""

    target: str  # the name the adapter gives it (doctor, the plugin's status)
    module: str  # the dotted module whose source gains the hook line
    expression: str  # what is rebound, in that module's namespace, e.g. ``HostKVCache.alloc``

    @classmethod
    def from_dotted(cls, target: str) -> PatchTarget:
        """The target ``package.module.Class.rest``: the module ends before the first
        capitalised part, where the expression begins."""
        parts = target.split(".")
        for i, part in enumerate(parts):
            if part[:1].isupper():
                return cls(target, ".".join(parts[:i]), ".".join(parts[i:]))
        raise ValueError(f"{target!r} names no class")


@dataclass(frozen=True)
class EngineSpec:
    """An engine as the patch machinery sees it; built by the adapter from its own tables."""

    engine: str
    package: str  # the top-level import package, e.g. ``sglang``
    distribution: str
    hook_module: str  # the module that the patched source imports ``hook`` from
    versions: tuple[str, ...]  # releases the adapter has recorded fingerprints for
    targets: Callable[[str], tuple[PatchTarget, ...]]  # a release's targets
    # (release, root holding the package) -> target -> why its source is not the one
    # the adapter was tested against; empty when everything matches.
    source_changes: Callable[[str, Path], dict[str, str]]

    def module_path(self, module: str) -> str:
        """``module``'s file, relative to the directory that holds the package."""
        return module.replace(".", "/") + ".py"


def spec_for(engine: str) -> EngineSpec:
    """The adapter's spec for ``engine``; ValueError names the known engines."""
    name = ADAPTER_SPECS.get(engine)
    if name is None:
        known = ", ".join(sorted(ADAPTER_SPECS))
        raise ValueError(f"unknown engine {engine!r}; known: {known}")
    spec = importlib.import_module(name).PATCH_SPEC
    assert isinstance(spec, EngineSpec)
    return spec
