"""A ``SIGHUP`` that arrives while ``phasegate serve --processes 2`` starts (docs/design.md
§16) is not missed: the parent counts it until its processes serve, then reads the file
again and hands it to every process, so each one serves the file as it was when the
signal came, though it started with the file read before.

Real processes: ``phasegate serve`` on real PostgreSQL, a real sim worker, the signal sent
by the test once the parent logged its first line and before any process serves.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from ops.processes import free_port, phasegate, start, stop, wait_http
from tests.faults.test_instances import instances, wait_for
from tests.faults.test_reload import WORKER_ARGS, reloaded, settings
from tests.support.workers import WorkerProcess, running_worker

pytestmark = pytest.mark.slow


def test_a_sighup_while_the_processes_start_is_applied_by_each_once_they_serve(
    database_url: str, tmp_path: Path
) -> None:
    with running_worker(args=WORKER_ARGS) as worker:
        _sighup_while_starting(database_url, worker, tmp_path)


def _sighup_while_starting(database_url: str, worker: WorkerProcess, tmp_path: Path) -> None:
    config, log = tmp_path / "phasegate.toml", tmp_path / "serve.log"
    port = free_port()
    config.write_text(settings(port, worker, added=False))
    command = phasegate("serve", "--config", str(config), "--log-level", "info", "--processes", "2")
    process = start(command, {"DATABASE_URL": database_url}, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not log.exists() or not log.read_text(errors="replace").strip():  # serve's handlers are in place
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.01)
        config.write_text(settings(port, worker, added=True, second=worker))
        process.send_signal(signal.SIGHUP)
        with pytest.raises(httpx.HTTPError):  # sent while it starts: nothing serves yet
            httpx.get(url + "/healthz", timeout=1).raise_for_status()
        wait_http(url + "/healthz")
        wait_for(lambda: len([r for r in instances(database_url) if r["released_at"] is None]) == 2, 30, "2 processes")
        for address in [str(row["address"]) for row in instances(database_url) if row["released_at"] is None]:
            wait_for(lambda a=address: reloaded(a), 10, f"{address} to serve the file as the SIGHUP found it")
        assert process.poll() is None
        assert "configuration reloaded from" in log.read_text(errors="replace")
    finally:
        stop(process, signal.SIGKILL)
