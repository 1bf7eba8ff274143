"""Child processes that ``phasegate serve`` owns: started in their own process
group, ready when they have written their ready file, ended as a whole group.

A worker (and above all a vLLM engine, which forks engine processes) must never
outlive the command that started it: ``stop`` sends SIGTERM to the group, waits for
the grace period, then SIGKILLs the group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contract.worker_token import TOKEN_ENV

log = logging.getLogger("phasegate.supervisor")


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


# --- the gateway processes of ``phasegate serve --processes N`` ----------------------------------


@dataclass
class GatewayChild:
    index: int
    process: subprocess.Popen[bytes]
    ready_file: Path

    @property
    def ready(self) -> bool:
        return self.ready_file.exists()


class GatewayProcesses:
    """N gateway processes (``python -m app.process.gateway_process``) serving one listening socket.

    Each child gets the socket's descriptor and ``spec`` on its standard input, in a process
    group of its own, so a terminal's Ctrl-C reaches this parent alone, which forwards
    every stop signal to the children as SIGTERM (:meth:`forward`). The standard input
    stays open: :meth:`send` writes a new spec (a configuration reload) to every child at
    once, and a child started later gets that one. A SIGHUP (:meth:`hangup`) has
    :meth:`run` call ``on_hangup`` from its loop, outside the signal handler. A child that ends
    while nothing asked it to is started again (a new instance, which sweeps the old
    one's requests if no other instance did first); one that ends before it ever served
    is a failed start.
    """

    def __init__(self, count: int, listener: socket.socket, spec: bytes, run_dir: Path) -> None:
        self.count, self.listener, self.spec, self.run_dir = count, listener, spec, run_dir
        self.children: list[GatewayChild] = []
        self.stopping = False
        self.on_hangup: Callable[[], None] = lambda: None
        self._hangups = 0
        self._launched = 0

    def _launch(self, index: int) -> GatewayChild:
        self._launched += 1
        ready_file = self.run_dir / f"gateway-{index}.{self._launched}.ready.json"
        fd = self.listener.fileno()
        command = [sys.executable, "-m", "app.process.gateway_process", "--index", str(index), "--listen-fd", str(fd)]
        command += ["--ready-file", str(ready_file), "--parent", str(os.getpid())]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(fd,), start_new_session=True)
        child = GatewayChild(index, process, ready_file)
        self._write(child, self.spec)
        return child

    @staticmethod
    def _write(child: GatewayChild, spec: bytes) -> None:
        assert child.process.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):  # a child that died: run() sees it
            child.process.stdin.write(spec)
            child.process.stdin.flush()

    def send(self, spec: bytes) -> None:
        """``spec`` to every child now, and to any child started from now on."""
        self.spec = spec
        for child in self.children:
            if child.process.poll() is None:
                self._write(child, spec)

    def hangup(self) -> None:
        """From a SIGHUP handler: :meth:`run` calls ``on_hangup`` at its next turn."""
        self._hangups += 1

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every child and wait until each serves; raises :class:`ChildFailed`."""
        self.children = [self._launch(index) for index in range(1, self.count + 1)]
        deadline = time.monotonic() + timeout_s
        while not all(child.ready for child in self.children):
            for child in self.children:
                if child.process.poll() is not None:
                    raise ChildFailed(f"gateway process {child.index} exited with {child.process.returncode}")
            if time.monotonic() > deadline:
                raise ChildFailed(f"the gateway processes did not serve within {timeout_s:g}s")
            time.sleep(0.05)

    def forward(self, signum: int) -> None:
        """A stop signal: each child gets SIGTERM (first: drain; second: end now; third: stop)."""
        self.stopping = True
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Until every child ended after a stop signal, starting again a child that ended
        unasked; 1 when a child (or its replacement) ended before it served."""
        while True:
            if self.stopping and all(child.process.poll() is not None for child in self.children):
                return 0
            if self._hangups and not self.stopping:
                self._hangups = 0
                self.on_hangup()
            for number, child in enumerate(self.children):
                code = child.process.poll()
                if code is None or self.stopping:
                    continue
                if not child.ready:
                    log.error("gateway process %d exited with %d before it served", child.index, code)
                    return 1
                log.warning(
                    "gateway process %d (pid %d) exited with %d; starting another", child.index, child.process.pid, code
                )
                child.ready_file.unlink(missing_ok=True)
                self._close(child)
                self.children[number] = self._launch(child.index)
            time.sleep(0.1)

    def kill(self) -> None:
        """Whatever child is left, ended now (after a failed start, or on the way out)."""
        for child in self.children:
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(5)
            self._close(child)

    @staticmethod
    def _close(child: GatewayChild) -> None:
        if child.process.stdin is not None:
            with contextlib.suppress(OSError):
                child.process.stdin.close()


# --- how many gateway processes ---------------------------------------------------------------

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cgroup: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup, in cores: cgroup v2's ``cpu.max``, else v1's
    CFS quota over its period; None when there is none (or no cgroup to read). Each is
    looked up in the process's own cgroup, then at the root a container sees."""
    v2, v1 = "", ""
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path.lstrip("/")
            elif "cpu" in controllers.split(","):
                v1 = path.lstrip("/")
    for folder in dict.fromkeys([cgroup / v2, cgroup]):
        with contextlib.suppress(OSError, ValueError):
            quota, period = (folder / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
    for mount in (cgroup / "cpu", cgroup / "cpu,cpuacct"):
        for folder in dict.fromkeys([mount / v1, mount]):
            with contextlib.suppress(OSError, ValueError):
                quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                return None if quota_us < 0 else quota_us / int((folder / "cpu.cfs_period_us").read_text())
    return None


def default_processes(quota: float | None = None) -> int:
    """How many gateway processes use every core this one may: the cgroup's CPU quota rounded
    up, else the cores this process may run on; never more cores than that, never fewer than 1."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota() if quota is None else quota
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)
