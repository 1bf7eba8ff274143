"""A configuration reload (docs/design.md §16) with real processes: ``phasegate serve`` on real
PostgreSQL, a real sim worker, SIGHUP and ``phasegate reload``.

- a file that adds a replica, a model it alone serves, an API key and changes a tenant's
  limit is live within a second in every gateway process of ``--processes 2`` (each
  asked on its own address),
  and a stream that was live across the reload ends normally, its transcript equal to
  its log;
- a file that does not parse, one whose settings do not hold together, and one that
  changes the port are refused, each with its reason in the log (the port named), and
  the running configuration serves on (``--processes 1``, reloaded by ``phasegate reload``);
- two instances on one database reading one file: a replica the file adds on SIGHUP (to
  both) is one ``joined`` in ``fleet_events``, source ``file``, and serves through either;
  one it removes is one ``left``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg
import httpx
import pytest

from app.store.database import asyncpg_dsn
from ops.processes import free_port, phasegate, start, stop, wait_http
from ops.transcript import Transcript
from tests.faults.test_instances import instances, read_logs, wait_for
from tests.support.transcript import check_request
from tests.support.workers import WorkerProcess, running_worker

pytestmark = pytest.mark.slow

MODEL, ADDED = "sim", "sim-2"
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"  # never printed: the gateway redacts them
LIVE_WITHIN_S = 1.0


def settings(port: int, worker: WorkerProcess, *, added: bool, second: WorkerProcess | None = None) -> str:
    """Tenant a's key and model ``sim`` on replica w1; with ``added``, also model ``sim-2``,
    tenant b's key, and tenant a held to one request a minute; with ``second`` too, replica
    w2, the only one that serves ``sim-2``."""
    models = f'{MODEL} = "rev-1"' + (f'\n"{ADDED}" = "rev-1"' if added else "")
    keys = f'"{KEY_A}" = "tenant-a"' + (f'\n"{KEY_B}" = "tenant-b"' if added else "")
    limit = "requests_per_minute = 1" if added else "requests_per_minute = 1000"
    return f"""
port = {port}
instance_lease_ttl_s = 10.0
delivery_batch_tokens = 4

[models]
{models}

[api_keys]
{keys}

[tenant_limits.tenants.tenant-a]
{limit}

