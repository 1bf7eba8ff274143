"""docs/incidents.md shows commands that work: each ``$ phasegate …`` line of its console
blocks runs, in order, on one fresh database, and prints the lines shown under it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.app.incident.conftest import Runner

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "incidents.md"


def console_steps() -> list[tuple[list[str], list[str]]]:
    """(argv, expected lines) for every command of the doc's ```console blocks."""
    steps: list[tuple[list[str], list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", DOC.read_text(), flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                argv = shlex.split(line[2:])
                assert argv[0] == "phasegate", line
                steps.append((argv[1:], []))
            else:
                steps[-1][1].append(line)
    return steps


def test_the_doc_has_console_examples() -> None:
    assert len(console_steps()) >= 8


def test_every_command_of_the_doc_prints_what_it_shows(phasegate: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    for argv, expected in console_steps():
        ran = phasegate(*argv)
        printed = (ran.out + ran.err).splitlines()
        for line in expected:
            if line.endswith("…"):  # a line shown in part
                assert any(p.startswith(line[:-1]) for p in printed), f"{argv}: {line!r} not in {printed}"
            else:
                assert line in printed, f"{argv}: {line!r} not in {printed}"
        assert ran.status in (0, 1, 2)
        if any("nothing was imported" in line for line in expected):
            assert ran.status == 2
        elif any(line.startswith(("first divergence", "diverged: 1")) for line in expected):
            assert ran.status == 1
        else:
            assert ran.status == 0, ran.err
