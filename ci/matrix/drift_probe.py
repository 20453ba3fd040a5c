"""Run with a lane venv's python: the version guard's verdict on the installed engine.

    python drift_probe.py ENGINE

Prints JSON: the installed version, whether the adapter tests it, the newest release the
adapter has fingerprints for, and target -> why its source differs from that release.
Sources are read from the installed files; the engine is not imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

from kvcore.engine_status import probe_engine, release_of


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _sglang() -> tuple[list[str], str, dict[str, str]]:
    from kvcore_sglang import guard

    tested = sorted(guard.FINGERPRINTS, key=_release_key)
    newest = tested[-1]
    recorded = guard.FINGERPRINTS[newest]
    dist = importlib.metadata.distribution("sglang")
    changed: dict[str, str] = {}
    groups = {**guard.TARGET_GROUPS, **guard.TRANSFER_GROUPS}
    for target in (t for targets in groups.values() for t in targets if t in recorded):
        module, qualname = guard.split_target(target)
        path = Path(str(dist.locate_file(module.replace(".", "/") + ".py")))
        try:
            actual = guard.fingerprint_in_source(path.read_text(encoding="utf-8"), qualname)
        except (OSError, KeyError, SyntaxError) as exc:
            changed[target] = f"source not readable: {type(exc).__name__}: {exc}"
            continue
        if actual != recorded[target]:
            changed[target] = (
                f"source changed (fingerprint {actual[:12]}, tested {recorded[target][:12]})"
            )
    return tested, newest, changed


def _vllm() -> tuple[list[str], str, dict[str, str]]:
    from kvcore_vllm import guard

    tested = sorted(guard.FINGERPRINTS, key=_release_key)
    newest = tested[-1]
    return tested, newest, guard.refusals(newest)


PROBES = {"sglang": _sglang, "vllm": _vllm}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in PROBES:
        print(f"usage: drift_probe.py {{{','.join(PROBES)}}}", file=sys.stderr)
        return 2
    engine = argv[0]
    tested, newest, changed = PROBES[engine]()
    status = probe_engine(engine, engine, tested, enabled=True)
    print(
        json.dumps(
            {
                "version": release_of(status.version or ""),
                "tested": status.supported,
                "newest_tested": newest,
                "changed": changed,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
