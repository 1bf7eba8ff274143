"""The Responses API (docs/design.md §15) with the real `openai` client, over real sim workers.

A response is a request: each attempt is the chat completion its input makes, so the
same input sent as a chat completion gets the same text and usage. Each test judges by
what the client received (the SDK's parsed objects, the stream's events) and by the log.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from app.api.responses.input import chat_messages
from app.config import ReplicaConfig, Timeouts
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in of(events, ev.DeltasDelivered) if not e.fields)  # type: ignore[attr-defined]


def request_id_of(response: Any) -> str:
    return "req_" + response.id.removeprefix("resp_")


def test_a_whole_response_is_the_chat_completion_of_its_input(gateway: RunningGateway) -> None:
    client = gateway.openai()
    response = client.responses.create(
        model=MODEL, input="tell me a story", instructions="be brief", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}],
        max_tokens=8,
        temperature=0,
    )
    assert response.object == "response" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content != ""
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.instructions == "be brief" and response.max_output_tokens == 8
    events = gateway.events(request_id_of(response))
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.endpoint == "responses"
    assert delivered_text(events) == response.output_text  # the log holds what the client got
    assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok


def test_a_streamed_response_numbers_its_events_and_ends_with_the_whole_response(gateway: RunningGateway) -> None:
    stream = gateway.openai().responses.create(model=MODEL, input="stream a story", max_output_tokens=12, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [*tail, "response.completed"]  # incomplete too, as vLLM says it
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "".join(deltas) != ""
    item_id = final.output[0].id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress" and events[0].response.output == []  # type: ignore[union-attr]
    logged = gateway.events(request_id_of(final))
    assert delivered_text(logged) == "".join(deltas)
    assert sum(e.to_index - e.from_index for e in of(logged, ev.DeltasDelivered)) == len(deltas)  # type: ignore[attr-defined]
    assert replay(logged).ok


def test_the_sdks_stream_helper_accumulates_the_same_response_as_the_whole_answer(gateway: RunningGateway) -> None:
    client = gateway.openai()
    asked = {"model": MODEL, "input": "the same story", "max_output_tokens": 10, "temperature": 0}
    with client.responses.stream(**asked) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    whole = client.responses.create(**asked)
    assert streamed.output_text == "".join(texts) == whole.output_text
    assert streamed.usage == whole.usage and streamed.status == whole.status


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_function_tool_is_called_and_its_output_taken_back(gateway: RunningGateway, stream: bool) -> None:
    client = gateway.openai()
    asked: dict[str, Any] = {
        "model": MODEL,
        "input": "what does ephemeral mean",
        "tools": [LOOKUP],
        "tool_choice": {"type": "function", "name": "lookup"},
    }
    if stream:
        with client.responses.stream(**asked) as streaming:
            kinds = [e.type for e in streaming]
            response = streaming.get_final_response()
        assert kinds.count("response.function_call_arguments.delta") == 1
        assert kinds[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    else:
        response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "lookup" and calls[0].status == "completed"
    arguments = json.loads(calls[0].arguments)
    assert isinstance(arguments.get("word"), str)
    assert calls[0].call_id and calls[0].id.startswith("fc_")
    # the call's output, handed back as input items, is a tool message to the model
    followed = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "what does ephemeral mean"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "lookup", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "lasting a very short time"},
        ],
        tools=[LOOKUP],
        tool_choice="none",
        max_output_tokens=6,
    )
    assert followed.output_text != "" and followed.status in ("completed", "incomplete")
    events = gateway.events(request_id_of(response))
    assert [e.name for e in of(events, ev.ToolCallEmitted)] == ["lookup"]  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok


def test_a_reasoning_item_after_a_tools_output_is_an_assistant_turn_of_that_reasoning(gateway: RunningGateway) -> None:
    """An agent's history handed back: the model reasoned after a tool's output. As vLLM
    builds it, the reasoning item is an assistant message of that reasoning and no content
    (it was refused: an assistant message needed content or tool calls)."""
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "what does ephemeral mean"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"word": "ephemeral"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "lasting a very short time"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "brief"}]},
        {"role": "user", "content": "say it in a word"},
    ]
    assert chat_messages(None, history)[3] == {"role": "assistant", "content": None, "reasoning": "brief"}
    response = gateway.openai().responses.create(model=MODEL, input=history, max_output_tokens=6)  # type: ignore[arg-type]
    assert response.status in ("completed", "incomplete") and response.output_text != ""


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": "yes"}, "background"),
        ({"background": True, "store": False}, "store"),
        ({"previous_response_id": 7}, "previous_response_id"),
        ({"store": "no"}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "input[0].content[0]"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice.name",
        ),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"colour": "blue"}, "colour"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"temperature": "hot"}, "temperature"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"top_logprobs": False}, "top_logprobs"),  # not taken for 0
        ({"input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),  # was a 500
        ({"input": [{"type": "reasoning", "summary": [{"text": 1}]}]}, "input[0].summary"),
    ],
)
def test_a_field_phasegate_cannot_honour_is_refused_naming_it(
    gateway: RunningGateway, fields: dict[str, Any], param: str
) -> None:
    with gateway.http() as http:
        answer_ = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **fields})
    assert answer_.status_code == 400, answer_.text
    error = answer_.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_an_unknown_model_and_a_bad_idempotency_key_are_refused_as_for_chat(gateway: RunningGateway) -> None:
    client = gateway.openai()
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="hi")
    assert missing.value.code == "model_not_found"
    with gateway.http() as http:
        keyed = http.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers={"idempotency-key": "k" * 300})
    assert keyed.status_code == 400 and keyed.json()["error"]["code"] == "invalid_idempotency_key"


def test_a_replica_dying_after_the_first_delta_ends_the_response_failed_with_what_was_sent(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("interrupt the response")
    for worker in fresh_pair:
        add_fault(worker, action="die", point="after_frame", at_token=2, match={"prompt_contains": prompt})
    with running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway:
        stream = gateway.openai().responses.create(model=MODEL, input=prompt, max_output_tokens=20, stream=True)
        events = list(stream)
        logged = gateway.events(request_id_of(events[0].response))  # type: ignore[union-attr]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    assert last.type == "response.failed" and deltas, [e.type for e in events]
    failed = last.response  # type: ignore[union-attr]
    error = failed.error.model_dump()  # type: ignore[union-attr]
    assert failed.status == "failed" and error["code"] == "upstream_decode_interrupted"
    assert error["partial_output"] is True and error["delivered_output_tokens"] == len(deltas)
    assert failed.output[0].status == "incomplete" and failed.output_text == "".join(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    state = fold(logged)
    assert state.outcome is Outcome.FAILED and state.delivered_output_tokens == len(deltas)
    assert delivered_text(logged) == "".join(deltas) and len(of(logged, ev.AttemptStarted)) == 1
    assert replay(logged).ok


def test_a_replica_dying_before_the_first_delta_is_retried_into_one_response(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("retry the response")
    for worker in fresh_pair:  # whichever replica gets attempt 1 dies
        add_fault(worker, action="die", point="prefill", at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    with running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway:
        with gateway.openai().responses.stream(model=MODEL, input=prompt, max_output_tokens=6) as stream:
            kinds = [e.type for e in stream]
            response = stream.get_final_response()
        logged = gateway.events(request_id_of(response))
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert response.output_text != "" and delivered_text(logged) == response.output_text
    assert [s.attempt for s in of(logged, ev.AttemptStarted)] == [1, 2]  # type: ignore[attr-defined]
    assert fold(logged).outcome is Outcome.COMPLETED and replay(logged).ok


@pytest.fixture
def reasoning_gateway(database_url: str) -> Iterator[tuple[RunningGateway, ScriptedUpstream]]:
    with running_scripted_upstream(token_delay_s=0.01) as upstream:
        replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
        with running_gateway(database_url, replicas, timeouts=Timeouts(stall_s=10.0)) as gateway:
            yield gateway, upstream


def test_reasoning_is_its_own_output_item_before_the_message(
    reasoning_gateway: tuple[RunningGateway, ScriptedUpstream],
) -> None:
    gateway, upstream = reasoning_gateway
    upstream.script({"reasoning": 3})
    words = answer("think first", 6)
    with gateway.openai().responses.stream(model=MODEL, input="think first", max_output_tokens=6) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    upstream.script({"reasoning": 3})
    whole = gateway.openai().responses.create(model=MODEL, input="think first", max_output_tokens=6)
    for response in (streamed, whole):
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and message.type == "message"
        assert [part.text for part in reasoning.content or []] == ["".join(words[:3])]
        assert response.output_text == "".join(words[3:])
    assert kinds.count("response.reasoning_text.delta") == 3 and kinds.count("response.output_item.added") == 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_a_keyed_retry_of_an_unstored_response_is_409_as_the_description_says(gateway: RunningGateway) -> None:
    """``store: false`` leaves the log no text to replay: the same POST under the same
    Idempotency-Key is 409 ``resume_unavailable`` (not a second generation), a status
    /openapi.json lists for the route (schemathesis found it undocumented)."""
    body = {"model": MODEL, "input": "forget me", "store": False, "max_output_tokens": 4}
    key = {"idempotency-key": "unstored-1"}
    with gateway.http() as http:
        first = http.post("/v1/responses", json=body, headers=key)
        again = http.post("/v1/responses", json=body, headers=key)
        described = http.get("/openapi.json").json()["paths"]["/v1/responses"]["post"]["responses"]
    assert first.status_code == 200 and first.json()["status"] in ("completed", "incomplete")  # 4 tokens
    assert again.status_code == 409 and again.json()["error"]["code"] == "resume_unavailable"
    assert "409" in described
    events = gateway.events("req_" + first.json()["id"].removeprefix("resp_"))
    assert len(of(events, ev.AttemptStarted)) == 1 and fold(events).outcome is Outcome.COMPLETED  # once


def test_the_openapi_stream_route_of_a_response_is_refused_not_shaped_as_chat(gateway: RunningGateway) -> None:
    response = gateway.openai().responses.create(model=MODEL, input="keep me", max_output_tokens=4)
    with gateway.http() as http:
        resumed = http.get(f"/v1/requests/{request_id_of(response)}/stream")
    assert resumed.status_code == 409 and resumed.json()["error"]["code"] == "resume_unavailable"
    assert isinstance(resumed, httpx.Response)


def test_a_cancelled_response_ends_its_stream_cancelled_with_what_was_sent(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("a response to stop")
    for worker in sim_pair:  # it sends 4 deltas, then nothing: the cancel cannot come after its end
        add_fault(worker, action="stall", at_token=4, match={"prompt_contains": prompt})
    with running_gateway(database_url, sim_pair, timeouts=Timeouts(stall_s=120.0)) as gateway:
        stream = gateway.openai().responses.create(model=MODEL, input=prompt, max_output_tokens=50, stream=True)
        request_id = stream.response.headers["x-request-id"]
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and len(events) == 8:  # 4 head events, 4 deltas
                with gateway.http() as http:
                    assert http.post(f"/v1/requests/{request_id}/cancel").json()["status"] == "cancelled"
        logged = gateway.events(request_id)
    last = events[-1]
    assert last.type == "response.failed", [e.type for e in events]
    cancelled = last.response  # type: ignore[union-attr]
    assert cancelled.status == "cancelled" and cancelled.error is not None
    assert cancelled.error.code == "request_cancelled"  # type: ignore[comparison-overlap]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4 and cancelled.output_text == "".join(deltas)
    assert fold(logged).outcome is Outcome.CANCELLED and delivered_text(logged) == "".join(deltas)
