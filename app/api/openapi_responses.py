"""The Responses API's part of ``GET /openapi.json`` (app/api/openapi.py): ``POST
/v1/responses`` and the routes that read, cancel and delete a stored response.

Described as app/api/responses_request.py and app/api/responses_input.py check it: the
fields passed on to the chat completion take the chat description's schema (the chat
checks refuse them there), the ones read here are described to the depth they are
checked, a field phasegate does not serve is refused unless null, and an unknown field
is refused (``additionalProperties: false``), as the gateway refuses it. What JSON Schema
cannot say (``store: false`` with ``background``, a named ``tool_choice`` that names no
tool, ``stream_options`` only with ``stream``) is left to the 400 that names the ``param``.
"""

from __future__ import annotations

from typing import Any

from app.api.responses_input import ROLES
from app.api.responses_request import (
    EFFORTS,
    INCLUDE_SERVED,
    MAX_TOP_LOGPROBS,
    NOT_SERVED,
    PASSED_AS_IS,
    TRANSLATED,
)
from app.api.responses_routes import MAX_ITEMS

_REF = "#/components/schemas/"
_STRING = {"type": "string"}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": _STRING},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {"type": {"const": "input_image"}, "image_url": _STRING},
}
_ITEMS = [
    {  # a message (its type may be left out)
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": sorted(ROLES)},
            "content": {"anyOf": [_STRING, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}}]},
        },
    },
    {
        "type": "object",
        "required": ["type", "call_id", "name", "arguments"],
        "properties": {"type": {"const": "function_call"}, "call_id": _STRING, "name": _STRING, "arguments": _STRING},
    },
    {
        "type": "object",
        "required": ["type", "call_id", "output"],
        "properties": {"type": {"const": "function_call_output"}, "call_id": _STRING, "output": _STRING},
    },
    {  # a reasoning item handed back: its text, never encrypted content
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"const": "reasoning"},
            "content": {"type": ["array", "null"], "items": _TEXT_PART},
            "summary": {"type": ["array", "null"], "items": _TEXT_PART},
            "encrypted_content": {"type": "null"},
        },
    },
]
_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "minLength": 1},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]},
    },
}
_FORMAT = {
    "anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "type": "object",
            "required": ["type", "name", "schema"],
            "properties": {"type": {"const": "json_schema"}, "name": _STRING, "schema": {"type": "object"}},
        },
    ]
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def responses_request(chat: dict[str, Any], max_tokens: dict[str, Any]) -> dict[str, Any]:
    """``CreateResponseRequest``: ``chat`` is the chat completion's field schemas (the
    passed-on fields are checked as there), ``max_tokens`` the schema of a token limit."""
    translated: dict[str, Any] = {
        "input": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": {"anyOf": _ITEMS}}]},
        "instructions": _nullable(_STRING),
        "tools": _nullable({"type": "array", "items": _TOOL}),
        "tool_choice": _nullable(
            {
                "anyOf": [
                    {"enum": ["auto", "none", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {"type": {"const": "function"}, "name": _STRING},
                    },
                ]
            }
        ),
        "text": _nullable(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {"format": _nullable(_FORMAT), "verbosity": {"enum": ["medium", None]}},
            }
        ),
        "max_output_tokens": max_tokens,
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        "include": _nullable({"type": "array", "items": {"enum": sorted(INCLUDE_SERVED)}}),
        "reasoning": _nullable(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "effort": {"enum": [*EFFORTS, None]},
                    "summary": {"type": "null"},
                    "generate_summary": {"type": "null"},
                },
            }
        ),
        "store": _nullable({"type": "boolean"}),
        "background": _nullable({"type": "boolean"}),
        "previous_response_id": _nullable(_STRING),
        "truncation": {"enum": ["disabled", None]},
        "stream_options": _nullable(
            {"type": "object", "additionalProperties": False, "properties": {"include_obfuscation": {}}}
        ),
    }
    assert set(translated) == set(TRANSLATED) - {"stream"}, "each translated field described"
    properties = {name: chat.get(name, {}) for name in PASSED_AS_IS} | translated
    properties |= {name: {"type": "null"} for name in sorted(NOT_SERVED)}  # refused unless null
    return {"type": "object", "required": ["model", "input"], "properties": properties, "additionalProperties": False}


_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "model", "status", "output"],
    "properties": {
        "id": _STRING,
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "model": _STRING,
        "status": {"enum": ["queued", "in_progress", "completed", "failed", "incomplete", "cancelled"]},
        "output": {"type": "array", "items": {"type": "object"}},
    },
}
# one server-sent event of a response's stream: its type and sequence number, or the final error
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": _STRING,
        "id": _STRING,
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}},
    },
}
_INPUT_ITEMS = {
    "type": "object",
    "required": ["object", "data", "has_more"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object"}},
        "first_id": {"type": ["string", "null"]},
        "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"},
    },
}
_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": _STRING, "object": {"const": "response.deleted"}, "deleted": {"const": True}},
}
SCHEMAS = {"Response": _RESPONSE, "ResponseInputItemList": _INPUT_ITEMS, "ResponseDeleted": _DELETED}

_ID = {"name": "response_id", "in": "path", "required": True, "schema": _STRING}
# what refuses a read of a stored response
_READ = {
    "400": "a parameter the gateway refuses (`param` names it), or a request that is not valid HTTP/1.1",
    "401": "no API key, or a wrong one",
    "404": "no such response for this tenant, or one stored with store: false, or deleted",
    "503": "the log unavailable, or the response's owner unreachable",
}


def responses_paths(create: dict[str, Any], security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The paths of the Responses API; ``create`` is ``POST /v1/responses``, described as
    the chat completion's POST is (its refusals, the Idempotency-Key), its events this API's."""
    create["responses"]["200"]["content"]["text/event-stream"] = {"schema": _EVENT}

    def json_(ref: str, why: str) -> dict[str, Any]:
        return {"description": why, "content": {"application/json": {"schema": {"$ref": _REF + ref}}}}

    def refusals(*extra: tuple[str, str]) -> dict[str, Any]:
        return {status: json_("Error", why) for status, why in [*_READ.items(), *extra]}

    streamed = json_("Response", "the response; with stream=true, its events from the log or its owner")
    streamed["content"]["text/event-stream"] = {"schema": _EVENT}
    query = [
        {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
        {
            "name": "starting_after",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
            "description": "with stream=true: the last event the reader has",
        },
    ]
    paging = [
        {"name": "after", "in": "query", "required": False, "schema": _STRING},
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS},
        },
        {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
    ]

    def operation(
        operation_id: str, parameters: list[dict[str, Any]], ok: dict[str, Any], *extra: tuple[str, str]
    ) -> dict[str, Any]:
        return {
            "operationId": operation_id,
            "security": security,
            "parameters": [_ID, *parameters],
            "responses": {"200": ok} | refusals(*extra),
        }

    return {
        "/v1/responses": {"post": create},
        "/v1/responses/{response_id}": {
            "get": operation(
                "getResponse",
                query,
                streamed,
                ("409", "a live response's output read under content_policy digest or none"),
            ),
            "delete": operation(
                "deleteResponse",
                [],
                json_("ResponseDeleted", "deleted"),
                ("400", "a response still in progress: cancel it first"),
            ),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": operation("listInputItems", paging, json_("ResponseInputItemList", "the input items"))
        },
        "/v1/responses/{response_id}/cancel": {
            "post": operation(
                "cancelResponse",
                [],
                json_("Response", "the response as the cancel left it"),
                ("400", "not a background response"),
            )
        },
    }
