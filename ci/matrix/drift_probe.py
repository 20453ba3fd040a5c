"""Run with a lane venv's python: the version guard's verdict on the installed engine.

    python drift_probe.py ENGINE

Prints JSON: the installed version, whether the adapter tests it, the newest release the
adapter has fingerprints for, and target -> why its source differs from that release.
Sources are read from the installed files; the engine is not imported.
"""

from __future__ import annotations

import json
import sys

from kvcore.engine_status import probe_engine, release_of


def _sglang() -> tuple[list[str], str, dict[str, str]]:
    from kvcore_sglang import guard

    # Oldest first, as the guard reads its fingerprint files.
    tested = list(guard.FINGERPRINTS)
    newest = tested[-1]
    return tested, newest, guard.source_changes(newest)


def _vllm() -> tuple[list[str], str, dict[str, str]]:
    from kvcore_vllm import guard

    # Oldest first, as the guard reads its fingerprint files.
    tested = list(guard.FINGERPRINTS)
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
