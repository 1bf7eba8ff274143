"""``phasegate sql`` against the embedded default, as root and as a user of its own (made
here, as the embedded server makes its own): docs/audit.md's numbered queries by number or
slug, with variables, and a tenant's view under the analysts' row-level security."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from app.store.embedded import EmbeddedPostgres
from app.store.sql_command import audit_queries, slug, variables

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "tests" / "traces" / "retry_before_first_delta.jsonl"  # req_retried, tenant "default"
USER = "phasegate-sql-test"


def reaches(user: str, path: str) -> bool:
    """Whether ``user`` can read ``path`` (every directory above it entered)."""
    return subprocess.run(["runuser", "-u", user, "--", "test", "-r", path], check=False).returncode == 0


def skip_where_the_user_cannot_reach_this_checkout(user: str) -> None:
    """A checkout (or its packages) under a directory the user cannot enter (root's mode-0700
    home) has no code that user can run: the test cannot run it as that user there."""
    for path in (str(ROOT / "app" / "cli.py"), asyncpg.__file__ or ""):
        if not reaches(user, path):
            pytest.skip(f"{path} sits where {user} cannot go (a mode-0700 directory above it)")


def phasegate(data_dir: Path, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PHASEGATE_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    env.pop("DATABASE_URL", None)
    command = [sys.executable, "-m", "app.cli", *args]
    if user is not None:
        home = pwd.getpwnam(user).pw_dir
        if subprocess.run(["runuser", "-u", user, "--", "test", "-x", sys.executable], check=False).returncode:
            # this interpreter sits where the user cannot go (pyenv under root's home): the
            # system's Python of the same minor version, with this one's packages
            assert shutil.which("python3") and sys.version_info[:2] == (3, 11), "no interpreter for the user"
            env["PYTHONPATH"] += os.pathsep + sysconfig.get_paths()["purelib"]
            command[0] = "/usr/bin/python3"
        command = ["runuser", "-u", user, "--", "env", f"HOME={home}", *command]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd="/", check=False)


def stopped(data_dir: Path) -> None:
    server = EmbeddedPostgres(data_dir)
    if server.is_running():
        server.restart()
        server.stop()


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="phasegate-sql-"))
    path.chmod(0o755)
    yield path
    stopped(path)
    shutil.rmtree(path, ignore_errors=True)


def test_every_numbered_query_has_a_slug_of_its_own() -> None:
    queries = audit_queries()
    assert len(queries) >= 20 and len({name for name, _, _ in queries.values()}) == len(queries)
    assert queries[1][0] == slug("Requests that were retried, and on which replicas")
    assert variables(queries[1][2]) == [] and variables(queries[4][2]) == ["request_id"]


def test_a_query_without_the_variables_it_takes_says_which_before_any_database_is_touched(tmp_path: Path) -> None:
    listed = phasegate(tmp_path, "sql", "--list")
    assert listed.returncode == 0
    line = next(line for line in listed.stdout.splitlines() if line.split()[0] == "4")
    assert line.endswith("--var request_id=…")
    refused = phasegate(tmp_path, "sql", "--query", "4")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip() == (
        "phasegate sql: query 4 (The whole answer one client saw, and how its stream ended) takes --var request_id=…"
    )
    assert not (tmp_path / "pgdata").exists()  # refused before the embedded server was started


@pytest.mark.skipif(os.geteuid() != 0, reason="the embedded server runs as its own user only under root")
def test_sql_as_root_on_the_embedded_default(data_dir: Path) -> None:
    assert phasegate(data_dir, "db", "upgrade").returncode == 0
    assert phasegate(data_dir, "trace", "import", str(TRACE)).returncode == 0
    listed = phasegate(data_dir, "sql", "--list")
    assert listed.returncode == 0 and "requests-that-were-retried-and-on-which-replicas" in listed.stdout
    by_number = phasegate(data_dir, "sql", "--query", "1")
    assert by_number.returncode == 0 and "req_retried" in by_number.stdout, by_number.stderr
    by_slug = phasegate(
        data_dir, "sql", "--query", "exactly-what-one-client-received-delta-by-delta", "--var", "request_id=req_retried"
    )
    assert by_slug.returncode == 0 and "(0 rows)" not in by_slug.stdout, by_slug.stdout + by_slug.stderr
    assert "req_retried" in phasegate(data_dir, "sql", "--tenant", "default", "--query", "1").stdout
    other = phasegate(data_dir, "sql", "--tenant", "someone-else", "--query", "1")
    assert other.returncode == 0 and "(0 rows)" in other.stdout and "req_retried" not in other.stdout
    who = phasegate(data_dir, "sql", "--tenant", "someone-else", "-c", "SELECT current_user")
    assert "phasegate_tenant_someone_else_" in who.stdout
    broken = phasegate(data_dir, "sql", "-c", "SELECT no_such_column FROM requests")
    assert broken.returncode != 0 and "no_such_column" in broken.stderr
    assert phasegate(data_dir, "sql", "--query", "no-such-query").returncode != 0


@pytest.fixture
def user() -> str:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True, capture_output=True)
    return USER


@pytest.mark.skipif(os.geteuid() != 0, reason="a user of its own is made as root")
def test_sql_as_a_user_that_is_not_root(user: str) -> None:
    """The user's embedded server in its own data directory (the default one, under its home)."""
    skip_where_the_user_cannot_reach_this_checkout(user)
    home = Path(pwd.getpwnam(user).pw_dir)
    data_dir = home / ".local" / "share" / "phasegate"
    try:
        upgraded = phasegate(data_dir, "db", "upgrade", user=user)
        assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
        answered = phasegate(data_dir, "sql", "--query", "11", user=user)
        assert answered.returncode == 0 and "(0 rows)" in answered.stdout, answered.stdout + answered.stderr
        owner = subprocess.run(["stat", "-c", "%U", str(data_dir / "pgdata")], capture_output=True, text=True)
        assert owner.stdout.strip() == user  # its own server, not root's
    finally:
        stopper = phasegate(data_dir, "sql", "-c", "SELECT 1", user=user)  # starts and stops: nothing left running
        assert stopper.returncode == 0
