"""A Responses API request (``POST /v1/responses``), read into the chat completion it
asks of a replica (docs/design.md §15).

A response is a request like any other: each attempt goes to its replica as a chat
completion, which both replica kinds speak. So the body, checked against its declaration
(app/contract/responses.py, which ``/openapi.json`` describes it by), is turned into a
chat body here, as vLLM's own Responses server turns it into chat messages (``instructions`` a
system message first; ``function_call`` items an assistant message's tool calls, their
``function_call_output`` items tool messages, reasoning items handed back the assistant
message's ``reasoning``), and that chat body is then validated as any other
(app/api/chat/request.py). What the response object echoes (``instructions``, the tools in
this API's form, ``text``…) is kept beside it in :class:`ResponsesParams`.

A field phasegate cannot honour (``conversation``, built-in tools…) is refused with a 400
that names it, never dropped (docs/responses.md).
``previous_response_id`` is resolved from the log before this (app/api/responses/log.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.api.chat.request import as_refusal, parse_translated_chat
from app.api.errors import InvalidRequest, UnsupportedParameter
from app.api.responses.input import chat_messages
from app.config import Limits
from app.contract.declared import BadInput, checked
from app.contract.responses import NOT_SERVED, PASSED_AS_IS, ResponsesRequest, responses_model
from app.driver.request import GenerationRequest, ResponsesCall

# read here and turned into chat fields (app/contract/responses.py declares them)
TRANSLATED = tuple(name for name in ResponsesRequest.model_fields if name not in PASSED_AS_IS)


@dataclass(frozen=True, slots=True)
class ResponsesParams:
    """What the response object says about its request, in this API's form."""

    instructions: str | None
    tools: tuple[dict[str, Any], ...]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_logprobs: int
    output_logprobs: bool  # the output text carries its tokens' log probabilities
    reasoning: dict[str, Any] | None
    metadata: dict[str, Any] | None
    user: str | None
    service_tier: str
    previous_response_id: str | None
    background: bool  # generated with no client attached; read by GET /v1/responses/{id}
    store: bool  # false: the log keeps no content of it, and it cannot be read back or continued

    def echoed(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request's fields as the response object repeats them, as vLLM's does
        (docs/compatibility.md): ``tool_choice`` ``none`` without tools, ``text``,
        ``metadata`` and ``store`` as the client sent them (``store`` only then),
        ``top_logprobs`` where the output carries log probabilities, the penalties."""
        echoed = {
            "instructions": self.instructions,
            "tools": list(self.tools),
            "tool_choice": "none" if not self.tools and self.tool_choice in ("auto", "none") else self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": body.get("text"),
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs if self.output_logprobs else None,
            "presence_penalty": _number(body.get("presence_penalty"), 0.0),
            "frequency_penalty": _number(body.get("frequency_penalty"), 0.0),
            "reasoning": self.reasoning,
            "metadata": self.metadata,
            "user": self.user,
            "service_tier": self.service_tier,
            "background": self.background,
            "previous_response_id": self.previous_response_id,
            "truncation": "disabled",
        }
        return echoed | ({"store": self.store} if body.get("store") is not None else {})


def _number(given: Any, default: float) -> float:
    return float(given) if isinstance(given, int | float) and not isinstance(given, bool) else default


# a chat field a refusal names, as the client named it here
CLIENT_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
    "reasoning_effort": "reasoning.effort",
}


def parse_responses_request(body: Any, limits: Limits, earlier: Sequence[dict[str, Any]] = ()) -> GenerationRequest:
    """A Responses API body validated into the chat completion its attempts ask for,
    carrying how it was made (``GenerationRequest.responses``). ``earlier``: the chat
    messages of the conversation before it (``previous_response_id``, app/api/responses/log.py)."""
    chat, params = chat_body_of(body, earlier, limits)
    generation = parse_translated_chat(chat, limits, CLIENT_NAMES)
    made = ResponsesCall(
        body=body, echo=params.echoed(body), output_logprobs=params.output_logprobs, background=params.background
    )
    return dataclasses.replace(generation, responses=made)


def chat_body_of(
    body: Any, earlier: Sequence[dict[str, Any]] = (), limits: Limits | None = None
) -> tuple[dict[str, Any], ResponsesParams]:
    """The chat completion body a Responses request asks of a replica, and what its
    response echoes. Raises :class:`InvalidRequest` naming the field it cannot take."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name in NOT_SERVED and body[name] is not None:
            raise UnsupportedParameter(f"'{name}' is not served through phasegate: {NOT_SERVED[name]}", param=name)
        if name not in PASSED_AS_IS and name not in TRANSLATED and name not in NOT_SERVED:
            raise InvalidRequest(f"unknown field '{name}' for /v1/responses", param=name, code="unknown_field")
    limits = limits or Limits()
    with as_refusal():
        declared = checked(responses_model(limits.max_tokens, limits.max_n).model_validate, body)
        _rules(declared)
    chat: dict[str, Any] = {name: body[name] for name in PASSED_AS_IS if body.get(name) is not None}
    chat["messages"] = chat_messages(declared.instructions, body["input"], earlier)
    tools = tuple(body.get("tools") or ())
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
    tool_choice = "auto" if body.get("tool_choice") is None else body["tool_choice"]
    if tools or tool_choice != "auto":
        chat["tool_choice"] = tool_choice if isinstance(tool_choice, str) else _chat_tool_choice(tool_choice)
    text = {"format": (body.get("text") or {}).get("format") or {"type": "text"}}
    response_format = _response_format(text["format"])
    if response_format is not None:
        chat["response_format"] = response_format
    if declared.max_output_tokens is not None:
        chat["max_tokens"] = declared.max_output_tokens
    top_logprobs = declared.top_logprobs or 0
    output_logprobs = top_logprobs > 0 or bool(declared.include)
    if output_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = top_logprobs
    reasoning = None if declared.reasoning is None else {"effort": declared.reasoning.effort, "summary": None}
    if reasoning is not None and reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    params = ResponsesParams(
        instructions=declared.instructions,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        text=text,
        max_output_tokens=declared.max_output_tokens,
        temperature=getattr(declared, "temperature", None),  # passed-on fields: responses_model adds them
        top_p=getattr(declared, "top_p", None),
        top_logprobs=top_logprobs,
        output_logprobs=output_logprobs,
        reasoning=reasoning,
        metadata=body.get("metadata"),
        user=body.get("user"),
        service_tier=str(body.get("service_tier") or "auto"),
        previous_response_id=declared.previous_response_id,
        background=declared.background is True,
        store=declared.store is not False,
    )
    return chat, params


def _rules(declared: ResponsesRequest) -> None:
    """What no field's declaration says."""
    if declared.store is False and declared.background is True:
        raise BadInput("store", "cannot be false for a background response: it must be stored")
    if declared.stream_options is not None and getattr(declared, "stream", None) is not True:
        raise BadInput("stream_options", "is only allowed when 'stream' is true")


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(form: dict[str, Any]) -> dict[str, Any] | None:
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    schema = {key: form[key] for key in ("name", "schema", "strict", "description") if form.get(key) is not None}
    return {"type": "json_schema", "json_schema": schema}
