"""What kvcore did between two snapshots of its metrics (:meth:`kvcore.metrics.Metrics.snapshot`):
the mover paths that submitted, its submissions and passes per request."""

from __future__ import annotations

from typing import Any


def served_per_request(
    before: dict[str, Any], after: dict[str, Any], requests: int
) -> tuple[float, dict[str, float]]:
    """kvcore's own submissions and its passes per request, from its metrics."""
    seen = {(t["direction"], t["path"]): t["count"] for t in before["transfers"]}
    submissions = sum(
        t["count"] - seen.get((t["direction"], t["path"]), 0) for t in after["transfers"]
    )
    passes = {
        reason: (count - before["fallbacks"].get(reason, 0)) / requests
        for reason, count in after["fallbacks"].items()
        if count > before["fallbacks"].get(reason, 0)
    }
    return submissions / requests, passes


def paths_taken(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """kvcore's mover paths that submitted anything between two snapshots of its metrics."""
    seen = {(t["direction"], t["path"]): t["count"] for t in before["transfers"]}
    return sorted(
        {
            t["path"]
            for t in after["transfers"]
            if t["count"] > seen.get((t["direction"], t["path"]), 0)
        }
    )
