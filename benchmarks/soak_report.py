"""What a soak run (:mod:`benchmarks.soak`) counts and the accounting it ends with.

A soak drives engine-shaped traffic through an adapter's hooks for minutes and then
compares the state kvcore and the engine keep against a baseline taken before the
traffic. Each compared item says how it was read: ``public`` (an API of kvcore, the
engine or torch) or ``private`` (an attribute read as it is, nothing added to product
code). ``exact`` items must equal their baseline; ``bounded`` items are caches that keep
entries by design and must stay within their bound. What cannot be read is listed under
``not_checked`` with the reason, never silently passed. An item read as ``observed`` is
reported with its baseline and end but not judged: a counter that moves without anything
kvcore holds (:data:`OBSERVED_WHY` says why for each), beside exact items that do judge
what it would show.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OBSERVED = "observed"
"""The read of an item reported but not judged."""

OBSERVED_WHY = {
    "pinned_host_in_use": (
        "torch's pinned allocator keeps counting pinned blocks that nothing holds once a "
        "stream used them (docs/soak.md, scripts/pinned_growth_probe.py); the pinned "
        "tensors alive and kvcore's index ring are judged exactly instead"
    ),
}


@dataclass(frozen=True)
class Item:
    """One accounting comparison."""

    name: str
    baseline: Any
    end: Any
    read: str
    """``public`` or ``private``: how the value was read."""
    bound: int | None = None
    """For a cache that keeps entries by design: the most it may hold at the end."""
    note: str = ""

    @property
    def ok(self) -> bool:
        if self.bound is not None:
            return isinstance(self.end, int) and self.end <= self.bound
        return bool(self.baseline == self.end)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "baseline": self.baseline,
            "end": self.end,
            "equal": self.baseline == self.end,
            "ok": self.ok,
            "read": self.read,
        }
        if self.bound is not None:
            out["bound"] = self.bound
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class Accounting:
    """The end-of-run comparisons, and what could not be compared."""

    items: list[Item] = field(default_factory=list)
    not_checked: dict[str, str] = field(default_factory=dict)
    observed: list[Item] = field(default_factory=list)
    """Reported, not judged (:data:`OBSERVED`)."""

    def exact(self, name: str, baseline: Any, end: Any, read: str, note: str = "") -> None:
        self.items.append(Item(name, baseline, end, read, None, note))

    def bounded(
        self, name: str, baseline: Any, end: int, bound: int, read: str, note: str = ""
    ) -> None:
        self.items.append(Item(name, baseline, end, read, bound, note))

    def skip(self, name: str, why: str) -> None:
        self.not_checked[name] = why

    def compare(
        self,
        baseline: dict[str, Any],
        end: dict[str, Any],
        reads: dict[str, str],
        unreadable: str = "unreadable at the baseline or at the end",
    ) -> None:
        """Every key of ``baseline`` against ``end``, exact; a value of None on either side
        means the state could not be read there (``unreadable`` says why)."""
        for name, before in baseline.items():
            after = end.get(name)
            if before is None or after is None:
                self.skip(name, unreadable)
                continue
            read = reads.get(name, "public")
            if read == OBSERVED:
                self.observed.append(Item(name, before, after, read, None, OBSERVED_WHY[name]))
                continue
            self.exact(name, before, after, read)

    @property
    def leaks(self) -> int:
        return sum(not item.ok for item in self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": [item.to_dict() for item in self.items],
            "not_checked": dict(self.not_checked),
            "observed": [item.to_dict() | {"ok": None} for item in self.observed],
        }


@dataclass
class Tally:
    """Counters several threads add to."""

    loads: int = 0
    """Reload requests (SGLang: every layer of a prefix) or load jobs (vLLM)."""
    load_calls: int = 0
    """Calls into the adapter for loads: one per layer (SGLang), one per job (vLLM)."""
    backups: int = 0
    """Backups (SGLang: one all-layer call) or store jobs (vLLM)."""
    loaded_bytes: int = 0
    backed_up_bytes: int = 0
    reloads_checked: int = 0
    backups_verified: int = 0
    """Backups whose bytes a later reload read back and compared."""
    mismatched_bytes: int = 0
    """Reloaded bytes that differ from what was backed up."""
    stray_bytes: int = 0
    """Bytes outside every copy's destination that changed (rows not named)."""
    checkpoints: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return {name: value for name, value in vars(self).items() if not name.startswith("_")}


