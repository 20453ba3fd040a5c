"""An engine's command line, read without the engine's parser, for ``kvcore launch``'s checks.

kvcore does not know every flag an engine takes, so it cannot parse the whole line;
it only looks for the few flags that decide whether its hooks act. Flags are
``--name value`` or ``--name=value``; an underscore in a name reads as a dash, as
vLLM's parser allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _name(arg: str) -> str:
    # Only up to the first "." or "=": vLLM's dotted keys keep their underscores.
    end = min((i for i in (arg.find("="), arg.find(".")) if i >= 0), default=len(arg))
    return "--" + arg[2:end].replace("_", "-") + arg[end:]


@dataclass(frozen=True)
class EngineArgs:
    """The arguments kvcore would pass to an engine."""

    args: tuple[str, ...]

    @classmethod
    def of(cls, args: Sequence[str]) -> EngineArgs:
        return cls(tuple(_name(a) if a.startswith("--") else a for a in args))

    def has(self, *flags: str) -> bool:
        """Whether any of ``flags`` is given, alone or with ``=value``."""
        return any(a.partition("=")[0] in flags for a in self.args)

    def value(self, flag: str) -> str | None:
        """The value of the last ``flag``; None when it is absent or has no value."""
        found = None
        for i, arg in enumerate(self.args):
            name, has_value, text = arg.partition("=")
            if name != flag:
                continue
            if has_value:
                found = text
            elif i + 1 < len(self.args):
                found = self.args[i + 1]
        return found

    def dotted(self, flag: str) -> list[tuple[list[str], str]]:
        """``--flag.a.b value`` (or ``=value``) as ``(["a", "b"], "value")``, in order."""
        prefix = flag + "."
        found = []
        for i, arg in enumerate(self.args):
            if not arg.startswith(prefix):
                continue
            keys, has_value, text = arg[len(prefix) :].partition("=")
            if not has_value and i + 1 < len(self.args):
                text = self.args[i + 1]
            found.append((keys.split("."), text))
        return found

    @property
    def command(self) -> str | None:
        """The first argument when it is a word, not a flag (vLLM's ``serve``)."""
        return self.args[0] if self.args and not self.args[0].startswith("-") else None

    @property
    def opaque(self) -> bool:
        """Whether what the engine will do cannot be told from these arguments: it is asked
        for help or its version, or reads more flags from a ``--config`` file."""
        return self.has("--config", "--help", "--version") or "-h" in self.args
