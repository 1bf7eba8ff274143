"""Gateway instances on one PostgreSQL (docs/design.md §11), with real processes.

Several ``phasegate serve`` processes share one real PostgreSQL and one real sim
worker; clients stream over raw SSE. Each test kills, stops or drains one gateway
and then judges every request by what its client received and what the log says:

- SIGKILL: a survivor sweeps the dead instance; each of its requests ends
  ``gateway_lost`` within lease TTL + sweep interval + 2 s, and the log's delivered
  count is at most two batches behind the client's, never ahead;
- SIGSTOP past the lease: a survivor sweeps it; once resumed it appends nothing
  more, its clients get the final error ``gateway_lost``, and it registers again;
- SIGTERM: new requests get 503 ``gateway_draining``, streams that finish inside
  ``drain_s`` complete, the rest end with ``gateway_draining``, recorded as such;
- a second process on a taken port fails before it touches anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from app.store.database import asyncpg_dsn
from app.store.postgres import PostgresEventStore
from ops.processes import phasegate, start_serving, stop, wait_http
from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import held
from tests.support.drain_errors import assert_ending_says_one_thing, assert_refusal_says_one_thing
from tests.support.gateway import MODEL
from tests.support.workers import WorkerProcess, running_worker

# The product's default. An instance that misses its renewals for two thirds of it takes
# itself for fenced (docs/design.md §11), rightly: and this machine can stop running every
# process for seconds at a time (tests/support/workers.py). At 4 s a CI run lost a live
# instance's lease while a second `phasegate serve` started beside it.
LEASE_TTL_S = 10.0
SWEEP_S = 0.5
SWEEP_SLACK_S = 8.0  # a survivor's sweep may run late on a loaded machine (5.6 s seen), never by a lease
BATCH = 4  # deltas per DeltasDelivered at most; the log may lag the client by two batches
SETTINGS = f"""
instance_lease_ttl_s = {LEASE_TTL_S}
sweep_interval_s = {SWEEP_S}
delivery_batch_tokens = {BATCH}
delivery_batch_ms = 1000.0
drain_s = 3.0
"""

pytestmark = pytest.mark.slow


@dataclass
class Stream:
    """One streamed chat in a thread: the transcript so far, and how it ended."""

    url: str
    max_tokens: int
    transcript: Transcript = field(default_factory=lambda: Transcript("", 0))
    cut: BaseException | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": self.max_tokens, "ignore_eos": True}
        body["messages"] = [{"role": "user", "content": "count slowly"}]
        try:
            with (
                httpx.Client(base_url=self.url, timeout=60) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                self.transcript.request_id = response.headers.get("x-request-id", "")
                self.transcript.status = response.status_code
                for line in response.iter_lines():
                    self.transcript.read(line)
        except httpx.HTTPError as exc:  # the gateway died under it
            self.cut = exc
        finally:
            self.ended.set()

    @property
    def received(self) -> int:
        return len(self.transcript.contents)


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    command: list[str]
    log: Path


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    args = ["--model", MODEL, "--sim-decode-ms-per-token", "40", "--max-running", "256"]
    with running_worker(faults=True, args=args) as w:
        yield w


@contextlib.contextmanager
def gateways(
    database_url: str, worker: WorkerProcess, tmp_path: Path, count: int, settings: str = SETTINGS
) -> Iterator[list[Gateway]]:
    config = tmp_path / "phasegate.toml"
    config.write_text(settings)
    started: list[Gateway] = []
    try:
        for n in range(count):
            command = phasegate("serve", "--processes", "1", "--config", str(config))
            command += ["--replica", f"worker={worker.base_url}#w1", "--model", f"{MODEL}=rev", "--log-level", "info"]
            log = tmp_path / f"gateway-{n}.log"
            process, url = start_serving(command, {"DATABASE_URL": database_url}, log)
            # the command that takes this port again: a second process on it must fail
            started.append(Gateway(url, process, [*command, "--port", url.rsplit(":", 1)[1]], log))
        for gateway in started:
            wait_http(gateway.url + "/readyz")
        yield started
    finally:
        for gateway in started:
            stop(gateway.process, signal.SIGKILL)


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds it took ``condition`` to hold."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - began


def read_logs(database_url: str, request_ids: list[str]) -> dict[str, list[ev.Event]]:
    async def read() -> dict[str, list[ev.Event]]:
        store = await PostgresEventStore.connect(database_url)
        try:
            return {request_id: await store.read(request_id) for request_id in request_ids}
        finally:
            await store.close()

    return asyncio.run(read())


def instances(database_url: str) -> list[asyncpg.Record]:
    async def fetch() -> list[asyncpg.Record]:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            return list(await connection.fetch("SELECT * FROM gateway_instances ORDER BY started_at"))
        finally:
            await connection.close()

    return asyncio.run(fetch())


def instance_of(database_url: str, gateway: Gateway, *, latest: bool = False) -> asyncpg.Record:
    """The instance row of ``gateway`` (its name ends with its port): the first, or the latest."""
    port = gateway.url.rsplit(":", 1)[1]
    rows = [row for row in instances(database_url) if row["name"].endswith(f":{port}")]
    return rows[-1] if latest else rows[0]


def terminal(events: list[ev.Event]) -> bool:
    return fold(events).outcome is not None


def logged_deltas(events: list[ev.Event]) -> int:
    return sum(e.to_index - e.from_index for e in events if isinstance(e, ev.DeltasDelivered))


def assert_lost_within_the_bound(events: list[ev.Event], stream: Stream) -> None:
    """A request its gateway lost: closed ``gateway_lost`` from the log, which is behind
    what the client received by at most two batches and never ahead of it."""
    assert violations(events) == []
    (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
    assert failed.code == "gateway_lost"
    logged = logged_deltas(events)
    assert logged <= stream.received, f"{failed.request_id}: the log says {logged}, the client got {stream.received}"
    assert stream.received - logged <= 2 * BATCH, f"{failed.request_id}: {stream.received} sent, {logged} logged"
    assert failed.delivered_output_tokens == fold(events).delivered_output_tokens == logged
    # the client had deltas, so the commit point was logged before them: partial, not retryable
    assert fold(events).first_delta_sent and failed.partial_output is True and failed.retryable is False
    logged_text = "".join(e.text or "" for e in events if isinstance(e, ev.DeltasDelivered))
    assert stream.transcript.text.startswith(logged_text)


def assert_swept_within_the_bound(database_url: str, victims: list[Stream], killed: str) -> None:
    """The clients of a process SIGKILLed (instance ``killed``) were cut, and a survivor closed each of their
    requests ``gateway_lost`` once the dead instance's lease lapsed (within the sweep
    interval, on PostgreSQL's clock, and a slack only a real fault exceeds), its log at
    most two batches behind what the client received and never ahead."""
    wait_for(lambda: all(s.ended.is_set() for s in victims), 30, "the killed process's clients to notice")
    assert all(s.cut is not None and not s.transcript.done for s in victims)
    ids = [s.transcript.request_id for s in victims]
    wait_for(lambda: all(map(terminal, read_logs(database_url, ids).values())), 60, "the sweep")

    def swept() -> asyncpg.Record | None:
        (row,) = [row for row in instances(database_url) if row["instance_id"] == killed]
        return row if row["swept_at"] is not None else None

    # the sweeper marks the instance swept once it closed every request (a read can fall
    # between the last close and the mark)
    wait_for(swept, 10, "the instance marked swept")
    row = swept()
    assert row is not None
    late = (row["swept_at"] - row["lease_expires_at"]).total_seconds()
    assert late <= SWEEP_S + SWEEP_SLACK_S, f"swept {late:.1f}s after the lease lapsed"
    logs = read_logs(database_url, ids)
    for stream in victims:
        assert_lost_within_the_bound(logs[stream.transcript.request_id], stream)
    gaps = [s.received - logged_deltas(logs[s.transcript.request_id]) for s in victims]
    print(
        f"swept {len(victims)} requests {late:.2f}s after the lease lapsed;"
        f" a client ahead of its log by {max(gaps)} deltas at most (bound {2 * BATCH})"
    )
    assert max(gaps) <= 2 * BATCH


def test_a_killed_gateways_requests_are_swept_by_a_survivor(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with gateways(database_url, worker, tmp_path, 3) as fleet:
        streams = [Stream(fleet[n % 3].url, max_tokens=2000).start() for n in range(99)]
        wait_for(lambda: all(s.received >= 3 for s in streams), 60, "every stream to be delivering")
        victims = [s for n, s in enumerate(streams) if n % 3 == 0]
        survivors = [s for n, s in enumerate(streams) if n % 3 != 0]
        stop(fleet[0].process, signal.SIGKILL)  # no shutdown, no flush, no lease given back
        assert_swept_within_the_bound(database_url, victims, instance_of(database_url, fleet[0])["instance_id"])
        killed, alive = instance_of(database_url, fleet[0]), [instance_of(database_url, g) for g in fleet[1:]]
        assert killed["swept_by"] in {row["instance_id"] for row in alive} and killed["swept_at"] is not None
        assert killed["requests_swept"] == len(victims)
        noticed = [
            (s.transcript.request_id, s.received, s.cut, s.transcript.error) for s in survivors if s.ended.is_set()
        ]
        assert noticed == [], "the other gateways' clients noticed the kill"
        for gateway in fleet[1:]:
            stop(gateway.process, signal.SIGKILL)


def test_a_killed_gateways_background_responses_are_swept_and_a_survivor_answers_their_poll(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    """Nobody reads a background response (docs/design.md §15): its owner's death is found by the
    sweep as any request's, and its client, polling another instance, learns how it ended."""
    prompts = [f"count slowly {n} {os.getpid()} {time.monotonic_ns()}" for n in range(3)]
    with (
        gateways(database_url, worker, tmp_path, 2) as (doomed, survivor),
        contextlib.ExitStack() as holds,
    ):
        # each held at token 3 until the end (full3: a sim answer of its own length, over in
        # a second, could complete before the kill on a loaded machine)
        for prompt in prompts:
            holds.enter_context(held(worker, prompt, at_token=3))
        response_ids = []
        for prompt in prompts:
            body = {"model": MODEL, "input": prompt, "max_output_tokens": 2000, "background": True}
            answer = httpx.post(doomed.url + "/v1/responses", json=body, timeout=30)
            assert answer.status_code == 200 and answer.json()["status"] == "queued", answer.text
            response_ids.append(answer.json()["id"])
        ids = ["req_" + response_id.removeprefix("resp_") for response_id in response_ids]

        def generating() -> bool:
            return all(
                any(isinstance(e, ev.DeltasProduced) for e in log) for log in read_logs(database_url, ids).values()
            )

        wait_for(generating, 60, "every response to be generating")
        stop(doomed.process, signal.SIGKILL)
        wait_for(lambda: all(map(terminal, read_logs(database_url, ids).values())), 30, "the sweep")
        for response_id, (request_id, events) in zip(response_ids, read_logs(database_url, ids).items(), strict=True):
            assert violations(events) == [], (request_id, violations(events))
            (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
            assert (failed.code, failed.partial_output, failed.delivered_output_tokens) == ("gateway_lost", False, 0)
            polled = httpx.get(f"{survivor.url}/v1/responses/{response_id}", timeout=30).json()
            assert polled["status"] == "failed" and polled["background"] is True
            assert polled["error"]["code"] == "gateway_lost" and polled["error"]["request_id"] == request_id


def test_a_stopped_gateway_is_swept_and_once_resumed_appends_nothing(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with gateways(database_url, worker, tmp_path, 2) as (paused, survivor):
        streams = [Stream(paused.url, max_tokens=2000).start() for _ in range(4)]
        wait_for(lambda: all(s.received >= 3 for s in streams), 30, "every stream to be delivering")
        paused.process.send_signal(signal.SIGSTOP)
        try:
            ids = [s.transcript.request_id for s in streams]
            wait_for(lambda: all(map(terminal, read_logs(database_url, ids).values())), 30, "the sweep")
            swept = read_logs(database_url, ids)
        finally:
            paused.process.send_signal(signal.SIGCONT)
        wait_for(lambda: all(s.ended.is_set() for s in streams), 15, "the resumed gateway to end its streams")
        time.sleep(1.0)  # whatever it still tried to append, it tried by now
        after = read_logs(database_url, ids)
        for stream in streams:
            request_id = stream.transcript.request_id
            events, before = after[request_id], swept[request_id]
            # since it resumed, only the sweeper's bookkeeping of a lease that lapsed unacknowledged
            late = [e for e in events[len(before) :] if not isinstance(e, ev.LeaseExpired | ev.AttemptReleased)]
            assert events[: len(before)] == before and late == [], f"{request_id}: appended after the sweep: {late}"
            assert_lost_within_the_bound(events, stream)
            error = stream.transcript.error  # the client is told, with what it really received
            assert stream.cut is None and stream.transcript.done and error is not None
            assert error["code"] == "gateway_lost" and error["delivered_output_tokens"] == stream.received
            assert error["partial_output"] is True and error["retryable"] is False
        assert instance_of(database_url, paused)["swept_by"] == instance_of(database_url, survivor)["instance_id"]
        wait_for(lambda: len(instances(database_url)) == 3, 15, "the resumed gateway to register again")
        wait_http(paused.url + "/readyz", timeout=15)  # and it serves again, under its new id
        again = Stream(paused.url, max_tokens=5).start()
        again.ended.wait(30)
        assert again.transcript.done and again.transcript.error is None and again.received == 5
        (log,) = read_logs(database_url, [again.transcript.request_id]).values()
        accepted = log[0]
        assert isinstance(accepted, ev.RequestAccepted)
        assert accepted.gateway == instance_of(database_url, paused, latest=True)["instance_id"]


def test_sigterm_drains_then_ends_the_streams_left_with_gateway_draining(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with gateways(database_url, worker, tmp_path, 1) as (gateway,):
        short = [Stream(gateway.url, max_tokens=30).start() for _ in range(3)]  # ~1.2 s: inside drain_s
        long = [Stream(gateway.url, max_tokens=2000).start() for _ in range(3)]
        wait_for(lambda: all(s.received >= 2 for s in short + long), 30, "every stream to be delivering")
        gateway.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(gateway.url + "/readyz").status_code == 503, 2, "readiness to fail")
        refused = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
        )
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "gateway_draining"
        assert_refusal_says_one_thing(refused.json()["error"])
        gateway.process.wait(20)
        for stream in short:
            assert stream.transcript.done and stream.transcript.error is None and stream.received == 30
        logs = read_logs(database_url, [s.transcript.request_id for s in short + long])
        for stream in long:
            events = logs[stream.transcript.request_id]
            assert violations(events) == []
            error = stream.transcript.error
            assert stream.transcript.done and error is not None and error["code"] == "gateway_draining"
            assert_ending_says_one_thing(error)
            (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
            # the client and the log agree exactly: a drain writes what was delivered
            assert failed.code == "gateway_draining"
            assert error["delivered_output_tokens"] == stream.received == failed.delivered_output_tokens
            assert error["partial_output"] is failed.partial_output is True
            assert logged_deltas(events) == stream.received
            assert not any(isinstance(e, ev.ClientDisconnected) for e in events)  # never "the client left"
        assert all(fold(logs[s.transcript.request_id]).outcome is Outcome.COMPLETED for s in short)
        (row,) = instances(database_url)
        assert row["released_at"] is not None  # the lease was given back


def test_a_second_gateway_on_a_taken_port_fails_and_touches_nothing(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    with gateways(database_url, worker, tmp_path, 1) as (first,):
        stream = Stream(first.url, max_tokens=60).start()
        wait_for(lambda: stream.received >= 3, 30, "the stream to be delivering")
        env = {**os.environ, "DATABASE_URL": database_url}
        second = subprocess.run(first.command, env=env, capture_output=True, timeout=60)
        assert second.returncode != 0 and b"cannot listen" in second.stdout
        stream.ended.wait(30)
        assert stream.transcript.done and stream.transcript.error is None and stream.received == 60
        assert len(instances(database_url)) == 1


def test_any_instance_answers_for_a_request_another_one_served(
    database_url: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    token = "an-admin-token-for-the-test"
    with gateways(database_url, worker, tmp_path, 2, settings=f'admin_token = "{token}"\n' + SETTINGS) as (a, b):
        stream = Stream(a.url, max_tokens=8).start()
        assert stream.ended.wait(30) and stream.transcript.done
        request_id = stream.transcript.request_id
        headers = {"authorization": f"Bearer {token}"}
        summary = httpx.get(f"{b.url}/v1/requests/{request_id}", headers=headers)
        assert summary.status_code == 200 and summary.json()["id"] == request_id
        assert summary.json()["request"]["outcome"] == "completed"
        events = httpx.get(f"{b.url}/v1/requests/{request_id}/events", headers=headers).json()
        kinds = [e["type"] for e in events["data"]]
        assert kinds[0] == "RequestAccepted" and kinds[-1] == "RequestCompleted"
        page = httpx.get(f"{b.url}/ui/requests/{request_id}", headers=headers)
        assert page.status_code == 200 and request_id in page.text
