"""``phasegate serve`` as a process of its own, for tests that judge what a user's gateway does
over its real sockets and what its own log says (a traceback, a warning)::

    with served_gateway(database_url, worker, settings={"admin_token": "…"}) as gateway:
        httpx.get(gateway.url + "/healthz")
        assert "Traceback" not in gateway.logs()

The gateway runs on ``database_url`` with ``worker`` as its one replica (the worker's token
given through the environment, as a deployment does), or with ``replicas`` (``--replica``
flags such as ``openai=http://…#u1``) instead, in a process group of its own, ended with
SIGTERM (then SIGKILL) on leaving. It runs one gateway process (``--processes 1``), so
what its /metrics says is about every request it served (tests/faults/test_processes.py
runs several).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.contract.worker_token import TOKEN_ENV
from ops.processes import ready_port
from tests.support.gateway import MODEL, REVISION
from tests.support.workers import REPO, WorkerProcess


@dataclass
class ServedGateway:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")


def _toml(settings: dict[str, Any]) -> str:
    """``settings`` as TOML: scalars (JSON's quoting is TOML's for the strings used here) and one level of tables."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in settings.items() if not isinstance(value, dict)]
    for table, values in settings.items():
        if isinstance(values, dict):
            lines += [f"[{table}]", *(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def served_gateway(
    database_url: str,
    worker: WorkerProcess | None,
    *,
    settings: dict[str, Any] | None = None,
    ready_timeout: float = 60,
    replicas: tuple[str, ...] = (),
) -> Iterator[ServedGateway]:
    with tempfile.TemporaryDirectory(prefix="phasegate-served-") as tmp:
        config = Path(tmp) / "phasegate.toml"
        config.write_text(_toml(settings or {}))
        ready = Path(tmp) / "ready.json"
        command = [sys.executable, "-m", "app.cli", "serve", "--config", str(config)]
        command += ["--port", "0", "--ready-file", str(ready)]
        command += ["--processes", "1"]  # one process: its /metrics and its log are the whole gateway's
        if not replicas and worker is not None:
            replicas = (f"worker={worker.base_url}#w1",)
        for flag in replicas:
            command += ["--replica", flag]
        command += ["--model", f"{MODEL}={REVISION}"]
        env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "PHASEGATE_DATA_DIR")}
        env["DATABASE_URL"] = database_url
        if worker is not None and worker.token is not None:
            env[TOKEN_ENV] = worker.token
        log_path = Path(tmp) / "gateway.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            port = ready_port(ready, process, ready_timeout)
            gateway = ServedGateway(f"http://127.0.0.1:{port}", process, log_path)
            _wait_ready(gateway, ready_timeout)
            yield gateway
        finally:
            _stop(process)


def _wait_ready(gateway: ServedGateway, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise RuntimeError(f"phasegate serve exited with {gateway.process.returncode}:\n{gateway.logs()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(gateway.url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"phasegate serve not ready within {timeout} s:\n{gateway.logs()[-4000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
