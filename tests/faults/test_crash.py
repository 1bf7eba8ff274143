"""Crashes of the gateway itself and of its PostgreSQL, under load.

- The gateway SIGKILLed mid-stream and started again: the new process is a new
  instance, which sweeps its predecessor once that one's lease lapsed, closing every
  request it owned with ``gateway_lost`` and cancelling their attempts; no request
  stays open (tests/faults/test_instances.py has survivors sweep, SIGSTOP and drain).
- PostgreSQL restarted mid-stream: while it is down new requests are refused with a
  clear 503; the streams in flight keep their guarantees and finish; nothing the
  gateway acknowledged is lost.
- PostgreSQL away for longer than a durable append waits: the streams that needed one
  end with the final error of docs/design.md §6 (``event_log_unavailable``), never a cut
  connection, and once it is back each is closed in the log as its client was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.driver import recorder
from app.store.embedded import EmbeddedPostgres
from app.store.postgres import PostgresEventStore
from ops.processes import phasegate, start, start_serving, stop, wait_http
from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.phases import Phase
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import Transcript, check_request, stream_chat
from tests.support.workers import running_worker

STREAMS = 6


def stream_in_threads(
    url: str, count: int, max_tokens: int, *, ignore_eos: bool = False
) -> tuple[list[Transcript | BaseException], Callable[[], int]]:
    """Start ``count`` streams in threads; returns their results (filled as they end) and
    a function counting the deltas received so far. ``ignore_eos``: each runs all
    ``max_tokens`` (the sim's own answer may end far sooner)."""
    results: list[Transcript | BaseException] = []
    counts = [0] * count

    def run(n: int) -> None:
        def seen(k: int) -> None:
            counts[n] = k

        body = {"model": MODEL, "messages": [{"role": "user", "content": f"load {n}"}], "max_tokens": max_tokens}
        if ignore_eos:
            body["ignore_eos"] = True
        try:
            results.append(stream_chat(url, body, on_delta=seen))
        except BaseException as exc:  # the gateway was killed under it
            results.append(exc)

    for n in range(count):
        threading.Thread(target=run, args=(n,), daemon=True).start()
    return results, lambda: min(counts)


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def test_a_gateway_killed_under_load_is_swept_by_its_restart(database_url: str, tmp_path: Path) -> None:
    with running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "40"]) as worker:
        settings = tmp_path / "phasegate.toml"
        settings.write_text("instance_lease_ttl_s = 2.0\nsweep_interval_s = 0.5\n")
        command = phasegate("serve", "--processes", "1")
        command += ["--replica", f"worker={worker.base_url}#w1"]
        command += ["--config", str(settings)]
        command += ["--model", f"{MODEL}=rev", "--log-level", "warning"]
        env = {"DATABASE_URL": database_url}
        gateway, url = await asyncio.to_thread(start_serving, command, env)
        command += ["--port", url.rsplit(":", 1)[1]]  # its restart takes the same port
        try:
            results, least = stream_in_threads(url, STREAMS, max_tokens=400)
            await asyncio.to_thread(wait_for, lambda: least() >= 3, 30, "every stream to be delivering")
            stop(gateway, signal.SIGKILL)  # no shutdown, no flush: the process is gone
            await asyncio.to_thread(wait_for, lambda: len(results) == STREAMS, 30, "the clients to notice")
            assert all(isinstance(r, httpx.HTTPError) for r in results)  # cut mid-stream, no [DONE]
            gateway = start(command, env)  # the same host and port, a new instance
            await asyncio.to_thread(wait_http, url + "/readyz")
            store = await PostgresEventStore.connect(database_url)
            try:
                deadline = time.monotonic() + 20
                while await store.unfinished_requests() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert await store.unfinished_requests() == []  # no request stays open
                lost = await _request_ids(store)
                assert len(lost) == STREAMS
                deadline = time.monotonic() + 60  # the lapsing-lease bookkeeping, if a cancel went unanswered
                while not all([fold(await store.read(r)).attempts[0].released for r in lost]):
                    assert time.monotonic() < deadline, "an attempt of a lost request was never released"
                    await asyncio.sleep(0.2)
                for request_id in lost:
                    events = await store.read(request_id)
                    assert violations(events) == []
                    (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
                    assert failed.code == "gateway_lost" and failed.partial_output and not failed.retryable
                    state = fold(events)
                    assert state.first_delta_sent  # they were delivering: not retryable, partial output
                    attempt = state.attempts[0]
                    assert attempt.cancel_sent and attempt.released is not None  # cancelled, then released
            finally:
                await store.close()
        finally:
            stop(gateway)


async def _request_ids(store: PostgresEventStore) -> list[str]:
    found = []

    async def scan() -> None:
        async for _, event in store.follow(0):
            if isinstance(event, ev.RequestAccepted):
                found.append(event.request_id)
                if len(found) == STREAMS:
                    return

    await asyncio.wait_for(scan(), 10)
    return found


@contextlib.contextmanager
def postgres_stopped_under_streams(
    database_url: str, postgres_server: EmbeddedPostgres | None, max_tokens: int, *, ignore_eos: bool = False
) -> Iterator[tuple[RunningGateway, list[Transcript | BaseException], Callable[[], object]]]:
    """``STREAMS`` streams through a gateway on one sim worker (15 ms a token); once every
    one is delivering, PostgreSQL stops. The third value starts it again (so does leaving)."""
    if postgres_server is None:
        pytest.skip("needs the embedded server (PHASEGATE_TEST_DATABASE_URL names an outside one)")
    with (
        running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "15"]) as worker,
        running_gateway(database_url, [worker]) as gateway,
    ):
        results, least = stream_in_threads(gateway.url, STREAMS, max_tokens=max_tokens, ignore_eos=ignore_eos)
        wait_for(lambda: least() >= 3, 30, "every stream to be delivering")
        postgres_server.stop(mode="fast")
        try:
            yield gateway, results, postgres_server.start
        finally:
            postgres_server.start()  # nothing to do if the test started it already


