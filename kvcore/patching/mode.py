"""Whether a patched engine build runs kvcore's hooks: one rule for every adapter.

A patched source calls its adapter at import, before any plugin loads, so the choice is
read from the environment alone: on unless ``KVCORE_ENABLE`` is set and leaves the engine
out (``KVCORE_ENABLE=0`` turns every engine off), or a ``KVCORE_*`` variable is bad (which
:func:`kvcore.config.engine_config` logs once, naming it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvcore.config import engine_config


def patched_mode_enabled(label: str, engine: str, environ: Mapping[str, str] | None = None) -> bool:
    """For the engine ``engine`` (``label`` is how logs name it): whether its patched
    build's hooks run."""
    env = os.environ if environ is None else environ
    if not env.get("KVCORE_ENABLE", ""):
        return True
    config = engine_config(label, env)
    return config is not None and config.enabled_for(engine)
