"""Stand-ins for packages SGLang imports at module level but that cannot be installed here.

:class:`StubType` stands for any name such a package exports: importable, subclassable,
usable in annotations and unions, its attributes more stubs; what a call does is the
subclass's choice. :class:`PackageStub` is the import finder that serves the package and
every submodule of it, each name in them a stub of the given type.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class StubType(type):
    """A class standing for an exported name; each attribute of it is another one."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls.named(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def named(cls, qualified: str) -> Any:
        """Another stub of this kind, for the dotted name ``qualified``."""
        return stub(type(cls), qualified)


def stub(kind: type[StubType], qualified: str) -> Any:
    """A ``kind`` stub for the dotted name ``qualified``."""
    return kind(qualified.rsplit(".", 1)[-1], (), {"__qualname__": qualified})


def _module_attribute(kind: type[StubType], module_name: str) -> Callable[[str], Any]:
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(kind, f"{module_name}.{name}")

    return attribute


class PackageStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``package`` and its submodules; every name in them is a ``kind`` stub."""

    def __init__(
        self, package: str, kind: type[StubType], module_attrs: dict[str, Any] | None = None
    ) -> None:
        self.package = package
        self.kind = kind
        self.module_attrs = dict(module_attrs or {})

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == self.package or fullname.startswith(f"{self.package}."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []
        for name, value in self.module_attrs.items():
            setattr(module, name, value)
        module.__getattr__ = _module_attribute(self.kind, module.__name__)  # type: ignore[method-assign]


class _Placeholder(StubType):
    """Anything torchvision exports: calling it gives another placeholder."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.named(cls.__qualname__)


def install_torchvision_stub() -> bool:
    """SGLang imports torchvision at module level (its multimodal configs), which has no
    build for a CPU-only torch: where it is missing, a placeholder package stands in;
    nothing kvcore runs calls it. True if installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if not any(getattr(f, "package", None) == "torchvision" for f in sys.meta_path):
        version = {"__version__": "0.0.0+kvcore.stub"}  # transformers parses it
        sys.meta_path.insert(0, PackageStub("torchvision", _Placeholder, version))
    return True