def test_postgres_restarted_under_load(database_url: str, postgres_server: EmbeddedPostgres | None) -> None:
    with postgres_stopped_under_streams(database_url, postgres_server, max_tokens=250) as (gateway, results, restart):
        store = gateway.gateway.ctx.store
        wait_for(lambda: not store.accepting, 10, "the gateway to notice the outage")
        refused = stream_chat(gateway.url, {"model": MODEL, "messages": [{"role": "user", "content": "new"}]})
        assert refused.status == 503 and refused.error is not None
        assert refused.error["code"] == "event_log_unavailable" and refused.request_id
        time.sleep(1.0)
        restart()
        wait_for(lambda: len(results) == STREAMS, 60, "the streams to end")
        for result in results:
            assert isinstance(result, Transcript), result
            assert result.done and result.error is None  # the outage did not break a stream
            state = check_request(gateway.events(result.request_id), result)  # nothing acknowledged was lost
            assert state.outcome is Outcome.COMPLETED and state.delivered_output_tokens == len(result.contents)
        assert gateway.events(refused.request_id) == []


def test_postgres_away_past_the_grace_ends_streams_with_the_final_error(
    database_url: str, postgres_server: EmbeddedPostgres | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recorder, "STORE_OUTAGE_GRACE_S", 0.5)  # how long a durable append waits
    # all 200 tokens, 3 s: each stream must still run once PostgreSQL is down (the sim's own,
    # shorter answer once ended before a loaded machine's fast shutdown was done: a full run)
    with postgres_stopped_under_streams(database_url, postgres_server, max_tokens=200, ignore_eos=True) as (
        gateway,
        results,
        restart,
    ):
        # each stream reaches its end, whose durable append waits in vain
        wait_for(lambda: len(results) == STREAMS, 60, "the streams to end")
        restart()
        transcripts = [result for result in results if isinstance(result, Transcript)]
        assert len(transcripts) == STREAMS, results
        for transcript in transcripts:
            assert transcript.done, "a stream was cut instead of ended"
            assert transcript.error is not None and transcript.error["code"] == "event_log_unavailable"
            assert transcript.error["partial_output"] is True and transcript.error["retryable"] is False
            assert transcript.error["delivered_output_tokens"] == len(transcript.contents) > 0

        def closed(transcript: Transcript) -> bool:
            return fold(gateway.events(transcript.request_id)).phase is Phase.TERMINATED

        wait_for(lambda: all(closed(t) for t in transcripts), 30, "the requests to be closed in the log")
        for transcript in transcripts:
            events = gateway.events(transcript.request_id)
            state = check_request(events, transcript)  # the log holds what the client got, and its end
            assert state.outcome is Outcome.FAILED and state.error_code == "event_log_unavailable"
        assert gateway.gateway.ctx.drivers == {}


def test_postgres_lost_at_the_commit_point_is_logged_as_the_client_was_told(
    database_url: str, postgres_server: EmbeddedPostgres | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit point (a stream's) or the completion (a whole answer's) cannot be made
    durable: the client gets 503 with nothing delivered, and once PostgreSQL is back the
    log ends the request the same way, with no commit point in it."""
    if postgres_server is None:
        pytest.skip("needs the embedded server (PHASEGATE_TEST_DATABASE_URL names an outside one)")
    monkeypatch.setattr(recorder, "STORE_OUTAGE_GRACE_S", 0.5)
    prompt = "held in prefill"
    with (
        running_worker(faults=True, args=["--model", MODEL]) as worker,
        running_gateway(database_url, [worker]) as gateway,
    ):
        response = httpx.post(
            worker.base_url + "/admin/faults",
            json={"action": "slow_prefill", "prefill_ms": 3000, "times": None, "match": {"prompt_contains": prompt}},
        )
        assert response.status_code == 200, response.text
        answers: list[tuple[bool, int, dict[str, object]]] = []

        def ask(stream: bool) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": stream}
            reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
            answers.append(
                (stream, reply.status_code, reply.json() if reply.status_code != 200 else {"body": reply.text})
            )

        for stream in (True, True, False, False):
            threading.Thread(target=ask, args=(stream,), daemon=True).start()
        time.sleep(1.0)  # accepted, and held in prefill
        postgres_server.stop(mode="fast")
        try:
            wait_for(lambda: len(answers) == 4, 30, "every request to be answered")
        finally:
            postgres_server.start()
        for stream, status, body in answers:
            assert "error" in body, f"stream={stream}: answered {status} {str(body)[:300]}"
            error = body["error"]
            assert isinstance(error, dict)
            assert (status, error["code"], error["partial_output"]) == (503, "event_log_unavailable", False)
            assert (error["delivered_output_tokens"], error["retryable"]) == (0, True)
            request_id = error["request_id"]
            assert isinstance(request_id, str)

            def closed(request_id: str = request_id) -> bool:
                return fold(gateway.events(request_id)).phase is Phase.TERMINATED

            wait_for(closed, 30, "the request to be closed in the log")
            events = gateway.events(request_id)
            assert violations(events) == []
            (failed,) = [e for e in events if isinstance(e, ev.RequestFailed)]
            assert (failed.code, failed.partial_output, failed.delivered_output_tokens, failed.retryable) == (
                "event_log_unavailable",
                False,
                0,
                True,
            ), f"stream={stream}: the log says otherwise than the client was told"
            assert not any(isinstance(e, ev.FirstDeltaCommitted | ev.RequestCompleted) for e in events)
