"""The first-token deadline of an ``openai`` replica (docs/routing.md): one whose first token comes only after 20 s.

A real ``phasegate serve`` process, on a real PostgreSQL, fronts two scripted
OpenAI-compatible upstreams (``vllm serve`` cannot be told to stall), each a process of
its own. Whichever takes a request's first attempt sends its first token only after
20 s. With ``openai_first_token_s`` = 1 s the gateway closes that attempt at the
deadline, which is the fence (vLLM aborts a request whose connection closed;
docs/design.md §7), and retries on the other upstream at once: no lease is waited out,
and the lease here is 30 s long to show it. The client (the ``openai`` SDK, and a raw
SSE reader) gets the whole answer once; the log, read back from PostgreSQL, says the
same: the attempt failed at the deadline, was released by the closed connection, and
the retry answered.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import httpx
import openai
import pytest

from app.store.postgres import PostgresEventStore
from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.replay import replay
from statemachine.request_state import Outcome
from tests.support.gateway import MODEL
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.served import ServedGateway, served_gateway
from tests.support.transcript import check_request, of, stream_chat

DEADLINE_S = 1.0
FIRST_TOKEN_AFTER_S = 20.0
LEASE_TTL_S = 30.0  # a fence that waited for the lease would hold the client this long
MAX_TOKENS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[ScriptedUpstream]]:
    with running_scripted_upstream() as first, running_scripted_upstream() as second:
        yield [first, second]


@pytest.fixture
def gateway(database_url: str, upstreams: list[ScriptedUpstream]) -> Iterator[ServedGateway]:
    settings = {
        "health_interval_s": 30,
        "resume_grace_s": 0,
        "timeouts": {"openai_first_token_s": DEADLINE_S, "lease_ttl_s": LEASE_TTL_S, "stall_s": 2.0},
    }
    replicas = tuple(f"openai={u.base_url}#u{n}" for n, u in enumerate(upstreams, start=1))
    with served_gateway(database_url, None, settings=settings, replicas=replicas) as served:
        yield served


def slow_first_attempt(upstreams: list[ScriptedUpstream]) -> None:
    """The first attempt of the next request, wherever it lands, sends its first token after 20 s."""
    for upstream in upstreams:
        upstream.script()  # nothing left over from an earlier request
        upstream.script({"delay_first_s": FIRST_TOKEN_AFTER_S, "attempt": 1})


def read_log(database_url: str, request_id: str) -> list[ev.Event]:
    async def read() -> list[ev.Event]:
        store = await PostgresEventStore.connect(database_url)
        try:
            return await store.read(request_id)
        finally:
            await store.close()

    return asyncio.run(read())


def wait_for_log_end(database_url: str, request_id: str, timeout: float = 10.0) -> list[ev.Event]:
    """The request's log once its terminal event is in (the answer may reach the client first)."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_log(database_url, request_id)
        if of(events, ev.RequestCompleted) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def assert_moved_at_the_deadline(events: list[ev.Event], upstreams: list[ScriptedUpstream]) -> None:
    """What the log must say: attempt 1 failed at the deadline, was fenced by closing its
    connection and released so, with no lease waited out; attempt 2 answered, alone."""
    first, second = of(events, ev.AttemptStarted)
    assert isinstance(first, ev.AttemptStarted) and isinstance(second, ev.AttemptStarted)
    assert first.aborts_on_close and not first.acknowledges_cancel
    assert first.replica_id != second.replica_id

    (failed,) = of(events, ev.UpstreamFailed)
    assert isinstance(failed, ev.UpstreamFailed) and failed.attempt == 1
    assert failed.kind is FailureKind.LIVENESS_UNCERTAIN
    assert failed.detail == f"no first token within {DEADLINE_S:g}s"
    waited = failed.occurred_at - first.occurred_at
    assert timedelta(seconds=DEADLINE_S * 0.9) <= waited < timedelta(seconds=DEADLINE_S + 2), waited

    fence = [e for e in events if isinstance(e, ev.Decided) and e.action == "fence_attempt"]
    assert [(d.reason, d.params["wait_for"]) for d in fence] == [("liveness_uncertain", "connection_close")]  # type: ignore[attr-defined]
    (fenced,) = of(events, ev.AttemptFenced)
    assert fenced.waiting_for == "connection_close"  # type: ignore[attr-defined]
    (released,) = of(events, ev.AttemptReleased)
    assert isinstance(released, ev.AttemptReleased) and released.attempt == 1
    assert released.because is ReleaseReason.CONNECTION_CLOSED
    assert not of(events, ev.LeaseExpired) and not of(events, ev.CancelAcked)
    order = [type(e).__name__ for e in events]
    assert order.index("AttemptFenced") < order.index("AttemptReleased") < events.index(second)
    assert second.occurred_at - failed.occurred_at < timedelta(seconds=2)  # no 30 s lease waited out

    # nothing of attempt 1 reached anyone; attempt 2 alone committed, delivered and completed
    produced = (ev.FirstTokenReceived, ev.FirstDeltaCommitted, ev.DeltasDelivered, ev.DeltasProduced)
    assert not [e for e in events if isinstance(e, produced) and e.attempt == 1]
    (committed,) = of(events, ev.FirstDeltaCommitted)
    assert committed.attempt == 2  # type: ignore[attr-defined]
    assert replay(events).ok

    # the upstream of attempt 1 saw its connection closed before it sent anything: what vLLM aborts
    request_id = events[0].request_id
    aborted = [a for upstream in upstreams for a in upstream.aborted if a.startswith(request_id)]
    assert aborted == [f"{request_id}.1"]


