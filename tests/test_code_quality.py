"""The tooling gates of docs/style.md, run by the test command: ruff everywhere, mypy strict on app/ and statemachine/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "ruff", "check", "."],
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        # strictness comes from pyproject.toml; the packages are named here so that the
        # gate cannot narrow by an edit of its [tool.mypy] files
        [sys.executable, "-m", "mypy", "statemachine", "app"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_tool_passes(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


MAX_LINES = 400  # docs/style.md: a module that grows past this is split by concern in the same change
SIZED = ("app", "statemachine", "ops")


@pytest.mark.parametrize("package", SIZED)
def test_modules_stay_small(package: str) -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in (ROOT / package).rglob("*.py")
    }
    assert sizes, f"no modules under {package}/"
    over = {name: lines for name, lines in sorted(sizes.items()) if lines > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines (split them by concern): {over}"
