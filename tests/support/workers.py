"""Real worker processes for tests: start on a free port, wait until ready, kill the group.

Every process here starts in its own session (so its own process group) and is ended
with SIGKILL to the whole group: vLLM's engine processes outlive a killed parent
otherwise. Usable from any test package::

    with running_worker(faults=True, args=["--max-running", "2"]) as worker:
        client = worker.client()
        ...

Tests marked ``vllm`` get their Python and model from :func:`vllm_env`, which skips
them when ``PHASEGATE_VLLM_PYTHON`` / ``PHASEGATE_TINY_MODEL`` are unset and fails them
instead when ``PHASEGATE_REQUIRE_VLLM=1`` (as in CI).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from app.contract.worker_token import TOKEN_ENV
from app.replicas.worker_client import WorkerClient

REPO = Path(__file__).resolve().parents[2]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # vLLM on CPU: a small KV cache
_ids = itertools.count(1)


def request_id(prefix: str = "req") -> str:
    """A request id unique within this test session."""
    return f"{prefix}_{os.getpid()}_{next(_ids)}"


@dataclass
class VllmEnv:
    python: str
    model: str


def vllm_env() -> VllmEnv:
    """The vLLM Python and tiny model from the environment, or skip (fail under PHASEGATE_REQUIRE_VLLM=1)."""
    python, model = os.environ.get("PHASEGATE_VLLM_PYTHON"), os.environ.get("PHASEGATE_TINY_MODEL")
    missing = [
        name
        for name, value in (("PHASEGATE_VLLM_PYTHON", python), ("PHASEGATE_TINY_MODEL", model))
        if not value or not Path(value).exists()
    ]
    if missing:
        unavailable(f"vLLM tests need {' and '.join(missing)} (see .ci/vllm-env)")
    assert python is not None and model is not None
    return VllmEnv(python, model)


def instructor_python() -> str:
    """The instructor environment's Python (``PHASEGATE_INSTRUCTOR_PYTHON``), or skip (fail
    under PHASEGATE_REQUIRE_VLLM=1): instructor cannot be installed beside this project's
    ``openai`` client, so .ci/vllm-env builds it a venv of its own."""
    python = os.environ.get("PHASEGATE_INSTRUCTOR_PYTHON")
    if not python or not Path(python).exists():
        unavailable("instructor's test needs PHASEGATE_INSTRUCTOR_PYTHON (see .ci/vllm-env)")
    assert python is not None
    return python


def unavailable(why: str) -> NoReturn:
    """Skip a test whose environment is missing, or fail it under PHASEGATE_REQUIRE_VLLM=1 (CI)."""
    if os.environ.get("PHASEGATE_REQUIRE_VLLM") == "1":
        pytest.fail(why + "; PHASEGATE_REQUIRE_VLLM=1 forbids skipping")
    pytest.skip(why)


def run_in_vllm(code: str, *args: str) -> Any:
    """The JSON a check prints last, run as ``python -c code args…`` in the vLLM environment
    (its imports and the tiny model's config: about 10 s), with this repository importable."""
    result = subprocess.run(
        [vllm_env().python, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@dataclass
class ManagedProcess:
    """A process started in its own group, with its combined output in a log file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        """The exit code (negative: killed by that signal)."""
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (engine children included) and reap the leader."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@dataclass
class WorkerProcess(ManagedProcess):
    base_url: str = ""
    port: int = 0
    token: str | None = field(default=None, repr=False)  # the worker protocol's secret, if it has one

    def client(self, **kwargs: Any) -> WorkerClient:
        # This machine can at times stop running every process for seconds, the CPU idle
        # meanwhile (a sleep(0.05) loop beside a decoding vLLM engine woke up to 7 s late,
        # 14 times in 2 minutes; in later runs of the same, and beside two busy loops,
        # never). A timer then fires at the same wakeup as the connect or answer it
        # guards, and wins: CI saw a loopback connect "time out" after 15 s. The protocol
        # tests are not about these deadlines (test_worker_client.py is): a minute of room.
        # The read timeout too: a 5 s gap between frames ended an attempt's stream on the
        # client's side (in CI: the worker then stopped it as ``disconnected``).
        kwargs.setdefault("connect_timeout", 60.0)
        kwargs.setdefault("control_timeout", 60.0)
        kwargs.setdefault("read_timeout", 60.0)
        kwargs.setdefault("token", self.token)
        return WorkerClient(self.base_url, **kwargs)


def _spawn(
    cmd: Sequence[str],
    env: dict[str, str] | None,
    tmp: tempfile.TemporaryDirectory[str],
    unset: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    log_path = Path(tmp.name) / "process.log"
    base = os.environ if base_env is None else base_env
    environ = {key: value for key, value in {**base, **(env or {})}.items() if key not in unset}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environ,
            start_new_session=True,  # its own process group, for kill()
        )
    return ManagedProcess(proc, log_path, tmp)


def _wait_ready(process: ManagedProcess, url: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if not process.alive():
                raise RuntimeError(f"{what} exited with {process.proc.returncode}:\n{process.logs()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url).status_code == 200:
                    return
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{what} not ready within {timeout} s:\n{process.logs()[-4000:]}")


def start_worker(
    *,
    engine: str = "sim",
    args: Sequence[str] = (),
    faults: bool = False,
    python: str | None = None,
    model_path: str | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 30.0,
    token: str | None = None,
    unset_env: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
) -> WorkerProcess:
    """Start ``phasegate worker`` on a free port and wait until /v1/ready answers 200.

    ``args`` go to the worker as they are (e.g. ``["--sim-decode-ms-per-token", "5"]``);
    ``faults`` adds ``--enable-faults``. For ``engine="vllm"`` give ``python`` and
    ``model_path`` (see :func:`vllm_env`). With ``token`` the worker requires it (given
    through ``$PHASEGATE_WORKER_TOKEN``) and :meth:`WorkerProcess.client` sends it.
    ``unset_env`` names variables the worker must not inherit; ``base_env`` is the
    environment it inherits, if not this process's now (a start on another thread takes
    the one its caller had, not one a test running meanwhile changed). The caller must
    :meth:`~ManagedProcess.kill` it.
    """
    tmp = tempfile.TemporaryDirectory(prefix="phasegate-worker-")
    ready_file = Path(tmp.name) / "ready.json"
    cmd = [
        python or sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--port",
        "0",
        "--ready-file",
        str(ready_file),
    ]
    cmd += ["--engine", engine, "--log-level", "info"]
    if model_path is not None:
        cmd += ["--model-path", model_path]
    if faults:
        cmd.append("--enable-faults")
    if engine == "vllm":
        cmd += vllm_dtype_args()  # before args: a --dtype there wins
    cmd += list(args)
    worker_env = {**VLLM_ENV, **(env or {})} if engine == "vllm" else dict(env or {})
    if token is not None:
        worker_env[TOKEN_ENV] = token
    process = _spawn(cmd, worker_env, tmp, unset_env, base_env)
    deadline = time.monotonic() + ready_timeout
    while not ready_file.exists():
        if not process.alive() or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"worker did not bind (exit {process.proc.returncode}):\n{process.logs()[-4000:]}")
        time.sleep(0.02)
    port = json.loads(ready_file.read_text())["port"]
    worker = WorkerProcess(
        process.proc, process.log_path, tmp, base_url=f"http://127.0.0.1:{port}", port=port, token=token
    )
    try:
        _wait_ready(worker, worker.base_url + "/v1/ready", max(1.0, deadline - time.monotonic()), "worker")
    except BaseException:
        worker.kill()
        raise
    return worker


@contextlib.contextmanager
def running_worker(**kwargs: Any) -> Iterator[WorkerProcess]:
    """:func:`start_worker` as a context manager that kills the process group on exit."""
    worker = start_worker(**kwargs)
    try:
        yield worker
    finally:
        worker.kill()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_vllm_openai_server(
    env: VllmEnv,
    *,
    served_model_name: str = "tiny-llama",
    max_model_len: int = 512,
    args: Sequence[str] = (),
    ready_timeout: float = 240.0,
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[ManagedProcess, str]]:
    """vLLM's own OpenAI server on the tiny model (a plain replica): yields (process, base_url).

    vLLM takes a port number only, so one is picked free here; vLLM binds it first thing,
    and should another process take it in between, it is started again on another."""
    cmd = [env.python, "-m", "vllm.entrypoints.openai.api_server", "--model", env.model]
    cmd += ["--served-model-name", served_model_name, "--host", "127.0.0.1"]
    cmd += ["--max-model-len", str(max_model_len), *vllm_dtype_args(), *args]
    for tries_left in reversed(range(3)):
        port = free_port()
        process = _spawn(
            [*cmd, "--port", str(port)],
            {**VLLM_ENV, **(extra_env or {})},
            tempfile.TemporaryDirectory(prefix="phasegate-vllm-"),
        )
        try:
            _wait_ready(process, f"http://127.0.0.1:{port}/health", ready_timeout, "vLLM api_server")
            break
        except RuntimeError:
            taken = "Address already in use" in process.logs()
            process.kill()
            if tries_left and taken:
                continue
            raise
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.kill()


def vllm_dtype_args() -> list[str]:
    """``["--dtype", D]`` for every vLLM the tests start: ``PHASEGATE_VLLM_DTYPE``, else float32.

    The tiny random model does not care, and bfloat16 dies with SIGILL on the first
    forward pass on CPUs that advertise AMX/bf16 but cannot run it (some VMs, this
    project's CI among them); ``PHASEGATE_VLLM_DTYPE=bfloat16`` tests that path where it runs.
    """
    return ["--dtype", os.environ.get("PHASEGATE_VLLM_DTYPE") or "float32"]
