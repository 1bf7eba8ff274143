"""``phasegate serve --processes 2``: two gateway processes on one port, each an instance
(docs/design.md §11), with real processes, a real sim worker and real PostgreSQL.

- both children serve requests on the one port: two instance ids appear in
  ``RequestAccepted.gateway``; each has an address of its own, so a stop button sent to
  the one that does not own a request is forwarded to the owner; a second
  ``phasegate serve`` on that port fails and touches nothing;
- a SIGKILLed child: its clients are cut, the other child's clients notice nothing,
  its requests are swept (``gateway_lost``, the log at most two batches behind the
  client), the port still serves, and the parent starts another child;
- SIGTERM to the parent alone drains both children: new requests get 503
  ``gateway_draining``, short streams complete, long ones end with
  ``gateway_draining``, recorded as such, and both instances give their lease back;
- a process that cannot serve fails the start (exit 1), and no process is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from ops.processes import phasegate, start_serving, stop, wait_http
from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.faults.test_instances import (
    SETTINGS,
    Stream,
    assert_swept_within_the_bound,
    instances,
    logged_deltas,
    read_logs,
    wait_for,
)
from tests.support.drain_errors import assert_ending_says_one_thing, assert_refusal_says_one_thing
from tests.support.gateway import MODEL
from tests.support.workers import WorkerProcess, running_worker

pytestmark = pytest.mark.slow


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    command: list[str]


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    with running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "40", "--max-running", "256"]) as w:
        yield w


@contextlib.contextmanager
def two_processes(database_url: str, worker: WorkerProcess, tmp_path: Path) -> Iterator[Served]:
    config = tmp_path / "phasegate.toml"
    config.write_text(SETTINGS)
    command = phasegate("serve", "--processes", "2", "--config", str(config))
    command += ["--replica", f"worker={worker.base_url}#w1", "--model", f"{MODEL}=rev", "--log-level", "info"]
    process, url = start_serving(command, {"DATABASE_URL": database_url}, tmp_path / "serve.log")
    served = Served(url, process, [*command, "--port", url.rsplit(":", 1)[1]])
    try:
        wait_http(served.url + "/readyz")
        wait_for(lambda: len(live(database_url)) == 2, 30, "both gateway processes to register")
        yield served
    finally:
        stop(process, signal.SIGKILL)  # the children die with their parent
        assert_gone([row["pid"] for row in instances(database_url)])


def live(database_url: str) -> list[asyncpg.Record]:
    return [row for row in instances(database_url) if row["released_at"] is None and row["swept_by"] is None]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(pids: list[int]) -> None:
    wait_for(lambda: not any(alive(pid) for pid in pids), 10, "every gateway process to end")


def owners(database_url: str, streams: list[Stream]) -> dict[str, str]:
    """Each stream's request id -> the instance that accepted it."""
    logs = read_logs(database_url, [s.transcript.request_id for s in streams])
    found = {}
    for request_id, events in logs.items():
        accepted = events[0]
        assert isinstance(accepted, ev.RequestAccepted)
        assert accepted.gateway is not None
        found[request_id] = accepted.gateway
    return found


def spread(url: str, database_url: str, max_tokens: int, per_wave: int = 8) -> tuple[list[Stream], dict[str, str]]:
    """Streams opened in waves until both processes hold some (the kernel picks which
    process accepts each connection)."""
    streams: list[Stream] = []
    for _ in range(6):
        wave = [Stream(url, max_tokens=max_tokens).start() for _ in range(per_wave)]
        wait_for(lambda w=wave: all(s.received >= 2 for s in w), 30, "the streams to be delivering")
        streams += wave
        accepted = owners(database_url, streams)
        if len(set(accepted.values())) == 2:
            return streams, accepted
    raise AssertionError(f"one process took every connection: {set(accepted.values())}")


