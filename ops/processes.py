"""Processes for the ops scripts and the tests: start a phasegate worker or gateway (on a
port it picks itself: ``start_serving``), wait until it answers, end its whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening_socket() -> socket.socket:
    """A socket listening on a port the kernel picked, for a server to take as it is: no
    port is chosen and freed for the server to bind, which another process could take first."""
    sock = socket.socket(
        socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )  # TCP: asyncio sets TCP_NODELAY (app/process/serve.py)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    return sock


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


def start_serving(
    command: list[str], env: dict[str, str] | None = None, log: Path | None = None, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """``command`` (a ``phasegate serve`` without ``--port``) on a port it picks itself, as
    ``start`` does: (the process, its URL once its ``--ready-file`` names the port). No
    port is chosen here and freed for it to take, which another process could take first."""
    folder = Path(tempfile.mkdtemp(prefix="phasegate-ready-"))
    ready = folder / "ready.json"
    try:
        process = start([*command, "--port", "0", "--ready-file", str(ready)], env, log)
        return process, f"http://127.0.0.1:{ready_port(ready, process, timeout)}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ready_port(ready: Path, process: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    """The port a process started with ``--port 0 --ready-file READY`` listens on, once it
    wrote it; a process that exits first, or takes longer than ``timeout``, is an error."""
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, process.args))} exited with {process.returncode} before it served")
        if time.monotonic() > deadline:
            stop(process, signal.SIGKILL)
            raise RuntimeError(f"{' '.join(map(str, process.args))} did not serve within {timeout:g} s")
        time.sleep(0.02)
    return int(json.loads(ready.read_text())["port"])


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


def wait_http(url: str, timeout: float = 60.0, process: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers 200; an error that says what it last answered, and at once
    when ``process`` (the server) exited."""
    deadline, last = time.monotonic() + timeout, "nothing"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: its server exited with {process.returncode} before it answered 200")
        try:
            answer = httpx.get(url, timeout=2)
        except httpx.HTTPError as exc:
            last = repr(exc)
        else:
            if answer.status_code == 200:
                return
            last = f"{answer.status_code} {answer.text[:300]!r}"
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:g}s; last: {last}")
