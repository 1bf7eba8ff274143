"""A start waits for the log's PostgreSQL (app/store/reach.py), against the real server:
one that begins to listen while the start waits is reached; one that never answers, or
refuses what waiting cannot mend, ends the start with one line naming the database and
why, never its password; ``phasegate serve`` prints that line and exits with 1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from app.store.reach import DatabaseUnreachable, wait_for_database
from ops.processes import REPO, free_port

PASSWORD = "s3cret-password-never-printed"


@contextlib.asynccontextmanager
async def forwarder(socket_path: Path, target: Path) -> AsyncIterator[None]:
    """A unix socket at ``socket_path`` whose connections go on to the server's ``target``."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def accept(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_unix_connection(target)
        await asyncio.gather(pump(client_reader, server_writer), pump(server_reader, client_writer))

    server = await asyncio.start_unix_server(accept, socket_path)
    try:
        yield
    finally:
        server.close()


async def test_a_database_that_begins_to_listen_while_the_start_waits_is_reached(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = make_url(database_url)
    (socket,) = (path for path in Path(str(real.query["host"])).glob(".s.PGSQL.*") if path.is_socket())
    with tempfile.TemporaryDirectory(prefix="pg-later-") as later:  # short: a socket path has 107 bytes
        url = real.update_query_dict({"host": later}).render_as_string(hide_password=False)
        waiting = asyncio.create_task(wait_for_database(url, wait_s=60))
        started = time.monotonic()
        await asyncio.sleep(1.5)
        assert not waiting.done()  # nothing listens there yet
        async with forwarder(Path(later) / socket.name, socket):
            with caplog.at_level(logging.WARNING, "phasegate.store"):
                await asyncio.wait_for(waiting, 30)
    assert time.monotonic() - started >= 1.5
    said = [record.getMessage() for record in caplog.records]
    assert any("does not answer yet" in line and later in line for line in said), said
    assert any("answers after" in line for line in said), said


async def test_a_server_that_never_answers_ends_the_wait_naming_it_without_its_password() -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql://phasegate:{PASSWORD}@127.0.0.1:{port}/phasegate"
    started = time.monotonic()
    with pytest.raises(DatabaseUnreachable) as caught:
        await wait_for_database(url, wait_s=1.0)
    assert time.monotonic() - started >= 1.0
    message = str(caught.value)
    assert message.startswith(f"the log's PostgreSQL at 127.0.0.1:{port}/phasegate did not answer within 1 s: ")
    assert PASSWORD not in message


async def test_what_waiting_cannot_mend_is_refused_at_once(database_url: str) -> None:
    missing = make_url(database_url).set(database="no_such_database_here")
    started = time.monotonic()
    with pytest.raises(DatabaseUnreachable) as caught:
        await wait_for_database(missing.render_as_string(hide_password=False), wait_s=60)
    assert time.monotonic() - started < 30  # not the whole wait
    message = str(caught.value)
    assert "refused the connection" in message and 'database "no_such_database_here" does not exist' in message


def test_serve_prints_one_line_and_exits_1_when_its_database_never_answers(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "phasegate.toml"
    config.write_text(
        f'database_url = "postgresql://phasegate:{PASSWORD}@127.0.0.1:{port}/phasegate"\ndatabase_wait_s = 1\n'
    )
    command = [sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--port", "0"]
    done = subprocess.run(
        [*command, "--sim-workers", "0", "--model", "sim"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"phasegate serve: the log's PostgreSQL at 127.0.0.1:{port}/phasegate did not answer within 1 s" in output
    assert "does not answer yet" in output  # the wait was said while it lasted
    assert "Traceback" not in output and PASSWORD not in output