def kvcore_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What kvcore's metrics counted between two snapshots: submissions per path, passes
    and fallbacks per reason, serve/pass decisions."""
    seen = {(t["direction"], t["path"]): t for t in before["transfers"]}
    paths: dict[str, dict[str, int]] = {}
    for t in after["transfers"]:
        old = seen.get((t["direction"], t["path"]), {"count": 0, "bytes": 0})
        count, nbytes = t["count"] - old["count"], t["bytes"] - old["bytes"]
        if count:
            paths[f"{t['direction']}/{t['path']}"] = {"submissions": count, "bytes": nbytes}
    fallbacks = {
        reason: count - before["fallbacks"].get(reason, 0)
        for reason, count in after["fallbacks"].items()
        if count > before["fallbacks"].get(reason, 0)
    }
    old_decisions = {(d["decision"], d["reason"]): d["count"] for d in before["decisions"]}
    decisions = {
        f"{d['decision']}:{d['reason']}": d["count"]
        - old_decisions.get((d["decision"], d["reason"]), 0)
        for d in after["decisions"]
        if d["count"] > old_decisions.get((d["decision"], d["reason"]), 0)
    }
    return {"paths": paths, "fallbacks": fallbacks, "decisions": decisions}


def document(
    *,
    engine: str,
    device: str,
    seconds_requested: float,
    seconds: float,
    tally: Tally,
    accounting: Accounting,
    errors: Sequence[str],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The run's JSON document; ``ok`` only with no mismatch, no leak and no error."""
    counts = tally.to_dict()
    mismatches = counts["mismatched_bytes"] + counts["stray_bytes"]
    return {
        "engine": engine,
        "device": device,
        "seconds_requested": seconds_requested,
        "seconds": round(seconds, 3),
        "calls": {
            "loads": counts["loads"],
            "load_calls": counts["load_calls"],
            "backups": counts["backups"],
            "jobs": counts["loads"] + counts["backups"],
        },
        "bytes": {
            "loaded": counts["loaded_bytes"],
            "backed_up": counts["backed_up_bytes"],
            "total": counts["loaded_bytes"] + counts["backed_up_bytes"],
        },
        "reloads_checked": counts["reloads_checked"],
        "backups_verified": counts["backups_verified"],
        "checkpoints": counts["checkpoints"],
        "mismatched_bytes": counts["mismatched_bytes"],
        "stray_bytes": counts["stray_bytes"],
        "mismatches": mismatches,
        "leaks": accounting.leaks,
        "accounting": accounting.to_dict(),
        "errors": list(errors),
        "ok": mismatches == 0 and accounting.leaks == 0 and not errors,
        **extra,
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
        fh.write("\n")


def summary_line(doc: dict[str, Any]) -> str:
    calls, nbytes = doc["calls"], doc["bytes"]
    return (
        f"soak {doc['engine']} on {doc['device']}: {doc['seconds']:.0f} s, "
        f"{calls['loads']} loads ({calls['load_calls']} calls), {calls['backups']} backups, "
        f"{nbytes['total'] / 1e9:.2f} GB moved, {doc['reloads_checked']} reloads checked, "
        f"mismatched bytes {doc['mismatched_bytes']}, stray bytes {doc['stray_bytes']}, "
        f"leaks {doc['leaks']} (of {len(doc['accounting']['items'])} items, "
        f"{len(doc['accounting']['not_checked'])} not checked, "
        f"{len(doc['accounting'].get('observed', []))} observed), errors {len(doc['errors'])}: "
        f"{'OK' if doc['ok'] else 'FAILED'}"
    )
