"""Documentation that must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from kvcore.config import settings_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_operations_settings_table_is_generated_from_the_config() -> None:
    assert settings_markdown() in (ROOT / "docs" / "operations.md").read_text()


def test_readme_has_two_setup_commands_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("##", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", quickstart, flags=re.S)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    install, tests = commands
    assert "kvcore bench --quick" in install
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci
    assert install.split(" && ")[0] in ci
