"""Every read is recorded (docs/design.md §15): a poll or a stream of a background response
that already ended, and that shows output, is bookkeeping after the terminal event
(``StreamResumed``) naming what that read showed, as a chat resume after the end is; and
the timeline tells a background response's reader leaving for what it is (no grace).
Real gateway, real sim workers, the real ``openai`` client."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.incident.describe import describe_event
from app.incident.timeline import timeline
from statemachine import events as ev
from statemachine.state import fold
from tests.app.api.test_responses import request_id_of
from tests.app.api.test_responses_background import TOKENS, asked, assert_log_sound, attached, gateway, reached
from tests.app.conftest import held
from tests.support.audit import fold_disagreements_in, read_model_row
from tests.support.gateway import RunningGateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

__all__ = ["gateway"]  # the background tests' gateway: no grace, held attempts are no stall


def ended(gateway: RunningGateway, request_id: str) -> list[ev.Event]:
    gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    return gateway.events(request_id)


def delivered_tokens(database_url: str, request_id: str, events: list[ev.Event]) -> int:
    """``requests.delivered_output_tokens``, once the read model agrees with the fold."""
    assert fold_disagreements_in(database_url, [request_id]) == []
    row_tokens = int(read_model_row(database_url, request_id)["delivered_output_tokens"])
    assert row_tokens == fold(events).delivered_output_tokens
    return row_tokens


def delivered_deltas(database_url: str, request_id: str) -> int:
    """``requests.delivered_deltas`` (the request list's count): the most deltas any reader
    was shown, live or by a read after the end (``StreamResumed``'s ``to_index``)."""
    return int(read_model_row(database_url, request_id)["delivered_deltas"])


def shown(response: Any) -> int:
    """The output tokens a client was shown: the usage of what it read (a token a delta here)."""
    return int(response.usage.output_tokens)


def reads(events: list[ev.Event]) -> list[tuple[int, int]]:
    return [(e.from_index, e.to_index) for e in of(events, ev.StreamResumed)]  # type: ignore[attr-defined]


def test_a_poll_after_the_end_is_a_read_the_log_records(
    gateway: RunningGateway, database_url: str, unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    queued = client.responses.create(**asked(unique_prompt("polled after its end")), background=True)
    request_id = request_id_of(queued)
    assert reads(ended(gateway, request_id)) == []  # nobody has read it yet
    polled = client.responses.retrieve(queued.id)
    assert polled.status == "incomplete" and polled.output_text  # ended at max_output_tokens
    events = gateway.events(request_id)
    assert reads(events) == [(0, TOKENS)]  # what the poll showed: every delta
    assert delivered_tokens(database_url, request_id, events) == shown(polled) == TOKENS
    assert delivered_deltas(database_url, request_id) == TOKENS  # a delta a token here, as shown
    assert_log_sound(events)


def test_a_stream_after_the_end_is_a_read_the_log_records(
    gateway: RunningGateway, database_url: str, unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    queued = client.responses.create(**asked(unique_prompt("streamed after its end")), background=True)
    request_id = request_id_of(queued)
    ended(gateway, request_id)
    streamed = list(client.responses.retrieve(queued.id, stream=True))
    assert streamed[-1].type in ("response.completed", "response.incomplete")
    events = gateway.events(request_id)
    assert reads(events) == [(0, TOKENS)]
    sent = sum(1 for event in streamed if event.type == "response.output_text.delta")
    assert delivered_tokens(database_url, request_id, events) == sent == TOKENS
    assert delivered_deltas(database_url, request_id) == sent
    assert_log_sound(events)


def test_a_poll_while_live_then_a_poll_after_the_end_are_both_in_the_log(
    gateway: RunningGateway, database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    prompt = unique_prompt("polled twice")
    with held(sim_pair[0], prompt, at_token=5) as release:
        queued = client.responses.create(**asked(prompt), background=True)
        request_id = request_id_of(queued)
        gateway.wait_logged(request_id, reached(4))
        live = client.responses.retrieve(queued.id)  # a delivery: the live poll's own record
        assert live.status == "in_progress" and live.output_text
        release()
    events = ended(gateway, request_id)
    assert fold(events).delivered_deltas == 5  # what the live poll showed
    assert delivered_tokens(database_url, request_id, events) == 5  # before the second read
    last = client.responses.retrieve(queued.id)
    assert last.status == "incomplete" and len(last.output_text) > len(live.output_text)
    events = gateway.events(request_id)
    assert reads(events) == [(0, TOKENS)]  # the poll after the end showed every delta
    assert delivered_tokens(database_url, request_id, events) == shown(last) == TOKENS  # the most shown
    assert fold(events).delivered_deltas == 5  # delivered live: where the produced tail starts
    assert_log_sound(events)
    # the poller left: a background response has no grace, and its timeline says so
    (gone,) = of(events, ev.ClientDisconnected)
    described = describe_event(gone, background=True)
    assert "no grace" in described and "come back" not in described
    rows, _ = timeline(events, None)
    (row,) = [row for row in rows if row.event.startswith("ClientDisconnected")]
    assert "no grace applies" in row.event


def test_a_stream_read_while_live_then_after_the_end(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    prompt = unique_prompt("streamed twice")
    with held(sim_pair[0], prompt, at_token=5) as release, ThreadPoolExecutor(1) as pool:
        queued = client.responses.create(**asked(prompt), background=True)
        request_id = request_id_of(queued)
        gateway.wait_logged(request_id, reached(4))
        reading = pool.submit(lambda: list(client.responses.retrieve(queued.id, stream=True)))
        gateway.wait_logged(request_id, attached)
        release()
        reading.result(timeout=60)
    events = ended(gateway, request_id)
    assert fold(events).delivered_deltas == TOKENS and reads(events) == []  # read live: delivered
    list(client.responses.retrieve(queued.id, stream=True))
    assert reads(gateway.events(request_id)) == [(0, TOKENS)]


def test_a_poll_and_a_stream_of_one_ended_response_say_the_same(
    gateway: RunningGateway, unique_prompt: Callable[[str], str]
) -> None:
    """For one log, a poll and a stream say the same response: the stream's last event is
    ``response.completed`` whatever the status (as vLLM sends it; the SDK's stream helper
    takes its final response from that event alone, docs/responses.md), and the response
    it carries is the poll's, ``incomplete`` at ``max_output_tokens`` in both; read after
    the end from the log, and read live."""
    client = gateway.openai()
    queued = client.responses.create(**asked(unique_prompt("polled and streamed after its end")), background=True)
    ended(gateway, request_id_of(queued))
    polled = client.responses.retrieve(queued.id)
    streamed = list(client.responses.retrieve(queued.id, stream=True))
    assert streamed[-1].type == "response.completed"
    assert polled.status == streamed[-1].response.status == "incomplete"
    assert polled.incomplete_details is not None and polled.incomplete_details.reason == "max_output_tokens"
    assert streamed[-1].response.model_dump() == polled.model_dump()
    assert client.responses.retrieve(queued.id).model_dump() == polled.model_dump()  # a second read: the same

    live = list(client.responses.create(**asked(unique_prompt("streamed live, then polled")), stream=True))
    assert live[-1].type == "response.completed" and live[-1].response.status == "incomplete"
    assert client.responses.retrieve(live[-1].response.id).model_dump() == live[-1].response.model_dump()
