"""A Responses API request (``POST /v1/responses``), read into the chat completion it
asks of a replica (DESIGN.md §15).

A response is a request like any other: each attempt goes to its replica as a chat
completion, which both replica kinds speak. So the body is turned into a chat body
here, as vLLM's own Responses server turns it into chat messages (``instructions`` a
system message first; ``function_call`` items an assistant message's tool calls, their
``function_call_output`` items tool messages, reasoning items handed back the assistant
message's ``reasoning``), and that chat body is then validated as any other
(app/api/schemas.py). What the response object echoes (``instructions``, the tools in
this API's form, ``text``…) is kept beside it in :class:`ResponsesParams`.

A field phasegate cannot honour (``conversation``, built-in tools…) is refused with a 400
that names it, never dropped (docs/responses.md).
``previous_response_id`` is resolved from the log before this (app/api/responses_log.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.api.errors import InvalidRequest, UnsupportedParameter
from app.api.responses_input import chat_messages
from app.api.schemas import parse_request
from app.config import Limits
from app.driver.request import CHAT, GenerationRequest, ResponsesCall

# passed on to the chat completion under the same name, as the client sent them
PASSED_AS_IS = (
    "model",
    "stream",
    "temperature",
    "top_p",
    "user",
    "metadata",
    "parallel_tool_calls",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "repetition_penalty",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "service_tier",
)
# read here and turned into chat fields
TRANSLATED = (
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "top_logprobs",
    "include",
    "reasoning",
    "store",
    "truncation",
    "background",
    "previous_response_id",
    "stream_options",
)
NOT_SERVED = {
    "conversation": "conversations are not kept by phasegate; send the earlier turns as input items",
    "prompt": "prompt templates are OpenAI's hosted feature",
    "max_tool_calls": "phasegate does not run built-in tools, so there is no tool-call budget to apply",
    "prompt_cache_key": "the prefix cache is keyed per tenant by phasegate (DESIGN.md §13)",
    "safety_identifier": "phasegate runs no safety system to give it to",
}
INCLUDE_SERVED = {"message.output_text.logprobs"}
MAX_TOP_LOGPROBS = 20
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


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

    def echoed(self) -> dict[str, Any]:
        """The request's fields as the response object repeats them."""
        return {
            "instructions": self.instructions,
            "tools": list(self.tools),
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": self.text,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs,
            "reasoning": self.reasoning,
            "metadata": self.metadata or {},
            "user": self.user,
            "service_tier": self.service_tier,
            "background": self.background,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "truncation": "disabled",
        }


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
    messages of the conversation before it (``previous_response_id``, app/api/responses_log.py)."""
    chat, params = chat_body_of(body, earlier)
    try:
        generation = parse_request(CHAT, chat, limits)
    except InvalidRequest as error:
        if error.param is not None:
            name = re.split(r"[.\[]", error.param, maxsplit=1)[0]
            if name in CLIENT_NAMES:
                error.message = error.message.replace(name, CLIENT_NAMES[name])
                error.param = CLIENT_NAMES[name]
            elif name == "tools":
                error.param = error.param.replace(".function", "")
        raise
    made = ResponsesCall(
        body=body, echo=params.echoed(), output_logprobs=params.output_logprobs, background=params.background
    )
    return dataclasses.replace(generation, responses=made)


def chat_body_of(body: Any, earlier: Sequence[dict[str, Any]] = ()) -> tuple[dict[str, Any], ResponsesParams]:
    """The chat completion body a Responses request asks of a replica, and what its
    response echoes. Raises :class:`InvalidRequest` naming the field it cannot take."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name in NOT_SERVED and body[name] is not None:
            raise UnsupportedParameter(f"'{name}' is not served through phasegate: {NOT_SERVED[name]}", param=name)
        if name not in PASSED_AS_IS and name not in TRANSLATED and name not in NOT_SERVED:
            raise InvalidRequest(f"unknown field '{name}' for /v1/responses", param=name, code="unknown_field")
    _refuse_unserved(body)
    chat: dict[str, Any] = {name: body[name] for name in PASSED_AS_IS if body.get(name) is not None}
    instructions = _optional_str(body, "instructions")
    chat["messages"] = chat_messages(instructions, body.get("input"), earlier)
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
    tool_choice = "auto" if body.get("tool_choice") is None else body["tool_choice"]
    chat_choice = _chat_tool_choice(tool_choice)
    if tools or tool_choice != "auto":
        chat["tool_choice"] = chat_choice
    text = _text(body.get("text"))
    response_format = _response_format(text["format"])
    if response_format is not None:
        chat["response_format"] = response_format
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if not isinstance(max_output_tokens, int) or isinstance(max_output_tokens, bool) or max_output_tokens < 1:
            raise InvalidRequest("'max_output_tokens' must be a positive integer", param="max_output_tokens")
        chat["max_tokens"] = max_output_tokens
    top_logprobs = 0 if body.get("top_logprobs") is None else body["top_logprobs"]
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    include = _include(body.get("include"))
    output_logprobs = top_logprobs > 0 or "message.output_text.logprobs" in include
    if output_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = top_logprobs
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning is not None and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    params = ResponsesParams(
        instructions=instructions,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        text=text,
        max_output_tokens=max_output_tokens,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        top_logprobs=top_logprobs,
        output_logprobs=output_logprobs,
        reasoning=reasoning,
        metadata=body.get("metadata") if isinstance(body.get("metadata"), dict) else None,
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        service_tier=str(body.get("service_tier") or "auto"),
        previous_response_id=body.get("previous_response_id"),
        background=body.get("background") is True,
        store=body.get("store") is not False,
    )
    return chat, params


