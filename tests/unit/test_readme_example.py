"""The README's Python example runs as written, on the CPU, and says what it claims."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_python_api_example_copies_the_rows_it_names() -> None:
    (example,) = _python_blocks()
    printed = io.StringIO()
    scope: dict[str, object] = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(example, str(README), "exec"), scope)
    assert printed.getvalue().strip() in {
        "single_copy",
        "batched_runs",
        "staged",
        "gather",
        "fallback",
    }
    metrics = scope["mover"].metrics.snapshot()  # type: ignore[attr-defined]
    assert [t["count"] for t in metrics["transfers"]] == [1]
