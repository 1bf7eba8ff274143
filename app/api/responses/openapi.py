"""The Responses API's part of ``GET /openapi.json`` (app/api/openapi.py): ``POST
/v1/responses`` and the routes that read, cancel and delete a stored response.

The request body is the JSON schema of the model the gateway checks it with
(app/contract/responses.py; app/api/openapi.py puts it in the document): the fields
passed on to the chat completion as the chat request declares them, the ones read here
to the depth they are read, a field phasegate does not serve refused unless null, and an
unknown field refused (``additionalProperties: false``), as the gateway refuses it. What
JSON Schema cannot say (``store: false`` with ``background``, a named ``tool_choice`` that
names no tool, ``stream_options`` only with ``stream``) is left to the 400 that names the
``param``. This module describes the answers and the routes that read stored responses.
"""

from __future__ import annotations

from typing import Any

from app.api.responses.routes import MAX_ITEMS

_REF = "#/components/schemas/"
_STRING = {"type": "string"}
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
