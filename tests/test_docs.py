"""docs/design.md is the design the code cites: every ``docs/design.md §N`` in the code, tests
and documents names one of its sections, each section names tests that exist, and nothing
cites a design or style guide kept outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
CITING = ("app", "statemachine", "ops", "migrations", "tests", "docs", "deploy", "README.md")
SECTIONS = range(1, 18)

# A citation and what follows it: "§11", "§11-12", "§1–5", "§3, §14", "§10, 3" (case 3 of §10).
CITATION = re.compile(r"docs/design\.md (§\d+(?:\s*[-–]\s*§?\d+)?(?:, §\d+(?:\s*[-–]\s*§?\d+)?)*)")
# Spelled in pieces, so that this file does not cite what it forbids.
FORBIDDEN = re.compile("|".join([r"\bDESIGN" + r"\.md", r"\bSTYLE" + r"\.md", r"\bDESIGN §", r"\.\./" + "shared"]))


def texts() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in CITING:
        top = ROOT / name
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                found[path.relative_to(ROOT).as_posix()] = path.read_text()
            except UnicodeDecodeError:
                continue  # a binary file cites nothing
    return found


def cited(citation: str) -> set[int]:
    numbers: set[int] = set()
    for part in citation.split(", "):
        first, _, last = re.sub(r"\s", "", part).lstrip("§").replace("–", "-").partition("-")
        numbers.update(range(int(first), int(last.lstrip("§") or first) + 1))
    return numbers


def design_sections() -> dict[int, str]:
    parts = re.split(r"^## §(\d+) ", DESIGN.read_text(), flags=re.M)
    return {int(number): text for number, text in zip(parts[1::2], parts[2::2], strict=True)}


def test_the_design_has_every_section_once_in_order() -> None:
    headings = re.findall(r"^## §(\d+) ", DESIGN.read_text(), flags=re.M)
    assert [int(number) for number in headings] == list(SECTIONS)


def test_every_citation_names_a_section_that_exists() -> None:
    sections = set(design_sections())
    citations = {
        f"{name}: {match.group(0)}": cited(match.group(1))
        for name, text in texts().items()
        for match in CITATION.finditer(text)
    }
    assert len(citations) > 100, "the code cites the design far more than this: the pattern broke"
    missing = {where: sorted(numbers - sections) for where, numbers in citations.items() if numbers - sections}
    assert missing == {}


def test_nothing_cites_a_design_outside_the_repository() -> None:
    outside = {
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}": match.group(0)
        for name, text in texts().items()
        for match in FORBIDDEN.finditer(text)
    }
    assert outside == {}


@pytest.mark.parametrize("number", SECTIONS)
def test_each_section_names_tests_that_exist(number: int) -> None:
    named = re.findall(r"`(tests/[\w/]+\.py)`", design_sections()[number])
    assert named, f"§{number} names no test"
    assert [path for path in named if not (ROOT / path).is_file()] == []


def test_the_readme_names_the_design_and_the_style() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/design.md)" in readme and "(docs/style.md)" in readme
