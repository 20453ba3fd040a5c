"""The server's ``/metrics`` page as the live trace (``scripts/live_trace.py``) reads it.

The page is read before and after each sequential request, so that each request carries
what the offload tier moved for it (and kvcore's counters), which a whole run's totals
cannot tell apart by request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Counters read from /metrics around each sequential request; a name matches by prefix.
COUNTED_PREFIXES = ("vllm:kv_offload_", "kvcore_", "vllm:prefix_cache_", "vllm:prompt_tokens")
LOAD_BYTES = "vllm:kv_offload_load_bytes"
LOAD_TIME = "vllm:kv_offload_load_time"
# The load-size histogram's sample count: the load jobs the tier ran for the request.
LOAD_JOBS = "vllm:kv_offload_load_size_count"
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
GAUGE_LINE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) gauge\s*$")


def parse_metrics(text: str) -> dict[str, float]:
    """Counted series of a Prometheus text page, by name: counters and histograms summed over
    label sets (each engine process adds its own); a gauge (``# TYPE ... gauge``, such as a
    share per process) its lowest value, since a sum of shares is no share."""
    totals: dict[str, float] = {}
    gauges: set[str] = set()
    for line in text.splitlines():
        declared = GAUGE_LINE.match(line)
        if declared is not None:
            gauges.add(declared.group(1))
            continue
        match = SAMPLE_LINE.match(line)
        if match is None or not match.group(1).startswith(COUNTED_PREFIXES):
            continue
        name = match.group(1)
        if name.endswith(("_bucket", "_created")):
            continue
        for suffix in ("_total", "_sum"):
            name = name.removesuffix(suffix)
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if name in gauges and name in totals:
            totals[name] = min(totals[name], value)
        else:
            totals[name] = totals.get(name, 0.0) + value
    return totals


def difference(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
