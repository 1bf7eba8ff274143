"""The embedded default's admin token: kept in its data directory (mode 0600), the same at
every start, replaced by ``phasegate admin-token --rotate``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from app.store.admin_token import stable_admin_token, token_file

ROOT = Path(__file__).resolve().parents[3]


def command(data_dir: Path, *args: str) -> str:
    env = {**os.environ, "PHASEGATE_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "admin-token", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_token_is_kept_private_and_stable_until_rotated(tmp_path: Path) -> None:
    first = stable_admin_token(tmp_path)
    path = token_file(tmp_path)
    assert len(first) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stable_admin_token(tmp_path) == first == command(tmp_path)  # every start, and the command, the same
    path.chmod(0o644)  # restored from a backup with looser permissions
    assert stable_admin_token(tmp_path) == first and stat.S_IMODE(path.stat().st_mode) == 0o600
    rotated = command(tmp_path, "--rotate")
    assert rotated != first and stable_admin_token(tmp_path) == rotated == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.with_name("admin-token.new").exists()
