"""A message's stream under faults and resumed (docs/design.md §6, §12, §17), over real sim
workers, judged by what the client got and by the log: a replica killed before the first
delta is retried into one answer; after it, the stream ends with Anthropic's ``error`` event
carrying the §6 fields; a resume by ``Last-Event-ID`` on another instance gets the rest of
the events byte for byte.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from app.config import Timeouts
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

Frame = tuple[int, str, dict[str, Any], bytes]  # id, event, data, the frame's bytes


@pytest.fixture(scope="module")
def slow_worker() -> Iterator[WorkerProcess]:
    with running_worker(faults=True, args=["--model", MODEL, "--sim-decode-ms-per-token", "30"]) as worker:
        yield worker


def frames(raw: bytes) -> list[Frame]:
    """The stream's events (comments, such as keep-alive pings, left out)."""
    found = []
    for frame in raw.split(b"\n\n"):
        lines = frame.decode().split("\n")
        if not frame.strip() or lines[0].startswith(":"):
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        found.append((int(fields["id"]), fields["event"], json.loads(fields["data"]), frame + b"\n\n"))
    return found


def stream_message(
    url: str, prompt: str, max_tokens: int = 12, on_event: Callable[[int], bool] | None = None
) -> tuple[str, bytes]:
    """POST a streamed message; its request id and the bytes read (up to the event
    ``on_event`` says to leave at: the client goes away there)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": prompt}]}
    read = b""
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/messages", json=body) as answer:
        assert answer.status_code == 200, answer.read()
        for chunk in answer.iter_raw():
            read += chunk
            if on_event is not None and read.endswith(b"\n\n") and on_event(len(frames(read))):
                break
        return answer.headers["x-request-id"], read


def resume(url: str, request_id: str, after: int | None) -> bytes:
    headers = {} if after is None else {"last-event-id": str(after)}
    with httpx.Client(timeout=30) as http:
        answer = http.get(f"{url}/v1/requests/{request_id}/stream", headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.content


def texts(found: list[Frame]) -> list[str]:
    return [data["delta"]["text"] for _, kind, data, _ in found if data.get("delta", {}).get("type") == "text_delta"]


def test_a_replica_dying_after_the_first_delta_ends_the_stream_with_the_error_event(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("interrupt the message")
    for worker in fresh_pair:
        add_fault(worker, action="die", point="after_frame", at_token=2, match={"prompt_contains": prompt})
    with running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway:
        request_id, raw = stream_message(gateway.url, prompt, max_tokens=20)
        logged = gateway.events(request_id)
    found = frames(raw)
    assert [number for number, *_ in found] == list(range(len(found)))
    delivered = texts(found)
    assert found[0][1] == "message_start" and delivered
    _, kind, data, _ = found[-1]
    assert kind == "error" and data["type"] == "error"
    error = data["error"]
    assert error["type"] == "api_error" and error["code"] == "upstream_decode_interrupted"
    assert error["partial_output"] is True and error["retryable"] is False and error["request_id"] == request_id
    assert error["delivered_output_tokens"] == len(delivered)  # one token a delta: what the client received
    state = fold(logged)
    assert state.outcome is Outcome.FAILED and state.delivered_output_tokens == len(delivered)
    assert len(of(logged, ev.AttemptStarted)) == 1 and replay(logged).ok


def test_the_sdk_raises_the_error_event_with_its_fields(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("interrupt the sdk")
    for worker in fresh_pair:
        add_fault(worker, action="die", point="after_frame", at_token=3, match={"prompt_contains": prompt})
    with (
        running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway,
        anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=30) as client,
    ):
        received: list[str] = []
        with (
            pytest.raises(anthropic.APIStatusError) as failed,
            client.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": prompt}]) as s,
        ):
            for text in s.text_stream:
                received.append(text)
        body = failed.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["delivered_output_tokens"] == len(received) > 0
        assert body["error"]["code"] == "upstream_decode_interrupted"


def test_a_replica_dying_before_the_first_delta_is_retried_into_one_message(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("retry the message")
    for worker in fresh_pair:  # whichever replica gets attempt 1 dies
        add_fault(worker, action="die", point="prefill", at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    with (
        running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway,
        anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=30) as client,
    ):
        with client.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": prompt}]) as s:
            kinds = [event.type for event in s]
            final = s.get_final_message()
        logged = gateway.events("req_" + final.id.removeprefix("msg_"))
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    text = final.content[0].text  # type: ignore[union-attr]
    assert text != "" and "".join(e.text or "" for e in of(logged, ev.DeltasDelivered)) == text  # type: ignore[attr-defined]
    assert [s.attempt for s in of(logged, ev.AttemptStarted)] == [1, 2]  # type: ignore[attr-defined]
    assert fold(logged).outcome is Outcome.COMPLETED and replay(logged).ok


def test_a_finished_stream_resumes_byte_for_byte_from_any_event_on_another_instance(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with (
        running_gateway(database_url, [slow_worker]) as first,
        running_gateway(database_url, [slow_worker]) as second,
    ):
        request_id, raw = stream_message(first.url, "resume me", max_tokens=8)
        whole = frames(raw)
        assert whole[-1][1] == "message_stop"
        for after in (None, 0, 1, 4, len(whole) - 2):
            again = frames(resume(second.url, request_id, after))
            start = 0 if after is None else after + 1
            assert [frame for *_, frame in again] == [frame for *_, frame in whole[start:]]
        first.settle()
        second.settle()
        events = second.events(request_id)
        assert fold(events).outcome is Outcome.COMPLETED and len(of(events, ev.StreamResumed)) == 5
        assert replay(events).ok


def test_a_client_that_left_mid_stream_gets_the_rest_through_another_instance(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with (
        running_gateway(database_url, [slow_worker], resume_grace_s=30) as owner,
        running_gateway(database_url, [slow_worker]) as other,
    ):
        request_id, raw = stream_message(owner.url, "leave midway", max_tokens=30, on_event=lambda n: n >= 6)
        first = frames(raw)
        last = first[-1][0]
        rest = frames(resume(other.url, request_id, last))  # live at the owner: passed on from there
        owner.settle()
        events = owner.events(request_id)
    assert [number for number, *_ in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1][1] == "message_stop"
    assert "".join(texts(first) + texts(rest)) == "".join(e.text or "" for e in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok


def test_a_cancelled_message_ends_its_stream_with_the_error_event(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with running_gateway(database_url, [slow_worker]) as gateway:
        seen: list[int] = []
        results: list[tuple[str, bytes]] = []
        thread = threading.Thread(
            target=lambda: results.append(stream_message(gateway.url, "stop me", 60, lambda n: bool(seen.append(n)))),
            daemon=True,
        )
        thread.start()
        deadline = time.monotonic() + 30
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        (request_id,) = gateway.gateway.ctx.drivers
        stopped = httpx.post(f"{gateway.url}/v1/requests/{request_id}/cancel", timeout=10)
        assert stopped.status_code == 200, stopped.text
        thread.join(30)
        events = gateway.events(request_id)
    _, raw = results[0]
    found = frames(raw)
    _, kind, data, _ = found[-1]
    assert kind == "error" and data["error"]["code"] == "request_cancelled"
    assert data["error"]["delivered_output_tokens"] == len(texts(found)) == fold(events).delivered_output_tokens
    assert fold(events).outcome is Outcome.CANCELLED and replay(events).ok
