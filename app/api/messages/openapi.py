"""The Messages API's part of ``GET /openapi.json`` (app/api/openapi.py): ``POST
/v1/messages`` and ``POST /v1/messages/count_tokens``.

The request bodies are the JSON schemas of the models the gateway checks them with
(app/contract/messages.py; app/api/openapi.py puts them in the document). This module
describes the answers, the stream's events and the refusals, in Anthropic's shape
(``{"type": "error", "error": {...}}``, phasegate's ``code`` and ``request_id`` beside its
``type``). What JSON Schema cannot say (``thinking.budget_tokens`` below ``max_tokens``, a
``tool_choice`` that names no tool) is left to the 400 that names the ``param``.
"""

from __future__ import annotations

from typing import Any

_REF = "#/components/schemas/"
_STRING = {"type": "string"}
_NULLABLE = {"type": ["string", "null"]}
_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": _STRING,
                "message": _STRING,
                "code": _NULLABLE,
                "param": _NULLABLE,
                "request_id": _STRING,
            },
        },
    },
}
_USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens"],
    "properties": {name: {"type": "integer", "minimum": 0} for name in ("input_tokens", "output_tokens")},
}
_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
    "properties": {
        "id": _STRING,
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "thinking", "tool_use"]}},
            },
        },
        "model": _STRING,
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
        "stop_sequence": _NULLABLE,
        "usage": _USAGE,
    },
}
_COUNT = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}, "context_management": {"type": "object"}},
}
# one server-sent event of a message's stream: its id (its number), its kind, its JSON
_EVENT = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": _STRING,
        "event": {
            "enum": [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
                "error",
            ]
        },
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}},
    },
}
SCHEMAS = {"AnthropicMessage": _MESSAGE, "AnthropicTokensCount": _COUNT, "AnthropicError": _ERROR}

_CREATE_REFUSALS = {
    "400": "a body or header the gateway (or a replica) refuses; `param` names it",
    "401": "no API key (x-api-key or Authorization), or a wrong one",
    "404": "an unknown model",
    "413": "the body is over max_body_bytes",
    "415": "a body not sent as application/json",
    "429": "the tenant is over one of its limits (Retry-After)",
    "502": "every attempt failed before any output",
    "503": "no replica available, the retry budget spent, the log unavailable, or the gateway draining",
}
_COUNT_REFUSALS = {
    **{status: why for status, why in _CREATE_REFUSALS.items() if status not in ("429",)},
    "501": "the replica has no tokenizer (the sim engine)",
    "502": "the replica gave no answer",
    "503": "no replica available for the model",
}


def messages_paths(security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The paths of the Messages API."""

    def json_(ref: str, why: str) -> dict[str, Any]:
        return {"description": why, "content": {"application/json": {"schema": {"$ref": _REF + ref}}}}

    def operation(operation_id: str, request: str, ok: dict[str, Any], refusals: dict[str, str]) -> dict[str, Any]:
        return {
            "operationId": operation_id,
            "security": security,
            "parameters": [
                {"name": name, "in": "header", "required": False, "schema": _STRING}
                for name in ("anthropic-version", "anthropic-beta")
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF + request}}},
            },
            "responses": {"200": ok} | {status: json_("AnthropicError", why) for status, why in refusals.items()},
        }

    created = json_("AnthropicMessage", "the whole message; with stream: true, its events, each with its id")
    created["content"]["text/event-stream"] = {"schema": _EVENT}
    counted = json_("AnthropicTokensCount", "the prompt's tokens, as the replica's tokenizer counts them")
    return {
        "/v1/messages": {"post": operation("createMessage", "CreateMessageRequest", created, _CREATE_REFUSALS)},
        "/v1/messages/count_tokens": {
            "post": operation("countMessageTokens", "CountTokensRequest", counted, _COUNT_REFUSALS)
        },
    }
