"""Stand-ins for the HTTP-protocol packages SGLang imports on its way to the radix cache.

``sglang.srt.mem_cache.unified_radix_cache`` imports the scheduler's request types, which
import the OpenAI-compatible protocol models (``openai``, ``partial_json_parser``) at
module level. Neither package is in SGLang's venv here or carried to the GPU machine, and
the cache never touches a protocol object. Where one is missing, its names become
:class:`ProtocolType` stubs: subclassable with class keywords (``TypedDict``'s
``total=False``) and accepted by pydantic as "any" fields, so the protocol modules define
their models and nothing else changes.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from benchmarks.sglang.import_stubs import PackageStub, StubType

PACKAGES = ("openai", "partial_json_parser")


class ProtocolType(StubType):
    """A name from a missing protocol package."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kw: Any):
        # Class keywords (``total=False``) are the stubbed base's business; dropped here.
        return super().__new__(mcs, name, bases, namespace)

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kw: Any):
        super().__init__(name, bases, namespace)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.named(cls.__qualname__)

    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _ProtocolStub(PackageStub):
    def __init__(self, package: str) -> None:
        super().__init__(package, ProtocolType)


def install_protocol_stubs() -> list[str]:
    """Serve each missing package of :data:`PACKAGES`; the names of those now stubbed."""
    stubbed = []
    for package in PACKAGES:
        served = any(
            isinstance(finder, _ProtocolStub) and finder.package == package
            for finder in sys.meta_path
        )
        if served or importlib.util.find_spec(package) is None:
            if not served:
                sys.meta_path.append(_ProtocolStub(package))
            stubbed.append(package)
    return stubbed