def test_two_processes_serve_one_port_as_two_instances(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with two_processes(database_url, worker, tmp_path) as served:
        streams, accepted = spread(served.url, database_url, max_tokens=20)
        for stream in streams:
            assert stream.ended.wait(30) and stream.transcript.done and stream.transcript.error is None
            assert stream.received == 20
        rows = {row["instance_id"]: row for row in live(database_url)}
        assert set(accepted.values()) == set(rows)  # both instances served
        port = served.url.rsplit(":", 1)[1]
        assert sorted(str(row["name"]).rsplit("/", 1)[1] for row in rows.values()) == ["1", "2"]
        assert all(str(row["name"]).rsplit("/", 1)[0].endswith(f":{port}") for row in rows.values())
        # each has an address of its own: the shared port may reach either
        addresses = {row["address"] for row in rows.values()}
        assert len(addresses) == 2 and served.url not in addresses
        assert {row["pid"] for row in rows.values()}.isdisjoint({served.process.pid})
        # a stop button sent to the process that does not own the request reaches the owner
        long = Stream(served.url, max_tokens=2000).start()
        wait_for(lambda: long.received >= 2, 30, "the long stream to be delivering")
        request_id = long.transcript.request_id
        owner = owners(database_url, [long])[request_id]
        (other,) = [row for instance_id, row in rows.items() if instance_id != owner]
        answer = httpx.post(f"{other['address']}/v1/requests/{request_id}/cancel", timeout=30)
        assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
        assert long.ended.wait(30) and long.transcript.error is not None
        assert long.transcript.error["code"] == "request_cancelled"
        env = {**os.environ, "DATABASE_URL": database_url}
        second = subprocess.run(served.command, env=env, capture_output=True, timeout=60)
        assert second.returncode != 0 and b"cannot listen" in second.stdout
        assert len(instances(database_url)) == 2  # it touched nothing


def test_a_killed_process_is_swept_and_the_other_serves_on(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with two_processes(database_url, worker, tmp_path) as served:
        streams, accepted = spread(served.url, database_url, max_tokens=2000)
        rows = {row["instance_id"]: row for row in live(database_url)}
        killed = next(iter(rows))
        victims = [s for s in streams if accepted[s.transcript.request_id] == killed]
        others = [s for s in streams if accepted[s.transcript.request_id] != killed]
        os.kill(int(rows[killed]["pid"]), signal.SIGKILL)
        assert_swept_within_the_bound(database_url, victims, killed)
        noticed = [(s.transcript.request_id, s.received, s.cut) for s in others if s.ended.is_set()]
        assert noticed == [], "the other process's clients noticed the kill"
        (row,) = [r for r in instances(database_url) if r["instance_id"] == killed]
        assert row["swept_at"] is not None and row["requests_swept"] == len(victims)
        # the port still serves, and the parent started another process in the killed one's place
        wait_for(lambda: len(live(database_url)) == 2, 30, "a process to replace the killed one")
        again = Stream(served.url, max_tokens=5).start()
        assert again.ended.wait(30) and again.transcript.done and again.transcript.error is None
        assert again.received == 5
        assert served.process.poll() is None


def test_sigterm_to_the_parent_drains_both_processes(database_url: str, worker: WorkerProcess, tmp_path: Path) -> None:
    with two_processes(database_url, worker, tmp_path) as served:
        long, accepted = spread(served.url, database_url, max_tokens=2000, per_wave=4)
        short = [Stream(served.url, max_tokens=30).start() for _ in range(4)]  # ~1.2 s: inside drain_s
        wait_for(lambda: all(s.received >= 2 for s in short), 30, "the short streams to be delivering")
        pids = [int(row["pid"]) for row in live(database_url)]
        served.process.send_signal(signal.SIGTERM)  # the parent alone, as an orchestrator sends it
        wait_for(lambda: httpx.get(served.url + "/readyz").status_code == 503, 2, "readiness to fail")
        refused = httpx.post(
            served.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
        )
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "gateway_draining"
        assert_refusal_says_one_thing(refused.json()["error"])
        assert served.process.wait(20) == 0
        assert_gone(pids)
        for stream in short:
            assert stream.transcript.done and stream.transcript.error is None and stream.received == 30
        logs = read_logs(database_url, [s.transcript.request_id for s in short + long])
        assert all(fold(logs[s.transcript.request_id]).outcome is Outcome.COMPLETED for s in short)
        for stream in long:
            events = logs[stream.transcript.request_id]
            assert violations(events) == []
            error = stream.transcript.error
            assert stream.transcript.done and error is not None and error["code"] == "gateway_draining"
            assert_ending_says_one_thing(error)
            (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
            assert failed.code == "gateway_draining"
            assert error["delivered_output_tokens"] == stream.received == failed.delivered_output_tokens
            assert logged_deltas(events) == stream.received
            assert not any(isinstance(e, ev.ClientDisconnected) for e in events)
        assert len(set(accepted.values())) == 2  # both processes were draining streams
        rows = instances(database_url)
        assert len(rows) == 2 and all(row["released_at"] is not None for row in rows)  # leases given back


def test_a_process_that_cannot_serve_fails_the_start(
    empty_database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    config = tmp_path / "phasegate.toml"
    config.write_text("apply_migrations = false\n")  # no schema: an instance cannot register
    command = phasegate("serve", "--processes", "2", "--config", str(config), "--port", "0")
    command += ["--replica", f"worker={worker.base_url}#w1", "--model", f"{MODEL}=rev"]
    env = {**os.environ, "DATABASE_URL": empty_database_url}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output.decode()
    assert b"phasegate serve: gateway process" in output and b"is serving" not in output
    assert children_of(process.pid) == [], "a gateway process outlived the failed start"


def children_of(parent: int) -> list[int]:
    """The gateway processes started by ``parent`` (each is told its parent's pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and f"--parent\x00{parent}\x00" in (entry / "cmdline").read_text():
                found.append(int(entry.name))
    return [pid for pid in found if alive(pid)]
