"""The kinds of value kvcore's settings take, and how each is read and written: sizes
(``256MiB``), counts, shares, switches, engine sets and log levels; :class:`ConfigError`
carries every problem found at once.

Only the standard library is imported here: adapters read settings at plugin-load time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

ENGINES: tuple[str, ...] = ("sglang", "vllm")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REGION_STAGING_CHOICES: tuple[str, ...] = ("off", "gather", "all")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


class ConfigError(ValueError):
    """Settings kvcore does not accept: one problem per bad setting, each naming it; the
    message is the problems, a line each."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems: tuple[str, ...] = problems

    def __str__(self) -> str:
        return "\n".join(self.problems)


@dataclass(frozen=True)
class ValueKind:
    """How one kind of setting is written as text and read back."""

    allowed: str  # in full, for error messages
    summary: str  # in a few words, for help tables
    parse: Callable[[object], Any]  # raises ValueError or TypeError saying why
    render: Callable[[Any], str]


_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_SIZE_PATTERN = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+) *([a-z]*)")
_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
SIZE_SYNTAX = (
    "a byte count with an optional unit, case-insensitive: k/KiB, M/MiB, G/GiB, T/TiB are "
    "powers of 1024, KB/MB/GB/TB powers of 1000 (e.g. 4096, 4k, 512MiB, 1.5GB)"
)


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"1.5GB"``, ``"4k"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"a size must be an int or a string, not {type(value).__name__}")
    if isinstance(value, int):
        return value
    match = _SIZE_PATTERN.fullmatch(value.strip().lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError("not a byte size")
    nbytes = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if nbytes.denominator != 1:
        raise ValueError("not a whole number of bytes")
    return int(nbytes)


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: the largest binary unit that divides ``nbytes``."""
    for unit, scale in _BINARY_UNITS:
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _size(minimum: int, maximum: int | None = None, why_maximum: str = "") -> ValueKind:
    def parse(value: object) -> int:
        nbytes = parse_size(value)
        if nbytes < minimum:
            raise ValueError(f"below the minimum of {minimum}")
        if maximum is not None and nbytes > maximum:
            raise ValueError(f"above the maximum of {format_size(maximum)} ({why_maximum})")
        return nbytes

    limit = f"; at least {minimum}" if minimum else ""
    summary = f"size >= {minimum}" if minimum else "size"
    if maximum is not None:
        limit += f", at most {format_size(maximum)}"
        summary = f"size {minimum}..{format_size(maximum)}"
    return ValueKind(SIZE_SYNTAX + limit, summary, parse, format_size)


# The staging buffer is device memory, one on every device: no GPU holds a tebibyte, so a
# larger value is a typo (99999999T) that would otherwise surface as a failed allocation.
STAGING_MAX_BYTES = TiB


def _integer(low: int, high: int) -> ValueKind:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"expected an int or a string, not {type(value).__name__}")
        if isinstance(value, str) and not re.fullmatch(r"[+-]?[0-9]+", value.strip()):
            raise ValueError("not an integer")
        number = int(value) if isinstance(value, str) else value
        if not low <= number <= high:
            raise ValueError("out of range")
        return number

    return ValueKind(f"an integer from {low} to {high}", f"integer {low}..{high}", parse, str)


def _parse_share(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"expected a number or a string, not {type(value).__name__}")
    try:
        share = float(value)
    except ValueError:
        raise ValueError("not a number") from None
    if not 0.0 <= share <= 1.0:
        raise ValueError("out of range")
    return share


SHARE = ValueKind("a number from 0 to 1 (e.g. 0, 0.5, 1)", "share 0..1", _parse_share, repr)


TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(value: object) -> bool:
    """True or False from a bool or one of 1/0/true/false/yes/no/on/off (any case)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a bool or a string, not {type(value).__name__}")
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("not a boolean")


BOOLEAN = ValueKind(
    "1/0, true/false, yes/no or on/off", "bool", parse_bool, lambda flag: "1" if flag else "0"
)


def _parse_engines(value: object) -> frozenset[str]:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in FALSE_WORDS or text == "":
            return frozenset()
        if text in TRUE_WORDS or text == "all":
            return frozenset(ENGINES)
        names: list[object] = [part.strip() for part in text.split(",") if part.strip()]
    elif isinstance(value, Iterable):
        names = list(value)
    else:
        raise TypeError(f"expected a string or a set of engine names, not {type(value).__name__}")
    unknown = sorted(str(name) for name in names if name not in ENGINES)
    if unknown:
        raise ValueError(f"unknown engine {', '.join(map(repr, unknown))}")
    return frozenset(str(name) for name in names)


ENGINE_SET = ValueKind(
    f"0/false/empty for none, 1/true/all for all, or a comma list of {', '.join(ENGINES)}",
    "engine list",
    _parse_engines,
    lambda engines: ",".join(sorted(engines)) or "0",
)


def _parse_region_staging(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected one of {', '.join(REGION_STAGING_CHOICES)}, not {value!r}")
    word = value.strip().lower()
    if word in FALSE_WORDS:
        return "off"
    if word in TRUE_WORDS:
        return "all"
    if word not in REGION_STAGING_CHOICES:
        raise ValueError("not a choice")
    return word


REGION_STAGING = ValueKind(
    "off (or 0), gather, or all (or 1)", "off/gather/all", _parse_region_staging, str
)


def _parse_level(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a level name, not {type(value).__name__}")
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError("not a logging level")
    return level


LOG_LEVEL = ValueKind(
    f"one of {', '.join(LOG_LEVELS)} (any case)", "logging level", _parse_level, str
)
