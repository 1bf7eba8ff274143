"""A run of a few tests prints no coverage table (a few tests' coverage of all of app/ reads
as a failure) and still writes the data; the full run's table and .ci/run's gates are
unchanged (tests/conftest.py, ``partial_run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_partial_run_prints_no_coverage_table_and_keeps_the_data(tmp_path: Path) -> None:
    data = tmp_path / ".coverage"
    env = {**os.environ, "COVERAGE_FILE": str(data), "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "-q",
        "tests/statemachine/test_purity.py",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "Cover" not in done.stdout and "0.0%" not in done.stdout, done.stdout[-2000:]
    assert "a partial run prints no table" in done.stdout
    assert data.exists()  # `coverage report` reads it
