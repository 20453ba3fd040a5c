"""One request of the live trace (``scripts/live_trace.py``) as its report keeps it.

A report stores each sequential request as this record's fields (``dataclasses.asdict``),
so that ``combine`` and ``attribute`` can rebuild the records and count the hits again
from a saved report, with no server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.vllm.live_trace_metrics import LOAD_BYTES


@dataclass
class Result:
    conversation: int
    first_turn_tokens: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    total_s: float
    output: list[int]
    counted: dict[str, float] = field(default_factory=dict)
    """Change of each counted /metrics series over the request (sequential pass only)."""
    copies: list[str] = field(default_factory=list)
    """The copy each of the request's load jobs got, from the server's A/B log lines
    (``run --ab-log``; sequential pass only): ``kvcore``, ``stock_share`` (stock's, drawn),
    or the reason kvcore's rule passed it."""

    @property
    def cpu_tier_hit(self) -> bool:
        """A later turn whose conversation came back from the CPU tier (a first turn may
        load only a shared system prompt from there: that is not its conversation's)."""
        return self.turn > 0 and self.counted.get(LOAD_BYTES, 0.0) > 0


def sizes(results: Sequence[Result]) -> list[int]:
    """The first-turn sizes the results hold, smallest first."""
    return sorted({r.first_turn_tokens for r in results})


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
