"""A Messages API body read into the chat completion its attempts ask for, and the answer's
shape from driver outputs (app/api/messages/request.py, app/api/messages/shape.py): pure, no
processes. What vLLM's own Messages server makes of the same bodies is tests/compat/test_messages.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.api.errors import InvalidRequest, UnsupportedParameter
from app.api.messages.request import chat_body_of, count_body_of, parse_messages_request
from app.api.messages.shape import MessagesShape, stop_reason
from app.api.shape import ChoiceAnswer
from app.config import Limits
from statemachine.deltas import CONTENT, TOOL_CALLS

HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "look", "input_schema": {"type": "object", "properties": {"w": {"type": "string"}}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 50, "messages": HI, **fields}


def test_the_conversation_becomes_chat_messages_as_vllm_makes_them() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look 'a' up"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"w": "a"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "ok"}]},
                {"type": "text", "text": "and now?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    chat = chat_body_of(
        body(system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], messages=messages)
    )
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look 'a' up"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "look", "arguments": '{"w": "a"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]


@pytest.mark.parametrize(
    ("fields", "chat"),
    [
        ({"tools": [TOOL]}, {"tool_choice": "auto"}),
        ({"tools": [TOOL], "tool_choice": {"type": "any"}}, {"tool_choice": "required"}),
        ({"tools": [TOOL], "tool_choice": {"type": "none"}}, {"tool_choice": "none"}),
        (
            {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "look", "disable_parallel_tool_use": True}},
            {"tool_choice": {"type": "function", "function": {"name": "look"}}, "parallel_tool_calls": False},
        ),
        ({"stop_sequences": ["END"]}, {"stop": ["END"]}),
        ({"top_k": 5, "top_p": 0.5, "temperature": 0}, {"top_k": 5, "top_p": 0.5, "temperature": 0}),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}, {"thinking_token_budget": 1024}),
        ({"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"}),
        ({"output_config": {"effort": "low"}}, {"reasoning_effort": "low"}),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "json_schema", "schema": {"type": "object"}},
                }
            },
        ),
        ({"metadata": {"user_id": "u-1"}}, {"user": "u-1"}),
    ],
)
def test_each_field_becomes_its_chat_field(fields: dict[str, Any], chat: dict[str, Any]) -> None:
    made = chat_body_of(body(**fields))
    assert {name: made.get(name) for name in chat} == chat


@pytest.mark.parametrize(
    ("fields", "param", "kind"),
    [
        ({"mcp_servers": []}, "mcp_servers", UnsupportedParameter),
        ({"max_tokens": 0}, "max_tokens", InvalidRequest),
        ({"stop_sequences": "END"}, "stop_sequences", InvalidRequest),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", InvalidRequest),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
            UnsupportedParameter,
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name", InvalidRequest),
        ({"tools": [TOOL, TOOL]}, "tools[1].name", InvalidRequest),
        ({"tools": [{"name": "x", "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type", InvalidRequest),
        ({"metadata": {"user_id": "u", "other": 1}}, "metadata.other", InvalidRequest),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens", InvalidRequest),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}]},
            "messages[0].content[0].citations",
            UnsupportedParameter,
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, Any], param: str, kind: type) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_messages_request(body(**fields), Limits())
    assert refused.value.param == param and type(refused.value) is kind, refused.value.message
    assert param.split(".")[0].split("[")[0] in refused.value.message


def test_count_tokens_takes_the_prompt_only() -> None:
    assert count_body_of({"model": "m", "messages": HI, "tools": [TOOL]})["tools"][0]["function"]["name"] == "look"
    with pytest.raises(InvalidRequest) as refused:
        count_body_of({"model": "m", "messages": HI, "max_tokens": 3})
    assert refused.value.param == "max_tokens"


def test_stop_reasons_are_vllms() -> None:
    assert stop_reason("length", None, tool_used=False, tool_complete=False) == ("max_tokens", None)
    assert stop_reason("stop", "END", tool_used=False, tool_complete=False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, tool_used=False, tool_complete=False) == ("end_turn", None)  # a stop token's id
    assert stop_reason("tool_calls", None, tool_used=True, tool_complete=True) == ("tool_use", None)
    assert stop_reason("stop", "END", tool_used=True, tool_complete=False) == ("stop_sequence", "END")  # a call cut


def test_the_same_deltas_give_the_same_events_and_a_resumed_reader_the_rest() -> None:
    request = parse_messages_request(body(stream=True), Limits())
    calls = [{"index": 0, "id": "call_1", "function": {"name": "look", "arguments": '{"w": '}}]
    more = [{"index": 0, "function": {"arguments": '"a"}'}}]

    def stream(after: int) -> bytes:
        shape = MessagesShape(request, "req_abc", 0)
        shape.after = after
        parts = [
            shape.content_event(0, "Hel", key=CONTENT),
            shape.content_event(1, "lo", key=CONTENT),
            shape.content_event(2, orjson.dumps(calls).decode(), key=TOOL_CALLS),
            shape.content_event(3, orjson.dumps(more).decode(), key=TOOL_CALLS),
            shape.ending(4, ["tool_calls"], [None], {"prompt_tokens": 5, "completion_tokens": 4}),
        ]
        return b"".join(parts)

    whole = stream(-1)
    frames = whole.split(b"\n\n")[:-1]
    assert [int(frame.split(b"\n")[0].removeprefix(b"id: ")) for frame in frames] == list(range(len(frames)))
    kinds = [frame.split(b"\n")[1].removeprefix(b"event: ").decode() for frame in frames]
    assert kinds == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    ended = orjson.loads(frames[-2].split(b"data: ", 1)[1])
    assert ended["delta"]["stop_reason"] == "tool_use" and ended["usage"] == {"input_tokens": 5, "output_tokens": 4}
    assert stream(-1) == whole  # a pure function of the deltas
    for after in range(len(frames)):
        assert stream(after) == b"".join(frame + b"\n\n" for frame in frames[after + 1 :])


def test_a_whole_message_has_thinking_text_then_tool_uses() -> None:
    request = parse_messages_request(body(), Limits())
    answer = ChoiceAnswer()
    answer.add("reasoning", "think", None)
    answer.add(CONTENT, "say", None)
    answer.add(
        TOOL_CALLS, orjson.dumps([{"id": "c1", "function": {"name": "look", "arguments": '{"w": 1}'}}]).decode(), None
    )
    message = MessagesShape(request, "req_abc", 0).completion(
        [answer],
        ["tool_calls"],
        {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
    )
    assert message["id"] == "msg_abc" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "say"},
        {"type": "tool_use", "id": "c1", "name": "look", "input": {"w": 1}},
    ]
    assert message["usage"] == {"input_tokens": 5, "cache_read_input_tokens": 4, "output_tokens": 3}
    empty = MessagesShape(request, "req_abc", 0).completion([ChoiceAnswer()], ["stop"], {})
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"
