"""Anthropic's Messages API (docs/design.md §17) with the real `anthropic` client, over real sim workers.

A message is a request: each attempt is the chat completion its messages make, so the same
conversation sent as a chat completion gets the same text and usage. Each test judges by
what the client received (the SDK's parsed objects, the stream's events) and by the log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from app.config import ReplicaConfig, Timeouts
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

LOOKUP = {
    "name": "lookup",
    "description": "look a word up",
    "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}
KEY = "sk-messages"
ADMIN_TOKEN = "s3cret-admin"


def client_of(gateway: RunningGateway, **options: Any) -> anthropic.Anthropic:
    """The SDK's client of ``gateway``, closed with it."""
    options.setdefault("api_key", "test-key")
    options.setdefault("max_retries", 0)
    client = anthropic.Anthropic(base_url=gateway.url, timeout=30.0, **options)
    gateway.clients.append(client)  # type: ignore[arg-type]  # (closed as the gateway's openai clients are)
    return client


def request_id_of(message: Any) -> str:
    return "req_" + message.id.removeprefix("msg_")


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in of(events, ev.DeltasDelivered) if not e.fields)  # type: ignore[attr-defined]


def test_a_whole_message_is_the_chat_completion_of_its_conversation(gateway: RunningGateway) -> None:
    message = client_of(gateway).messages.create(
        model=MODEL,
        max_tokens=8,
        system="be brief",
        messages=[{"role": "user", "content": "tell me a story"}],
        extra_body={"temperature": 0, "top_k": 5},  # (this SDK sends sampling fields as extras)
    )
    chat = gateway.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}],
        max_tokens=8,
        temperature=0,
        extra_body={"top_k": 5},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content != ""
    finish = chat.choices[0].finish_reason
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[str(finish)]
    assert chat.usage is not None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    events = gateway.events(request_id_of(message))
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.endpoint == "messages"
    assert delivered_text(events) == block.text  # the log holds what the client got
    assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok


def test_a_streamed_message_gives_the_sdk_its_text_and_final_message(gateway: RunningGateway) -> None:
    client = client_of(gateway)
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "stream a story"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "stream a story"}])
    assert text == final.content[0].text == whole.content[0].text != ""  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens > 0
    events = gateway.events(request_id_of(final))
    assert delivered_text(events) == text and fold(events).outcome is Outcome.COMPLETED


def test_the_stream_is_in_anthropics_shape_and_every_event_has_an_id(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with gateway.http() as http, http.stream("POST", "/v1/messages", json=body) as answer:
        assert answer.status_code == 200
        raw = answer.read().decode()
    frames = [frame for frame in raw.split("\n\n") if frame.strip() and not frame.startswith(":")]
    ids = [int(frame.split("\n")[0].removeprefix("id: ")) for frame in frames]
    assert ids == list(range(len(frames)))  # numbered from message_start, each once
    kinds = [frame.split("\n")[1].removeprefix("event: ") for frame in frames]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in raw


def test_a_tool_use_turn_and_its_result(gateway: RunningGateway) -> None:
    client = client_of(gateway)
    asked = [{"role": "user", "content": "look up 'gateway'"}]
    called = client.messages.create(
        model=MODEL,
        max_tokens=32,
        messages=asked,
        tools=[LOOKUP],
        tool_choice={"type": "any"},  # type: ignore[list-item]
    )
    assert called.stop_reason == "tool_use"
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "lookup" and isinstance(use.input, dict) and use.id
    with client.messages.stream(
        model=MODEL,
        max_tokens=32,
        messages=asked,
        tools=[LOOKUP],
        tool_choice={"type": "tool", "name": "lookup"},  # type: ignore[list-item]
    ) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed_use.name == "lookup" and streamed_use.input == use.input
    answered = client.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=[LOOKUP],  # type: ignore[list-item]
        messages=[
            *asked,
            {"role": "assistant", "content": [use.model_dump()]},  # type: ignore[list-item]
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a thing"}]},
        ],
        tool_choice={"type": "none"},
    )
    assert answered.stop_reason in ("end_turn", "max_tokens") and answered.content[0].type == "text"
    assert answered.usage.input_tokens > called.usage.input_tokens  # the call and its result were in the prompt


