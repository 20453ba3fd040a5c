"""No module of the product, the adapters, the benchmarks or the scripts grows past 500
lines: a module that large holds more than one job (issue 47's limit)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    modules = [
        path
        for folder in ("kvcore", "integrations", "benchmarks", "scripts", "ci")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    assert len(modules) > 100
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not too_long, too_long
