"""SGLang's own settings for how it obtains its host pools, which kvcore's host memory hook
(:mod:`kvcore_sglang.host_memory`) leaves to SGLang. Torch-free: ``kvcore launch`` reads
them before SGLang starts."""

from __future__ import annotations

import os
from collections.abc import Mapping

SGLANG_CHOICES = ("SGLANG_HUGEPAGE_SIZE", "SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS")
"""SGLang's own settings for its host allocation; either set leaves the allocation SGLang's."""


def sglang_choice(environ: Mapping[str, str] | None = None) -> str | None:
    """The SGLang setting that asks for SGLang's own host allocation, or None."""
    env = os.environ if environ is None else environ
    for name in SGLANG_CHOICES:
        value = env.get(name, "").strip()
        if value and value != "0":
            return name
    return None