def test_errors_are_in_anthropics_shape_with_phasegates_code(gateway: RunningGateway) -> None:
    client = client_of(gateway)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    body = unknown.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "model_not_found"
    hi = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    search = {"type": "web_search_20250305", "name": "w"}
    with gateway.http() as http:
        for sent, param, status in (
            ({"model": MODEL, "messages": hi["messages"]}, "max_tokens", 400),
            ({**hi, "container": "c"}, "container", 400),
            ({**hi, "nope": 1}, "nope", 400),
            (
                {**hi, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
                "messages[0].content[0].type",
                400,
            ),
            ({**hi, "tools": [search]}, "tools[0].type", 400),
            (
                {**hi, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
                "thinking.budget_tokens",
                400,
            ),
        ):
            refused = http.post("/v1/messages", json=sent)
            assert refused.status_code == status, refused.text
            error = refused.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert error["error"]["param"] == param and error["error"]["message"]
            assert error["error"]["request_id"] == refused.headers["x-request-id"]


def test_the_key_comes_in_x_api_key_or_authorization(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, api_keys={KEY: "team"}) as gateway:
        ok = client_of(gateway, api_key=KEY).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert gateway.events(request_id_of(ok))[0].tenant == "team"  # type: ignore[attr-defined]
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client_of(gateway, api_key="wrong").messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        with gateway.http() as http:
            bearer = http.post("/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"})
            assert bearer.status_code == 200 and bearer.json()["type"] == "message"
            counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]})
            assert counted.status_code == 401 and counted.json()["error"]["type"] == "authentication_error"


def test_count_tokens_is_refused_by_the_sim_in_anthropics_shape(gateway: RunningGateway) -> None:
    """The sim engine has no tokenizer (vLLM's counts are tests/compat); the refusal still reads as Anthropic's."""
    with pytest.raises(anthropic.APIStatusError) as refused:
        client_of(gateway).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 501
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and "no tokenizer" in body["error"]["message"]
    with gateway.http() as http:
        extra = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [], "max_tokens": 3})
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "max_tokens"


def test_anthropic_headers_are_taken(gateway: RunningGateway) -> None:
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    hi = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "max_tokens": 4, "messages": hi, "metadata": {"user_id": "u"}}
    answer = httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200 and answer.json()["content"][0]["type"] == "text"


@pytest.fixture
def scripted_gateway(database_url: str) -> Iterator[tuple[RunningGateway, ScriptedUpstream]]:
    """A gateway over a scripted OpenAI-compatible upstream (reasoning, tool-call pieces on demand)."""
    with running_scripted_upstream(token_delay_s=0.01) as upstream:
        replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
        with running_gateway(database_url, replicas, timeouts=Timeouts(stall_s=10.0), admin_token=ADMIN_TOKEN) as gw:
            yield gw, upstream


def test_reasoning_is_a_thinking_block_before_the_text(
    scripted_gateway: tuple[RunningGateway, ScriptedUpstream],
) -> None:
    gateway, upstream = scripted_gateway
    client = client_of(gateway)
    words = answer("think first", 6)
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "think first"}]}
    upstream.script({"reasoning": 3})
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    upstream.script({"reasoning": 3})
    whole = client.messages.create(**asked)
    for message in (streamed, whole):
        thinking, text = message.content
        assert thinking.type == "thinking" and thinking.thinking == "".join(words[:3])
        assert text.type == "text" and text.text == "".join(words[3:])
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert deltas == ["thinking_delta"] * 3 + ["text_delta"] * 3
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]  # type: ignore[union-attr]
    events_logged = gateway.events(request_id_of(streamed))
    logged_text = "".join(e.text or "" for e in of(events_logged, ev.DeltasDelivered))  # type: ignore[attr-defined]
    assert logged_text == "".join(words)  # reasoning is output like any other (docs/design.md §14)


def test_a_tool_call_streamed_in_pieces_is_one_tool_use_block(
    scripted_gateway: tuple[RunningGateway, ScriptedUpstream],
) -> None:
    gateway, upstream = scripted_gateway
    upstream.script({"tool": "lookup", "arguments": '{"word": "gateway"}', "pieces": 3})
    asked = [{"role": "user", "content": "look it up"}]
    with client_of(gateway).messages.stream(model=MODEL, max_tokens=30, messages=asked, tools=[LOOKUP]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "lookup" and use.input == {"word": "gateway"}
    assert final.stop_reason == "tool_use"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert len(pieces) == 3 and "".join(pieces) == '{"word": "gateway"}'
    with gateway.http(headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:  # the operator's views, unchanged
        request_id = request_id_of(final)
        assert http.get(f"/v1/requests/{request_id}").status_code == 200
        assert http.get(f"/ui/requests/{request_id}").status_code == 200
        assert request_id in http.get("/ui/requests").text
    assert replay(gateway.events(request_id)).ok
