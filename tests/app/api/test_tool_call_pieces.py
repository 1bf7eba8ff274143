"""Tool calls streamed as the replica streamed them (docs/design.md §14): through an OpenAI
upstream that streams a call as vLLM's tool parsers do (its id and name, then its
arguments in pieces), each piece reaches the client as a delta of its own, the log holds
the pieces as delivered, a resume and a stored response give them back as sent, a whole
answer joins them, and the tool ledger takes the call once the stream completed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from app.api.resume.log import deltas_of
from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream
from tests.support.transcript import check_request, of, stream_chat

ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALL = {"tool": "lookup", "arguments": ARGUMENTS, "pieces": 3}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
ASKED = {"model": MODEL, "messages": [{"role": "user", "content": "the weather?"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with running_scripted_upstream() as running:
        yield running


@pytest.fixture
def gateway(database_url: str, upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    upstream.script(CALL)  # the next request streams the call in pieces
    with running_gateway(database_url, [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]) as running:
        yield running


def data_lines(raw: str) -> list[str]:
    return [line for line in raw.splitlines() if line.startswith(("id: ", "data: "))]


def test_each_piece_is_a_delta_as_the_upstream_streamed_it(gateway: RunningGateway) -> None:
    transcript = stream_chat(gateway.url, ASKED)
    assert transcript.error is None and transcript.finish_reason == "tool_calls"
    assert transcript.tool_calls == [  # each piece as the upstream sent it
        {"index": 0, "id": "call_upstream", "type": "function", "function": {"name": "lookup"}},
        *({"index": 0, "function": {"arguments": part}} for part in ('{"city": "Pa', 'ris", "unit"', ': "celsius"}')),
    ]
    assert transcript.calls == [
        {"id": "call_upstream", "type": "function", "function": {"name": "lookup", "arguments": ARGUMENTS}}
    ]
    events = gateway.events(transcript.request_id)
    check_request(events, transcript)  # ids in order, the log's deltas the client's
    logged = [d for e in of(events, ev.DeltasDelivered) for d in deltas_of(e)]  # type: ignore[arg-type]
    assert [d.key for d in logged] == [TOOL_CALLS] * 4
    assert [json.loads(d.text)[0] for d in logged] == transcript.tool_calls
    assert of(events, ev.FirstDeltaCommitted) and fold(events).outcome is Outcome.COMPLETED
    (emitted,) = of(events, ev.ToolCallEmitted)  # the ledger's, once the stream completed the call
    assert emitted.client_tool_call_id == "call_upstream"  # type: ignore[attr-defined]
    assert (emitted.name, emitted.arguments) == ("lookup", ARGUMENTS)  # type: ignore[attr-defined]
    assert emitted.tool_call_id != "call_upstream"  # type: ignore[attr-defined]  # content-based (§8)


def test_a_resume_in_the_middle_of_a_call_gets_the_rest_of_its_pieces_as_sent(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        sent = http.post("/v1/chat/completions", json={**ASKED, "stream": True})
        request_id = sent.headers["x-request-id"]
        resumed = http.get(f"/v1/requests/{request_id}/stream", headers={"last-event-id": "1"})
    original = data_lines(sent.text)
    assert sum('"tool_calls":[' in line for line in original) == 4
    assert data_lines(resumed.text) == original[original.index("id: 2") :]  # byte for byte, as it was sent


def test_a_whole_answer_joins_the_pieces(gateway: RunningGateway) -> None:
    answer = gateway.openai().chat.completions.create(**ASKED)  # type: ignore[call-overload]
    (call,) = answer.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_upstream", "lookup", ARGUMENTS)
    assert answer.choices[0].finish_reason == "tool_calls"


def test_a_responses_client_gets_the_arguments_piece_by_piece(gateway: RunningGateway) -> None:
    client = gateway.openai()
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    streamed = list(client.responses.create(model=MODEL, input="the weather?", tools=tools, stream=True))  # type: ignore[arg-type]
    kinds = [e.type for e in streamed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in streamed if e.type.endswith("arguments.delta")) == ARGUMENTS  # type: ignore[union-attr]
    final = streamed[-1].response  # type: ignore[union-attr]
    (item,) = final.output
    assert (item.type, item.call_id, item.name, item.arguments) == (
        "function_call",
        "call_upstream",
        "lookup",
        ARGUMENTS,
    )  # type: ignore[union-attr]
    again = list(client.responses.retrieve(final.id, stream=True))  # from the log: the same events
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in streamed]
    assert client.responses.retrieve(final.id).output[0].arguments == ARGUMENTS  # type: ignore[union-attr]
