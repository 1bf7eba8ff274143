"""Background responses (docs/design.md §15), with the real `openai` client over real sim
workers and real gateways: answered ``queued`` at once, generated with nobody attached,
read by polling or by streaming from the log, attached to by a reader (whose first delta
is then the commit point), picked up with ``starting_after`` on another instance, and
cancelled. Each test judges by what the clients received and by the log.

A test that needs the response still generating when a reader comes holds its attempt at
a token (the worker's ``hold`` fault) and releases it once the log shows the reader
attached (tests/app/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.invariants import violations
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.api.test_responses import LOOKUP, request_id_of
from tests.app.conftest import add_fault, held
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

HELD = {"stall_s": 60.0}  # a held attempt publishes nothing: not a stall in these tests
TOKENS = 16


@pytest.fixture
def gateway(database_url: str, sim_pair: list[WorkerProcess]) -> Iterator[RunningGateway]:
    for worker in sim_pair:
        httpx.delete(worker.base_url + "/admin/faults")
    # no grace for a client that leaves: a background response needs none
    with running_gateway(database_url, sim_pair, resume_grace_s=0, timeouts=HELD) as running:
        yield running


def asked(prompt: str, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": prompt, "max_output_tokens": TOKENS, "temperature": 0, **more}


def summary(events: list[Any]) -> list[tuple[str, int, str]]:
    return [(e.type, e.sequence_number, getattr(e, "delta", "")) for e in events]


def when_ended(gateway: RunningGateway, response_id: str) -> Any:
    """The response once the log says it ended, read then: no poll while it ran (a poll
    that shows output is a delivery)."""
    gateway.wait_logged("req_" + response_id.removeprefix("resp_"), lambda events: fold(events).outcome is not None)
    return gateway.openai().responses.retrieve(response_id)


def wait_until_ended(gateway: RunningGateway, response_id: str, timeout: float = 60.0) -> Any:
    """Poll as a client of a background response does."""
    deadline = time.monotonic() + timeout
    while (response := gateway.openai().responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)
    return response


def reached(index: int) -> Callable[[list[ev.Event]], bool]:
    """The log holds delta ``index``, delivered or produced."""
    return lambda events: any(
        isinstance(e, ev.DeltasDelivered | ev.DeltasProduced) and e.to_index > index for e in events
    )


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in events if isinstance(e, ev.DeltasDelivered))


def attached(events: list[ev.Event]) -> bool:
    return bool(of(events, ev.ClientResumed))


def assert_log_sound(events: list[ev.Event]) -> None:
    assert violations(events) == [], violations(events)
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()


def test_a_background_response_is_queued_at_once_and_generated_with_nobody_attached(
    gateway: RunningGateway, unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    prompt = unique_prompt("in the background")
    queued = client.responses.create(**asked(prompt), background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = when_ended(gateway, queued.id)
    plain = client.responses.create(**asked(prompt))  # the same request, answered whole
    assert (done.status, done.output_text) == (plain.status, plain.output_text) and done.output_text
    assert done.usage is not None and done.usage.output_tokens == TOKENS and done.background is True
    with client.responses.stream(**asked(prompt)) as stream:  # type: ignore[call-overload]
        streamed = list(stream)
    reread = list(client.responses.retrieve(queued.id, stream=True))  # from the log, after its end
    assert summary(reread) == summary(streamed)
    events = gateway.events(request_id_of(queued))
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.background and not accepted.stream
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 1
    assert state.produced_deltas == TOKENS and not of(events, ev.DeltasDelivered)  # nobody read it live
    assert not of(events, ev.ClientDisconnected) and not of(events, ev.FirstDeltaCommitted)
    # the poll after its end (when_ended), then the stream read from the log, as the log says
    reads = [(e.from_index, e.to_index) for e in of(events, ev.StreamResumed)]  # type: ignore[attr-defined]
    assert reads == [(0, TOKENS), (0, TOKENS)]
    assert_log_sound(events)


def test_a_reader_attaches_to_a_live_background_response_and_its_first_delta_is_the_commit_point(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    prompt = unique_prompt("read while live")
    with held(sim_pair[0], prompt, at_token=5) as release, ThreadPoolExecutor(1) as pool:
        queued = client.responses.create(**asked(prompt), background=True)
        request_id = request_id_of(queued)
        gateway.wait_logged(request_id, reached(4))  # produced with nobody attached
        reading = pool.submit(lambda: list(client.responses.retrieve(queued.id, stream=True)))
        gateway.wait_logged(request_id, attached)
        release()
        read = reading.result(timeout=60)
    with client.responses.stream(**asked(prompt)) as stream:  # type: ignore[call-overload]
        streamed = list(stream)
    assert summary(read) == summary(streamed)  # every event, numbered as a stream of its own
    events = gateway.events(request_id)
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 1
    order = [type(e).__name__ for e in events]
    assert order.index("DeltasProduced") < order.index("ClientResumed") < order.index("FirstDeltaCommitted")
    (back,) = of(events, ev.ClientResumed)
    assert back.after == -1  # type: ignore[attr-defined]  # a reader from the start
    assert state.delivered_deltas == TOKENS  # everything it read is in the log as delivered
    assert delivered_text(events) == read[-1].response.output_text
    assert_log_sound(events)


def test_a_dropped_background_stream_is_picked_up_with_starting_after_on_another_instance(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("dropped and picked up")
    with (
        running_gateway(database_url, sim_pair, resume_grace_s=0, timeouts=HELD) as owner,
        running_gateway(database_url, sim_pair, resume_grace_s=0, timeouts=HELD) as other,
        held(sim_pair[0], prompt, at_token=10) as release,
        ThreadPoolExecutor(1) as pool,
    ):
        first: list[Any] = []
        stream = owner.openai().responses.create(**asked(prompt), background=True, stream=True)
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta" and event.delta and len(first) > 6:
                break
        stream.close()  # the connection drops; with no grace, a background response goes on
        response_id = first[0].response.id
        request_id = "req_" + response_id.removeprefix("resp_")
        owner.wait_logged(request_id, lambda events: of(events, ev.ClientDisconnected) and reached(9)(events))
        client = other.openai()
        after = first[-1].sequence_number
        later = pool.submit(lambda: list(client.responses.retrieve(response_id, stream=True, starting_after=after)))
        owner.wait_logged(request_id, attached)
        release()
        rest = later.result(timeout=60)
        whole = list(client.responses.retrieve(response_id, stream=True))  # from the log, after the end
        events = owner.events(request_id)
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))  # none missing, none twice
    assert summary(first + rest) == summary(whole) and rest[-1].type == "response.completed"
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 1
    (back,) = of(events, ev.ClientResumed)
    assert back.gateway == owner.gateway.instance_id  # type: ignore[attr-defined]  # attached at the owner
    assert not of(events, ev.ResumeGraceExpired) and not of(events, ev.CancelSent)
    assert state.delivered_deltas == TOKENS
    assert_log_sound(events)


def test_a_background_response_is_cancelled_through_another_instance(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("cancel me")
    with (
        running_gateway(database_url, sim_pair, timeouts=HELD) as owner,
        running_gateway(database_url, sim_pair, timeouts=HELD) as other,
        held(sim_pair[0], prompt, at_token=3),
    ):
        queued = owner.openai().responses.create(**asked(prompt), background=True)
        owner.wait_logged(request_id_of(queued), reached(2))
        cancelled = other.openai().responses.cancel(queued.id)  # forwarded to the owner
        assert cancelled.status == "cancelled" and cancelled.error is not None
        assert cancelled.error.code == "request_cancelled"  # type: ignore[comparison-overlap]
        again = other.openai().responses.cancel(queued.id)  # ended: answered as it stands
        assert again.status == "cancelled"
        events = owner.events(request_id_of(queued))
    (ended,) = of(events, ev.RequestCancelled)
    assert ended.reason == "cancelled_by_client"  # type: ignore[attr-defined]
    assert_log_sound(events)


def test_a_background_response_that_calls_a_tool_gives_the_call_once_ended(gateway: RunningGateway) -> None:
    """Generated with no client attached, a choice's tool calls are recorded produced under
    ``tool_calls``: the ended response read from the log has the call, not its JSON as text."""
    client = gateway.openai()
    tool_choice = {"type": "function", "name": "lookup"}
    queued = client.responses.create(
        model=MODEL, input="what does ephemeral mean", tools=[LOOKUP], tool_choice=tool_choice, background=True
    )  # type: ignore[call-overload]
    done = when_ended(gateway, queued.id)
    calls = [item for item in done.output if item.type == "function_call"]
    assert done.status == "completed" and len(calls) == 1 and calls[0].name == "lookup"
    assert done.output_text == "" and isinstance(json.loads(calls[0].arguments).get("word"), str)
    produced = [e for e in gateway.events(request_id_of(queued)) if isinstance(e, ev.DeltasProduced)]
    assert produced and produced[-1].fields[-1] == TOOL_CALLS


def test_a_background_response_whose_replica_dies_before_anyone_read_it_is_retried(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("dies unread")
    for worker in fresh_pair:
        add_fault(
            worker, action="die", point="after_frame", at_token=4, match={"prompt_contains": prompt, "attempt": 1}
        )
    with running_gateway(database_url, fresh_pair) as gateway:
        client = gateway.openai()
        queued = client.responses.create(**asked(prompt), background=True)
        done = when_ended(gateway, queued.id)
        for worker in fresh_pair:  # the survivor's fault would kill the reference request too
            with contextlib.suppress(httpx.ConnectError):
                httpx.delete(worker.base_url + "/admin/faults")
        plain = client.responses.create(**asked(prompt))
        events = gateway.events(request_id_of(queued))
    assert (done.status, done.output_text) == (plain.status, plain.output_text)  # one answer, not a splice
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 2
    produced_by = {e.attempt for e in of(events, ev.DeltasProduced)}  # type: ignore[attr-defined]
    assert produced_by == {1, 2} and not of(events, ev.DeltasDelivered)  # attempt 1's output nobody read
    assert_log_sound(events)


def test_a_background_response_read_in_part_then_failed_ends_failed_with_what_was_read(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("read then dies")
    with (
        running_gateway(database_url, fresh_pair, timeouts=HELD) as gateway,
        held(fresh_pair[0], prompt, at_token=3) as release,
        ThreadPoolExecutor(1) as pool,
    ):
        client = gateway.openai()
        queued = client.responses.create(**asked(prompt), background=True)
        request_id = request_id_of(queued)
        gateway.wait_logged(request_id, reached(2))
        reading = pool.submit(lambda: list(client.responses.retrieve(queued.id, stream=True)))
        gateway.wait_logged(request_id, attached)
        release(hold_at=6)  # the reader gets deltas 0..5, then the replica dies
        gateway.wait_logged(request_id, lambda events: fold(events).delivered_deltas == 6)
        fresh_pair[0].kill()
        read = reading.result(timeout=60)
        polled = client.responses.retrieve(queued.id)
        events = gateway.events(request_id)
    assert read[-1].type == "response.failed"
    error = read[-1].response.error
    assert error.code == "upstream_decode_interrupted"
    state = fold(events)
    assert state.outcome is Outcome.FAILED and len(state.attempts) == 1  # never retried after a delivery
    (failed,) = of(events, ev.RequestFailed)
    assert failed.delivered_output_tokens == 6  # type: ignore[attr-defined]
    sent = "".join(e.delta for e in read if e.type == "response.output_text.delta")
    assert sent == delivered_text(events)
    assert polled.status == "failed" and polled.output_text == sent
    assert_log_sound(events)


def test_a_poll_of_a_live_background_response_on_another_instance_shows_its_output_and_delivers_it(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    """A poll is a delivery (docs/design.md §15): passed on to the owner, which records it; the
    first one that shows output is the commit point, so a failure after it is no retry."""
    prompt = unique_prompt("polled then dies")
    with (
        running_gateway(database_url, fresh_pair, timeouts=HELD) as owner,
        running_gateway(database_url, fresh_pair, timeouts=HELD) as other,
        held(fresh_pair[0], prompt, at_token=0) as release,
    ):
        client = other.openai()
        queued = owner.openai().responses.create(**asked(prompt), background=True)
        request_id = request_id_of(queued)
        owner.wait_logged(request_id, lambda events: of(events, ev.AttemptStarted))
        nothing_yet = client.responses.retrieve(queued.id)  # held before its first token
        assert (nothing_yet.status, nothing_yet.output) == ("in_progress", [])
        release(hold_at=5)
        owner.wait_logged(request_id, reached(4))
        first = client.responses.retrieve(queued.id)  # passed on to the owner
        again = client.responses.retrieve(queued.id)  # nothing new: recorded as nothing
        assert first.status == "in_progress" and first.output_text and again.output_text == first.output_text
        assert first.output[0].status == "in_progress"  # type: ignore[union-attr]
        fresh_pair[0].kill()  # the replica dies after the poll showed part of the answer
        failed = wait_until_ended(other, queued.id)
        events = owner.events(request_id)
    state = fold(events)
    assert state.outcome is Outcome.FAILED and len(state.attempts) == 1  # the poll was a delivery: no retry
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "upstream_decode_interrupted"  # type: ignore[comparison-overlap]
    assert failed.output_text.startswith(first.output_text)
    assert delivered_text(events) == first.output_text and state.delivered_deltas == 5
    order = [type(e).__name__ for e in events]
    assert order.count("ClientResumed") == order.count("ClientDisconnected") == 1  # one poll with output
    assert order.index("ClientResumed") < order.index("FirstDeltaCommitted") < order.index("DeltasDelivered")
    (back,) = of(events, ev.ClientResumed)
    assert back.gateway == owner.gateway.instance_id  # type: ignore[attr-defined]
    assert_log_sound(events)


def test_a_background_response_is_answered_once_to_its_idempotent_retry_and_refused_unstored(
    gateway: RunningGateway, unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    key = {"Idempotency-Key": unique_prompt("background key")}
    one = client.responses.create(**asked("once"), background=True, extra_headers=key)
    two = client.responses.create(**asked("once"), background=True, extra_headers=key)
    assert two.id == one.id and two.status in ("queued", "in_progress", "incomplete")  # as it stands
    assert wait_until_ended(gateway, one.id).status == "incomplete"  # cut at max_output_tokens
    events = gateway.events(request_id_of(one))
    assert len(of(events, ev.RequestAccepted)) == 1 and len(of(events, ev.AttemptStarted)) == 1
    with gateway.http() as http:
        unstored = http.post("/v1/responses", json={**asked("x"), "background": True, "store": False})
        odd = http.post("/v1/responses", json={**asked("x"), "background": "yes"})
    assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "store"
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "background"


def test_without_the_text_in_the_log_a_poll_with_output_is_refused_until_the_end(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("digest only")
    with (
        running_gateway(database_url, sim_pair, content_policy="digest", timeouts=HELD) as gateway,
        held(sim_pair[0], prompt, at_token=3) as release,
    ):
        client = gateway.openai()
        queued = client.responses.create(**asked(prompt), background=True)
        gateway.wait_logged(request_id_of(queued), reached(2))
        with pytest.raises(openai.ConflictError) as refused:
            gateway.openai(max_retries=0).responses.retrieve(queued.id)  # the SDK retries a 409 by default
        assert refused.value.code == "resume_unavailable"
        release()
        ended = when_ended(gateway, queued.id)
        events = gateway.events(request_id_of(queued))
    assert ended.status == "incomplete" and not of(events, ev.DeltasDelivered)  # the refused poll delivered nothing
    assert_log_sound(events)
