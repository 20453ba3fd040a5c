"""Which reloads kvcore would serve go to the engine's own copy instead (``KVCORE_STOCK_SHARE``).

An A/B of the two copies inside one engine process: each reload kvcore would serve is drawn
for the engine's copy with the configured probability, and passed as :data:`REASON`. The
draws come from a seeded generator, so that two runs of one trace draw the same reloads.
"""

from __future__ import annotations

import random

REASON = "stock_share"
"""The pass reason a drawn reload is counted under."""


class StockShare:
    """Draws for one stream of reloads (a vLLM handler's loads, SGLang's load-backs)."""

    def __init__(self, share: float, seed: int = 0) -> None:
        self.share = share
        self._draws = random.Random(seed)

    def drawn(self) -> bool:
        """Whether the next reload kvcore would serve goes to the engine's copy; no draw
        where the share is 0."""
        return bool(self.share) and self._draws.random() < self.share
