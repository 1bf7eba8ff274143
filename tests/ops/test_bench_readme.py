"""ops/bench/README.md indexes the benches as they are: every script under ops/bench/ is in
it (a lasting benchmark, a shared part, or a study under studies/), every script it names
exists, and each command it gives runs that script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ops" / "bench"
README = BENCH / "README.md"


def scripts() -> set[str]:
    return {path.relative_to(BENCH).as_posix() for path in BENCH.rglob("*.py") if "__pycache__" not in path.parts}


def test_every_script_is_indexed_and_every_indexed_script_exists() -> None:
    text = README.read_text()
    named = set(re.findall(r"`((?:studies/)?\w+\.py)`", text))
    assert scripts() - named == set(), "scripts under ops/bench/ that the README does not name"
    assert named - scripts() == set(), "scripts the README names that are not there"


def test_studies_are_apart_and_each_command_runs_its_own_script() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    assert rows, "the README's tables moved"
    for line in rows:
        script = re.match(r"\| `((?:studies/)?\w+\.py)`", line)
        assert script is not None, line
        module = "ops.bench." + script.group(1).removesuffix(".py").replace("/", ".")
        path = "ops/bench/" + script.group(1)
        assert f"python {path}" in line or f"python -m {module}" in line, line
    assert all(path.startswith("studies/") or "/" not in path for path in scripts())
