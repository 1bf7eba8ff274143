"""Processes for the ops scripts: start a phasegate worker or gateway on a known port,
wait until it answers, end its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def phasegate(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def start(command: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group (so ``stop`` ends its children too)."""
    with log.open("ab") if log else contextlib.nullcontext() as output:  # the child keeps its own copy
        return subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            stdout=output if output is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)


@contextlib.contextmanager
def running(command: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    process = start(command, env)
    try:
        yield process
    finally:
        stop(process)


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:g}s")
