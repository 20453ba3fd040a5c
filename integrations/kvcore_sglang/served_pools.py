"""The SGLang host-pool classes whose transfers kvcore's hooks serve, by the dotted name
the hooks' targets and the serve-or-pass rule know them by."""

from __future__ import annotations

from typing import Any

_POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"
MHA_POOL = f"{_POOL_PACKAGE}.mha.MHATokenToKVPoolHost"
MLA_POOL = f"{_POOL_PACKAGE}.mla.MLATokenToKVPoolHost"
DSA_POOL = f"{_POOL_PACKAGE}.dsa.DSAIndexerPoolHost"

_CLASS_NAMES: dict[type, str] = {}


def class_name(pool: Any) -> str:
    """The pool class's dotted name, as the hooks' targets name it (made once per class:
    every first call of a request asks)."""
    cls = type(pool)
    name = _CLASS_NAMES.get(cls)
    if name is None:
        name = _CLASS_NAMES.setdefault(cls, f"{cls.__module__}.{cls.__qualname__}")
    return name