def test_the_openai_sdk_gets_the_whole_answer_from_the_second_replica(
    gateway: ServedGateway, upstreams: list[ScriptedUpstream], database_url: str
) -> None:
    prompt = f"a slow first token {uuid.uuid4().hex[:8]}"
    slow_first_attempt(upstreams)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test-key", max_retries=0, timeout=60)
    began = time.monotonic()
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, stream=True
    ) as chunks:
        request_id = chunks.response.headers["x-request-id"]
        received = [c.choices[0] for c in chunks if c.choices]
    deltas = [choice.delta.content for choice in received if choice.delta.content]
    finish = [choice.finish_reason for choice in received if choice.finish_reason]
    elapsed = time.monotonic() - began

    assert "".join(deltas) == "".join(answer(prompt, MAX_TOKENS))  # whole, and nothing twice
    assert len(deltas) == MAX_TOKENS
    assert elapsed < FIRST_TOKEN_AFTER_S / 2, elapsed  # moved at the 1 s deadline, not after 20 s

    events = wait_for_log_end(database_url, request_id)
    assert_moved_at_the_deadline(events, upstreams)
    delivered = [e for e in events if isinstance(e, ev.DeltasDelivered)]
    assert "".join(e.text or "" for e in delivered) == "".join(deltas)  # the client and the log agree
    assert sum(e.tokens for e in delivered) == len(deltas)
    (completed,) = of(events, ev.RequestCompleted)
    assert [completed.finish_reason] == finish == ["length"]  # type: ignore[attr-defined]
    client.close()
    metrics = httpx.get(gateway.url + "/metrics").text.splitlines()
    fences = [line for line in metrics if "fenced_attempts_total{" in line]
    assert [line.split("{")[1].split("}")[0] for line in fences] == ['released_by="connection_close"']


def test_a_raw_sse_client_gets_each_delta_once(
    gateway: ServedGateway, upstreams: list[ScriptedUpstream], database_url: str
) -> None:
    prompt = f"a slow first token, raw {uuid.uuid4().hex[:8]}"
    slow_first_attempt(upstreams)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    transcript = stream_chat(gateway.url, body)
    assert transcript.done and transcript.error is None
    assert transcript.text == "".join(answer(prompt, MAX_TOKENS))

    events = wait_for_log_end(database_url, transcript.request_id)
    state = check_request(events, transcript)  # SSE ids 0…n-1 once each, the log's text and counts
    assert state.outcome is Outcome.COMPLETED and state.delivered_deltas == MAX_TOKENS
    assert_moved_at_the_deadline(events, upstreams)