[[replicas]]
id = "w1"
url = "{worker.base_url}"
models = ["{MODEL}"]
""" + (f'[[replicas]]\nid = "w2"\nurl = "{second.base_url}"\nmodels = ["{ADDED}"]\n' if second else "")


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    config: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def served(
    database_url: str,
    config: Path,
    tmp_path: Path,
    *args: str,
    stop_with: int = signal.SIGKILL,
    port: int | None = None,
    log_name: str = "serve.log",
) -> Iterator[Served]:
    """``phasegate serve`` on ``config`` (on ``port`` where given: ``--port``, else the file's)."""
    if port is None:
        port = int(config.read_text().split("port = ", 1)[1].split()[0])
    else:
        args = (*args, "--port", str(port))
    log = tmp_path / log_name
    command = phasegate("serve", "--config", str(config), "--log-level", "info", *args)
    process = start(command, {"DATABASE_URL": database_url}, log)
    gateway = Served(f"http://127.0.0.1:{port}", process, log, config)
    try:
        wait_http(gateway.url + "/healthz")
        yield gateway
    finally:
        stop(process, stop_with)


def chat(url: str, key: str, model: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def listed(url: str, key: str) -> list[str]:
    """The models ``GET /v1/models`` lists to ``key`` (none when the key is refused)."""
    answer = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
    return [model["id"] for model in answer.json()["data"]] if answer.status_code == 200 else []


def reloaded(url: str) -> bool:
    """This process lists the added model to the added key, generates with it, and holds
    tenant a to its new limit (one request a minute, of which the instance has at most
    all: its second request is refused)."""
    if ADDED not in listed(url, KEY_B):
        return False
    assert chat(url, KEY_B, ADDED).status_code == 200
    answers = [chat(url, KEY_A, MODEL) for _ in range(2)]
    return answers[-1].status_code == 429 and answers[-1].json()["error"]["code"] == "requests_per_minute_exceeded"


def applied_at(log: str, instance_id: str) -> datetime:
    """When the process of ``instance_id`` applied the reload, by its own log line."""
    (stamp,) = re.findall(
        rf"^(\S+ \S+) INFO phasegate.gateway: gateway instance {instance_id} serves the configuration reloaded",
        log,
        re.M,
    )
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")


@dataclass
class Stream:
    """A streamed chat of tenant a, read in a thread."""

    url: str
    transcript: Transcript = field(default_factory=lambda: Transcript("", 0))
    ended: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 60, "ignore_eos": True}
        body["messages"] = [{"role": "user", "content": "count slowly"}]
        headers = {"authorization": f"Bearer {KEY_A}"}
        try:
            with (
                httpx.Client(base_url=self.url, timeout=60) as http,
                http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
            ):
                self.transcript.request_id = response.headers.get("x-request-id", "")
                self.transcript.status = response.status_code
                for line in response.iter_lines():
                    self.transcript.read(line)
        finally:
            self.ended.set()


WORKER_ARGS = ["--model", MODEL, "--model", ADDED, "--sim-decode-ms-per-token", "40", "--max-running", "64"]


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    with running_worker(args=WORKER_ARGS) as w:
        yield w


def test_a_reload_is_live_within_a_second_in_every_process_and_streams_never_notice(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with running_worker(args=WORKER_ARGS) as second:
        reload_under_streams(database_url, worker, second, tmp_path)


def reload_under_streams(database_url: str, worker: WorkerProcess, second: WorkerProcess, tmp_path: Path) -> None:
    config = tmp_path / "phasegate.toml"
    port = free_port()
    config.write_text(settings(port, worker, added=False))
    with served(database_url, config, tmp_path, "--processes", "2") as gateway:
        wait_for(lambda: len([r for r in instances(database_url) if r["released_at"] is None]) == 2, 30, "2 processes")
        rows = {str(row["instance_id"]): str(row["address"]) for row in instances(database_url)}
        addresses = list(rows.values())
        for address in addresses:  # before: neither the model nor the key exists
            assert chat(address, KEY_B, ADDED).status_code == 401
            assert chat(address, KEY_A, ADDED).json()["error"]["code"] == "model_not_found"
        streams = [Stream(gateway.url).start() for _ in range(4)]
        wait_for(lambda: all(len(s.transcript.contents) >= 2 for s in streams), 30, "the streams to be delivering")
        config.write_text(settings(port, worker, added=True, second=second))
        asked = datetime.now()
        gateway.process.send_signal(signal.SIGHUP)
        for address in addresses:
            wait_for(lambda a=address: reloaded(a), 10, f"{address} to serve the file reloaded")
        # each process applied it within the second, by its own clock's line (the requests
        # above took their own time on a busy machine: they show it is live, not when)
        took = {i: (applied_at(gateway.logs(), i) - asked).total_seconds() for i in rows}
        assert all(0 <= seconds <= LIVE_WITHIN_S for seconds in took.values()), took
        assert "configuration reloaded from" in gateway.logs()
        for stream in streams:  # live across the reload: they never noticed
            assert stream.ended.wait(30)
            assert stream.transcript.done and stream.transcript.error is None, stream.transcript.error
            assert len(stream.transcript.contents) == 60
        logs = read_logs(database_url, [s.transcript.request_id for s in streams])
        for stream in streams:
            check_request(logs[stream.transcript.request_id], stream.transcript)
        assert gateway.process.poll() is None
    text = gateway.logs()
    assert KEY_A not in text and KEY_B not in text


def refusals(gateway: Served) -> list[str]:
    return [line for line in gateway.logs().splitlines() if "configuration reload refused" in line]


def test_a_broken_file_or_a_changed_port_is_refused_with_its_reason_and_the_old_one_serves_on(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    config = tmp_path / "phasegate.toml"
    port = free_port()
    good = settings(port, worker, added=False)
    config.write_text(good)
    pid_file = tmp_path / "phasegate.pid"
    pid = ["--pid-file", str(pid_file)]
    with served(database_url, config, tmp_path, "--processes", "1", *pid, stop_with=signal.SIGTERM) as gateway:
        wait_http(gateway.url + "/readyz")
        assert int(pid_file.read_text()) == gateway.process.pid
        bad_files = {
            "cannot read": good + "\n[models\n",  # not TOML
            "fallback model 'nowhere' is not in models": good + '\n[routing]\nfallbacks = ["nowhere"]\n',
            "port cannot change without a restart": good.replace(f"port = {port}", f"port = {free_port()}"),
            "discover #1 (vllm.test): port must be a port number": good + '\n[[discover]]\nname = "vllm.test"\n',
        }
        for number, (reason, text) in enumerate(bad_files.items(), start=1):
            config.write_text(text.replace(MODEL + ' = "rev-1"', f'{MODEL} = "rev-1"\n"{ADDED}" = "rev-1"'))
            answer = subprocess.run(
                phasegate("reload", "--pid-file", str(pid_file)), capture_output=True, text=True, timeout=60
            )
            assert answer.returncode == 0, answer.stdout + answer.stderr
            wait_for(lambda n=number: len(refusals(gateway)) >= n, 10, f"the refusal of {reason!r}")
            assert reason in refusals(gateway)[-1], refusals(gateway)[-1]
            # the running configuration serves on: the model the refused file added is not served
            assert chat(gateway.url, KEY_A, MODEL).status_code == 200
            assert chat(gateway.url, KEY_A, ADDED).json()["error"]["code"] == "model_not_found"
        assert "configuration reloaded" not in gateway.logs()
        config.write_text(good.replace(f'{MODEL} = "rev-1"', f'{MODEL} = "rev-1"\n"{ADDED}" = "rev-1"'))
        os.kill(gateway.process.pid, signal.SIGHUP)
        wait_for(lambda: ADDED in listed(gateway.url, KEY_A), 10, "the good file to be applied")
    assert not pid_file.exists()  # removed on the way out


def test_phasegate_reload_finds_the_demo_by_its_data_directory(tmp_path: Path) -> None:
    """The demo (embedded PostgreSQL, sim workers, no file): its pid is in its data directory,
    where `phasegate reload` looks; a reload keeps its simulated workers and model."""
    from tests.app.test_serve import ctrl_c, end, exited, launch, wait_for_line

    home = Path(tempfile.mkdtemp(prefix="phasegate-reload-test-"))
    home.chmod(0o755)  # the embedded PostgreSQL's own user enters it
    data_dir = home / "data"
    process, output = launch(data_dir, tmp_path, "--port", "0")
    try:
        url = wait_for_line(output, r"phasegate is serving (http://\S+)", process).group(1)
        assert int((data_dir / "phasegate.pid").read_text()) == process.pid
        env = {**os.environ, "PHASEGATE_DATA_DIR": str(data_dir)}
        answer = subprocess.run(phasegate("reload"), env=env, capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0, answer.stdout + answer.stderr
        wait_for_line(output, "configuration reloaded from the flags: nothing changed", process)
        body = {"model": "phasegate-sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        ctrl_c(process)
        assert exited(process, output) == 0
        assert not (data_dir / "phasegate.pid").exists()
    finally:
        end(process)
        shutil.rmtree(home, ignore_errors=True)


def fleet_events(database_url: str) -> list[tuple[str, str, str]]:
    """(event, replica id, source) of every fleet event, in order."""

    async def fetch() -> list[tuple[str, str, str]]:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            rows = await connection.fetch("SELECT event, replica_id, source FROM fleet_events ORDER BY seq")
            return [(row["event"], row["replica_id"], row["source"]) for row in rows]
        finally:
            await connection.close()

    return asyncio.run(fetch())


def test_two_instances_on_one_file_record_each_change_once(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with running_worker(args=WORKER_ARGS) as second:
        config = tmp_path / "phasegate.toml"
        written = free_port()  # the file's port: each instance listens on its own (--port)
        config.write_text(settings(written, worker, added=False))
        one, other = free_port(), free_port()
        with (
            served(database_url, config, tmp_path, port=one, log_name="a.log") as a,
            served(database_url, config, tmp_path, port=other, log_name="b.log") as b,
        ):
            for gateway in (a, b):
                wait_http(gateway.url + "/readyz")
            wait_for(lambda: fleet_events(database_url) == [("joined", "w1", "file")], 10, "w1 to join once")
            config.write_text(settings(written, worker, added=True, second=second))
            for gateway in (a, b):  # each instance reads the same file again
                gateway.process.send_signal(signal.SIGHUP)
            for gateway in (a, b):  # w2 alone serves sim-2: each instance reaches it through the fleet
                wait_for(lambda g=gateway: chat(g.url, KEY_B, ADDED).status_code == 200, 10, f"{gateway.url} to use w2")
            assert fleet_events(database_url) == [("joined", "w1", "file"), ("joined", "w2", "file")]
            config.write_text(settings(written, worker, added=False))
            for gateway in (a, b):
                gateway.process.send_signal(signal.SIGHUP)
            wait_for(lambda: len(fleet_events(database_url)) == 3, 10, "w2 to leave")
            time.sleep(1.0)  # the other instance's reconciliation, had it written one, would be here
            assert fleet_events(database_url) == [
                ("joined", "w1", "file"),
                ("joined", "w2", "file"),
                ("left", "w2", "file"),
            ]
            for gateway in (a, b):
                assert "configuration reloaded from" in gateway.logs()
