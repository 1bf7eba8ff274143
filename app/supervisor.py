"""Child processes that ``phasegate serve`` owns: started in their own process
group, ready when they have written their ready file, ended as a whole group.

A worker (and above all a vLLM engine, which forks engine processes) must never
outlive the command that started it: ``stop`` sends SIGTERM to the group, waits for
the grace period, then SIGKILLs the group.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contract.worker_token import TOKEN_ENV


class ChildFailed(RuntimeError):
    """A child process exited or did not become ready in time."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, Any]

    @property
    def url(self) -> str:
        return f"http://{self.ready['host']}:{self.ready['port']}"

    def stop(self, grace_s: float = 6.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever the group still holds
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(2)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def worker_token() -> str:
    """The token of the workers this process starts: ``$PHASEGATE_WORKER_TOKEN``, else one
    generated now and put there, where the children and the gateway's configuration read it."""
    if not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return os.environ[TOKEN_ENV]


def start_worker(name: str, args: list[str], *, run_dir: Path, timeout_s: float = 30.0) -> Child:
    """Start ``phasegate worker ARGS`` on a free port, with :func:`worker_token`, and wait until it listens."""
    worker_token()  # inherited by the child through the environment, never on its command line
    ready_file = run_dir / f"{name}.ready.json"
    ready_file.unlink(missing_ok=True)
    log_path = run_dir / f"{name}.log"
    command = [sys.executable, "-m", "app.cli", "worker", "--port", "0", "--ready-file", str(ready_file), *args]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    child = Child(name, process, log_path, {})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ChildFailed(f"{name} exited with {process.returncode}:\n{child.log_tail()}")
        if ready_file.exists():
            with contextlib.suppress(ValueError):
                child.ready = json.loads(ready_file.read_text())
                return child
        time.sleep(0.05)
    child.stop()
    raise ChildFailed(f"{name} was not ready within {timeout_s:g}s:\n{child.log_tail()}")


def run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="phasegate-"))
