"""Resuming a stream from the log (docs/design.md §12), with raw SSE, real workers, real PostgreSQL.

Each test compares what the first client got plus what a resumer got with what the
log says was delivered: every delta index exactly once, in order, then the same end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of, stream_chat
from tests.support.transcript import resume_stream as resume
from tests.support.workers import WorkerProcess, running_worker


@pytest.fixture(scope="module")
def slow_worker() -> Iterator[WorkerProcess]:
    with running_worker(faults=True, args=["--model", MODEL, "--sim-decode-ms-per-token", "30"]) as worker:
        yield worker


def body(prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in of(events, ev.DeltasDelivered) if e.tokens)  # type: ignore[attr-defined]


@pytest.mark.parametrize("left_at", range(9))
def test_a_client_that_left_at_any_delta_resumes_every_later_one_exactly_once(
    database_url: str, slow_worker: WorkerProcess, left_at: int, gateway_over: Any
) -> None:
    gateway = gateway_over(slow_worker)
    first = stream_chat(gateway.url, body(f"leave at {left_at}"), on_delta=lambda n: n == left_at + 1)
    assert len(first.contents) == left_at + 1 and not first.done
    gateway.settle()
    resumed = resume(gateway.url, first.request_id, left_at)
    events = gateway.events(first.request_id)
    assert resumed.status == 200 and resumed.done
    n = len(resumed.contents)
    assert resumed.event_ids[:n] == list(range(left_at + 1, left_at + 1 + n))  # no index missing or repeated
    assert first.text + resumed.text == delivered_text(events)  # the log's answer, exactly once
    state = fold(events)
    # the client had left: cancelled, unless the answer's last tokens came before the gateway
    # saw it go (a loaded machine); the resumer is told what the log says, either way
    if state.outcome is Outcome.CANCELLED:
        assert resumed.error is not None and resumed.error["code"] == "request_cancelled"
        assert resumed.error["delivered_output_tokens"] == state.delivered_output_tokens
    else:
        assert state.outcome is Outcome.COMPLETED and resumed.error is None and resumed.finish_reason == "length"
    assert of(events, ev.StreamResumed)[-1].from_index == left_at + 1  # type: ignore[attr-defined]
    assert replay(events).ok


def test_a_finished_answer_resumes_from_any_point_and_from_any_instance(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with (
        running_gateway(database_url, [slow_worker]) as first,
        running_gateway(database_url, [slow_worker]) as second,
    ):
        whole = stream_chat(first.url, body("whole", max_tokens=10))
        assert whole.done and whole.error is None
        for after in (None, 0, 4, 9):
            again = resume(second.url, whole.request_id, after)
            start = 0 if after is None else after + 1
            assert again.contents == whole.contents[start:] and again.done
            assert again.finish_reason == whole.finish_reason and again.error is None
        first.settle()
        second.settle()
        events = second.events(whole.request_id)
        assert fold(events).outcome is Outcome.COMPLETED and len(of(events, ev.StreamResumed)) == 4
        assert {e.gateway for e in of(events, ev.StreamResumed)} == {second.gateway.instance_id}  # type: ignore[attr-defined]
        assert replay(events).ok


def test_a_live_answer_is_followed_to_its_end_through_another_instance(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with (
        running_gateway(database_url, [slow_worker]) as owner,
        running_gateway(database_url, [slow_worker]) as other,
    ):
        seen: list[int] = []
        streams: list[Transcript] = []
        thread = threading.Thread(
            target=lambda: streams.append(stream_chat(owner.url, body("live", 40), on_delta=seen.append)), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 30
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        (request_id,) = owner.gateway.ctx.drivers  # the one request in flight
        resumers = [resume(other.url, request_id, 2)]
        thread.join(30)
        (original,) = streams
        for resumed in resumers:  # the rest, with no gap and no duplicate at the seam
            assert resumed.contents == original.contents[3:] and resumed.done and resumed.error is None
            assert resumed.event_ids[: len(resumed.contents)] == list(range(3, len(original.contents)))


def test_two_resumers_at_once_get_the_same_tail(database_url: str, slow_worker: WorkerProcess) -> None:
    with running_gateway(database_url, [slow_worker]) as gateway:
        whole = stream_chat(gateway.url, body("twice", 20))
        results: list[Transcript] = []
        threads = [
            threading.Thread(target=lambda: results.append(resume(gateway.url, whole.request_id, 5))) for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert [r.contents for r in results] == [whole.contents[6:]] * 2
        gateway.settle()
        assert len(of(gateway.events(whole.request_id), ev.StreamResumed)) == 2  # both recorded, neither lost


def test_a_resumer_of_an_answer_cut_by_its_replica_gets_the_tail_then_the_final_error(database_url: str) -> None:
    prompt = "cut mid-answer"
    with (
        running_worker(faults=True, args=["--model", MODEL]) as dying,
        running_gateway(database_url, [dying]) as gateway,
    ):
        add_fault(dying, action="die", point="after_frame", at_token=4, match={"prompt_contains": prompt})
        original = stream_chat(gateway.url, body(prompt, 30))
        assert original.error is not None and original.error["code"] == "upstream_decode_interrupted"
        resumed = resume(gateway.url, original.request_id, 1)
        assert resumed.contents == original.contents[2:]
        assert resumed.error == original.error  # the same final error, field for field


def test_without_text_in_the_log_there_is_nothing_to_resume(database_url: str, slow_worker: WorkerProcess) -> None:
    with running_gateway(database_url, [slow_worker], content_policy="digest") as gateway:
        whole = stream_chat(gateway.url, body("digest only", 4))
        refused = resume(gateway.url, whole.request_id, 1)
        assert refused.status == 409 and refused.error is not None
        assert refused.error["code"] == "resume_unavailable" and "completed" in refused.error["message"]


def test_a_resume_is_refused_to_another_tenant_and_for_a_bad_index(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    keys = {"key-of-acme-0123456789": "acme", "key-of-globex-0123456789": "globex"}
    with running_gateway(database_url, [slow_worker], api_keys=keys) as gateway:
        acme = {"authorization": "Bearer key-of-acme-0123456789"}
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            request_id = http.post("/v1/chat/completions", json=body("mine", 3), headers=acme).headers["x-request-id"]
        gateway.settle()
        assert resume(gateway.url, request_id, None, **acme).done
        other = resume(gateway.url, request_id, None, authorization="Bearer key-of-globex-0123456789")
        assert other.status == 404 and other.error is not None and other.error["code"] == "request_not_found"
        for bad in ("-1", "x", "9" * 30):
            refused = resume(gateway.url, request_id, None, **acme, **{"last-event-id": bad})
            assert refused.status == 400 and refused.error is not None and refused.error["param"] == "Last-Event-ID"
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            superscript = http.get(f"/v1/requests/{request_id}/stream", params={"after": "²"}, headers=acme)
        assert superscript.status_code == 400 and superscript.json()["error"]["param"] == "after"


@pytest.fixture
def gateway_over(database_url: str) -> Iterator[Any]:
    """A gateway over the given worker, for parametrized tests that build their own."""
    stack: list[Any] = []

    def build(worker: WorkerProcess) -> RunningGateway:
        # no grace: the client that left is cancelled, and the resume is served from the log
        # (tests/app/api/test_disconnect_grace.py resumes within the grace)
        context = running_gateway(database_url, [worker], resume_grace_s=0)
        stack.append(context)
        return context.__enter__()

    yield build
    for context in reversed(stack):
        context.__exit__(None, None, None)
