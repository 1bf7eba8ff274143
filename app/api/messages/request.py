"""An Anthropic Messages API request (``POST /v1/messages``), read into the chat completion
it asks of a replica (docs/design.md §17).

A message is a request like any other: each attempt goes to its replica as a chat
completion, which both replica kinds speak. So the body, checked against its declaration
(app/contract/messages.py, which ``/openapi.json`` describes it by), is turned into a chat
body here as vLLM's own Messages server turns it (``system`` a system message first, its
blocks' text joined; an assistant's ``tool_use`` blocks its tool calls, with the input as
JSON arguments, and its ``thinking`` blocks its ``reasoning``; a user's ``tool_result``
blocks tool messages ahead of the rest of its content), and
that chat body is then validated as any other (app/api/chat/request.py).

A field phasegate cannot honour is refused with a 400 that names it, never dropped
(docs/messages.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from app.api.chat.request import as_refusal, parse_translated_chat
from app.api.errors import InvalidRequest, UnsupportedParameter
from app.config import Limits
from app.contract.declared import checked
from app.contract.messages import NOT_SERVED, PASSED_AS_IS, CountTokensRequest, MessagesRequest, messages_model
from app.driver.request import GenerationRequest, MessagesCall

# a chat field a refusal names, as the client named it here
CLIENT_NAMES = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}
FIELDS = frozenset(MessagesRequest.model_fields) | frozenset(PASSED_AS_IS)
COUNT_FIELDS = frozenset(CountTokensRequest.model_fields)


def parse_messages_request(body: Any, limits: Limits) -> GenerationRequest:
    """A Messages API body validated into the chat completion its attempts ask for,
    carrying how it was made (``GenerationRequest.anthropic``)."""
    chat = chat_body_of(body, limits)
    generation = parse_translated_chat(chat, limits, CLIENT_NAMES)
    made = MessagesCall(body=body, stop_sequences=tuple(body.get("stop_sequences") or ()))
    return dataclasses.replace(generation, anthropic=made)


def chat_body_of(body: Any, limits: Limits | None = None) -> dict[str, Any]:
    """The chat completion body a Messages request asks of a replica. Raises
    :class:`InvalidRequest` naming the field it cannot take."""
    _known(body, FIELDS, "/v1/messages")
    limits = limits or Limits()
    with as_refusal():
        declared = checked(messages_model(limits.max_tokens, limits.max_n).model_validate, body)
        if declared.thinking is not None and getattr(declared.thinking, "budget_tokens", 0) >= declared.max_tokens:
            raise InvalidRequest(
                "'thinking.budget_tokens' must be less than 'max_tokens'", param="thinking.budget_tokens"
            )
    chat = prompt_of(body)
    chat |= {name: body[name] for name in PASSED_AS_IS if body.get(name) is not None}
    chat["max_tokens"] = declared.max_tokens
    if declared.stop_sequences:
        chat["stop"] = list(declared.stop_sequences)
    if declared.metadata is not None and declared.metadata.user_id is not None:
        chat["user"] = declared.metadata.user_id  # who the request is for: recorded, and ties a conversation's turns
    return chat


def count_body_of(body: Any) -> dict[str, Any]:
    """The tokenize body a ``count_tokens`` request asks of a replica (vLLM's ``/tokenize``
    of the chat messages, with their tools), checked as a Messages request's prompt is."""
    _known(body, COUNT_FIELDS, "/v1/messages/count_tokens")
    with as_refusal():
        checked(CountTokensRequest.model_validate, body)
    return prompt_of(body)


def _known(body: Any, fields: frozenset[str], path: str) -> None:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name in NOT_SERVED and body[name] is not None:
            raise UnsupportedParameter(f"'{name}' is not served through phasegate: {NOT_SERVED[name]}", param=name)
        if name not in fields and name not in NOT_SERVED:
            raise InvalidRequest(f"unknown field '{name}' for {path}", param=name, code="unknown_field")


def prompt_of(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of a checked body's prompt: its messages, tools, tool choice,
    thinking and output format, as vLLM's Messages server makes them."""
    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body.get("system"), body["messages"])}
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if choice.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    if tools is not None:
        chat["tools"] = [_tool(tool) for tool in tools]
        chat.setdefault("tool_choice", "auto")
    thinking = body.get("thinking")
    if thinking is not None and thinking["type"] == "enabled":
        chat["thinking_token_budget"] = thinking["budget_tokens"]
    elif thinking is not None and thinking["type"] == "disabled":
        chat["reasoning_effort"] = "none"
    output = body.get("output_config") or {}
    if output.get("format") is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "json_schema", "schema": output["format"]["schema"]},
        }
    if output.get("effort") is not None:
        chat["reasoning_effort"] = output["effort"]
    return chat


def _messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "".join(block["text"] for block in system)
        chat.append({"role": "system", "content": text})
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
            continue
        converted: dict[str, Any] = {"role": message["role"]}
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            kind = block["type"]
            if kind == "text" and block["text"]:
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "thinking":
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                arguments = json.dumps(block["input"], ensure_ascii=False)
                calls.append(
                    {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
                )
            elif kind == "tool_result" and message["role"] == "user":
                chat.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_text(block)})
            elif kind == "tool_result":
                parts.append({"type": "text", "text": f"Tool result: {_result_text(block)}"})
        if reasoning:
            converted["reasoning"] = "".join(reasoning)
        if calls:
            converted["tool_calls"] = calls
        if parts:
            only_text = len(parts) == 1 and parts[0]["type"] == "text"
            converted["content"] = parts[0]["text"] if only_text else parts
        if "content" in converted or (message["role"] == "assistant" and (calls or reasoning)):
            chat.append(converted)
    return chat


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part["text"] for part in content if part["type"] == "text")


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    function |= {key: tool[key] for key in ("description", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    if choice["type"] == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[str(choice["type"])]
