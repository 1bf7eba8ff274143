"""The gates of docs/style.md, run by the test command: ruff everywhere, mypy strict on app/ and
statemachine/, the size of modules, and no history or measured figures in the code."""

from __future__ import annotations

import ast
import re
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


# docs/style.md: a module that grows past its package's cap is split by concern in the same change
MAX_LINES = {"app": 350, "statemachine": 350, "ops": 400}


@pytest.mark.parametrize("package", sorted(MAX_LINES))
def test_modules_stay_small(package: str) -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in (ROOT / package).rglob("*.py")
    }
    assert sizes, f"no modules under {package}/"
    cap = MAX_LINES[package]
    over = {name: lines for name, lines in sorted(sizes.items()) if lines > cap}
    assert over == {}, f"modules over {cap} lines (split them by concern): {over}"


MAX_FUNCTION_LINES = 80  # docs/style.md: a function reads top to bottom; nested functions count in their parent


def test_functions_stay_short() -> None:
    long = {}
    for package in ("app", "statemachine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long[f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines (split them by what they do): {long}"


def test_no_two_classes_share_a_name() -> None:
    # docs/style.md: a name says which class it is, wherever it is read; nested classes count
    found: dict[str, list[str]] = {}
    for package in ("app", "statemachine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert len(found) > 100, "the packages moved: this test reads nothing"
    assert {name: where for name, where in found.items() if len(where) > 1} == {}


# History a reader cannot look up: an issue's number, or the name of a CI run ("ci" and its
# number). The reason itself belongs in the comment.
HISTORY = re.compile(r"\b[Ii]ssues?[ -]#?\d+|\b[Ii]ssue#\d+|\bci\d+\b")
HISTORY_FREE = ("app", "statemachine", "ops", "tests", "migrations")
# A measured figure in a product comment goes stale: docs/performance.md holds figures, and
# the comment points there. Units that only a measurement gives (microseconds, CPU per
# tokens, requests a second, an A/B run).
FIGURE = re.compile(
    r"\d[\d.,]*\s?(?:µs|μs|us a\b)|(?:CPU )?s per 1,?000 tokens|per 1k tokens|req/s|requests a second|\bA/B\b"
)
FIGURE_FREE = ("app", "statemachine")
SOURCE_SUFFIXES = {".py", ".yml", ".yaml", ".sql", ".toml"}


def _sources(packages: tuple[str, ...]) -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for package in packages
        for path in sorted((ROOT / package).rglob("*"))
        if path.is_file()
        and path.suffix in {".py", ".yml", ".yaml", ".sql", ".toml"}
        and "__pycache__" not in path.parts
    }


def _hits(pattern: re.Pattern[str], sources: dict[str, str]) -> list[str]:
    return [
        f"{name}:{number}: {line.strip()}"
        for name, text in sources.items()
        for number, line in enumerate(text.splitlines(), start=1)
        if pattern.search(line)
    ]


def test_no_issue_numbers_or_ci_run_names_in_code_or_tests() -> None:
    sources = _sources(HISTORY_FREE)
    assert len(sources) > 100, "the packages moved: this test reads nothing"
    assert _hits(HISTORY, sources) == []


def test_no_measured_figures_in_product_comments() -> None:
    assert _hits(FIGURE, _sources(FIGURE_FREE)) == []


def test_the_history_and_figure_patterns_catch_what_they_are_for() -> None:
    # the lines are spelled in pieces so that the scan above does not find them here
    caught = ("# see issue" + " 18", "(Issue" + " 32, item 3)", "seen in c" + "i19", "issues" + " 11 and 14")
    for line in (*caught, "the issue" + "-12 bench"):
        assert HISTORY.search(line), line
    for line in ("# not a race: the circuit", "uses ci.yml", "a decision", "issue a cancel"):
        assert not HISTORY.search(line), line
    for line in ("about 3 µs a state", "0.073 against 0.075 CPU s per 1,000 tokens", "A/B at 100 streams", "420 req/s"):
        assert FIGURE.search(line), line
    assert not FIGURE.search("delivery_batch_ms = 25  # the batch's age limit")