def _refuse_unserved(body: dict[str, Any]) -> None:
    if body.get("background") not in (None, True, False):
        raise InvalidRequest("'background' must be a boolean", param="background")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequest("'previous_response_id' must be a string", param="previous_response_id")
    if body.get("store") is False and body.get("background") is True:
        raise InvalidRequest("a background response must be stored: 'store' cannot be false", param="store")
    if body.get("store") not in (None, True, False):
        raise InvalidRequest("'store' must be a boolean", param="store")
    if body.get("truncation") not in (None, "disabled"):
        raise UnsupportedParameter(
            "'truncation' must be 'disabled': an input longer than the context is refused, never cut",
            param="truncation",
        )
    options = body.get("stream_options")
    if options is not None:
        if body.get("stream") is not True:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise InvalidRequest("'stream_options' may hold only include_obfuscation", param="stream_options")


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string", param=name)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    return float(value)


# --- tools and formats ------------------------------------------------------------------


def _tools(given: Any) -> tuple[dict[str, Any], ...]:
    if given is None:
        return ()
    if not isinstance(given, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    for n, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise UnsupportedParameter(
                f"'tools[{n}]' is a '{kind}' tool; phasegate runs no built-in tools, only function tools",
                param=f"tools[{n}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"'tools[{n}].name' must be a non-empty string", param=f"tools[{n}].name")
    return tuple(given)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': …}", param="tool_choice"
    )


def _text(given: Any) -> dict[str, Any]:
    if given is None:
        return {"format": {"type": "text"}}
    if not isinstance(given, dict) or set(given) - {"format", "verbosity"}:
        raise InvalidRequest("'text' must be an object with 'format'", param="text")
    if given.get("verbosity") not in (None, "medium"):
        raise UnsupportedParameter("'text.verbosity' is not served: the replica's model has none", param="text")
    form = given.get("format") or {"type": "text"}
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'text.format.type' must be text, json_object or json_schema", param="text.format")
    return {"format": form}


def _response_format(form: dict[str, Any]) -> dict[str, Any] | None:
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(form.get("name"), str) or not isinstance(form.get("schema"), dict):
        raise InvalidRequest("a json_schema format needs a 'name' and a 'schema' object", param="text.format")
    schema = {key: form[key] for key in ("name", "schema", "strict", "description") if form.get(key) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _include(given: Any) -> set[str]:
    if given is None:
        return set()
    if not isinstance(given, list) or not all(isinstance(x, str) for x in given):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    for value in given:
        if value not in INCLUDE_SERVED:
            raise UnsupportedParameter(f"'include' value '{value}' is not served by phasegate", param="include")
    return set(given)


def _reasoning(given: Any) -> dict[str, Any] | None:
    if given is None:
        return None
    if not isinstance(given, dict) or set(given) - {"effort", "summary", "generate_summary"}:
        raise InvalidRequest("'reasoning' must be an object with 'effort'", param="reasoning")
    if given.get("summary") is not None or given.get("generate_summary") is not None:
        raise UnsupportedParameter(
            "reasoning summaries are not served: the replica's reasoning is given whole", param="reasoning.summary"
        )
    effort = given.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", param="reasoning.effort")
    return {"effort": effort, "summary": None}
