"""``GET /openapi.json``: an OpenAPI 3.1 description of the OpenAI routes phasegate serves
(chat completions, completions, models, and the Responses API's routes:
app/api/responses/openapi.py), for client generators and API fuzzers.

The request bodies are the JSON schemas of the models the gateway validates them with
(app/contract/requests.py, under the configured limits of ``max_tokens`` and ``n``), not
written beside them: every field vLLM declares with its type, phasegate's own described as
refused, any other field allowed, as vLLM allows it; ``model`` lists the configured models.
Messages, tools, ``tool_choice`` and ``response_format`` are described to the depth the
engines read them (app/contract/engine_inputs.py). What JSON Schema cannot say (a named
tool_choice must name one of the tools, tool names are unique, ``stream_options`` only
with ``stream``) is left to the 400 that names the ``param``. Served behind the same key
as ``/v1/models``: it lists the models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.api.messages.openapi import SCHEMAS as MESSAGES_SCHEMAS
from app.api.messages.openapi import messages_paths
from app.api.pooling.openapi import SCHEMAS as POOLING_SCHEMAS
from app.api.pooling.openapi import pooling_paths
from app.api.responses.openapi import SCHEMAS as RESPONSES_SCHEMAS
from app.api.responses.openapi import responses_paths
from app.config import GatewayConfig
from app.contract.messages import CountTokensRequest, messages_model
from app.contract.pooling import MODELS as POOLING_MODELS
from app.contract.requests import request_models
from app.contract.responses import responses_model

_REF = "#/components/schemas/"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
                "request_id": {"type": "string"},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_ANSWER_FIELDS = {
    "id": {"type": "string"},
    "created": {"type": "integer"},
    "model": {"type": "string"},
    "usage": {"anyOf": [_USAGE, {"type": "null"}]},
}
_CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": _ANSWER_FIELDS
    | {
        "object": {"const": "chat.completion"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message"],
                "properties": {"index": {"type": "integer"}, "message": {"type": "object"}},
            },
        },
    },
}
_TEXT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": _ANSWER_FIELDS
    | {
        "object": {"const": "text_completion"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "text"],
                "properties": {"index": {"type": "integer"}, "text": {"type": "string"}},
            },
        },
    },
}
_MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
            },
        },
    },
}
# one server-sent event of a stream: a chunk, the final error (docs/design.md §6), or [DONE]
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "id": {"type": "string"},
        "event": {"type": "string"},
        "data": {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [
                            {
                                "type": "object",
                                "required": ["id", "object", "created", "model", "choices"],
                                "properties": {
                                    "object": {"enum": ["chat.completion.chunk", "text_completion"]},
                                    "choices": {"type": "array"},
                                },
                            },
                            _ERROR,
                        ]
                    },
                },
            ]
        },
    },
}
# what refuses a generation request before it is accepted, and what ends one after
_REFUSALS = {
    "400": "a body or parameter the gateway (or a replica) refuses; `param` names it",
    "401": "no API key, or a wrong one",
    "404": "an unknown model",
    "413": "the body is over max_body_bytes",
    "415": "a body not sent as application/json",
    "409": "an Idempotency-Key's earlier request replayed from a log that keeps no text of it"
    " (resume_unavailable: content_policy digest or none, or a response with store: false)",
    "422": "an Idempotency-Key already used with another body",
    "429": "the tenant is over one of its limits (Retry-After)",
    "502": "every attempt failed before any output",
    "503": "no replica available, the retry budget spent, the log unavailable, or the gateway draining",
}


def openapi_document(config: GatewayConfig) -> dict[str, Any]:
    """The description of this gateway's OpenAI routes."""

    limits = config.limits
    schemas: dict[str, Any] = {}
    declared_models: list[type[BaseModel]] = [
        *request_models(limits.max_tokens, limits.max_n),
        responses_model(limits.max_tokens, limits.max_n),
        messages_model(limits.max_tokens, limits.max_n),
        CountTokensRequest,
        *POOLING_MODELS,
    ]
    for declared in declared_models:
        schema = declared.model_json_schema(ref_template=_REF + "{model}")
        for name, part in schema.pop("$defs", {}).items():
            assert schemas.setdefault(name, part) == part, f"two request models declare {name} apart"
        served: dict[str, Any] = (
            {"type": "string", "enum": sorted(config.models)} if config.models else {"type": "string"}
        )
        if len(config.models) == 1:  # a body that names none asks for the one served (app/api/generate.py)
            served = {"type": ["string", "null"], "enum": [*config.models, None]}
            schema["required"] = [name for name in schema.get("required", ()) if name != "model"]
        schema["properties"]["model"] = served
        schemas[declared.__name__] = schema
    security: list[dict[str, list[str]]] = [{"bearer": []}] if _keys_required(config) else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "phasegate", "version": "1", "description": "An OpenAI-compatible gateway (the routes)"},
        "paths": {
            "/v1/chat/completions": {"post": _generation("createChatCompletion", "ChatCompletion", security)},
            "/v1/completions": {"post": _generation("createCompletion", "Completion", security)},
            **responses_paths(_generation("createResponse", "Response", security), security),
            **messages_paths(security),
            **pooling_paths(security),
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "security": security,
                    "responses": {
                        "200": _json(_REF + "ModelList", "the served models"),
                        # the HTTP layer's refusal of a request that is not valid HTTP/1.1
                        # (a bad Content-Length), on every route (the fuzz suite's finding)
                        "400": _json(_REF + "Error", "a request that is not valid HTTP/1.1"),
                        "401": _json(_REF + "Error", _REFUSALS["401"]),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                **schemas,
                "ChatCompletion": _CHAT_COMPLETION,
                "Completion": _TEXT_COMPLETION,
                "ModelList": _MODEL_LIST,
                "Error": _ERROR,
                **RESPONSES_SCHEMAS,
                **MESSAGES_SCHEMAS,  # (named apart from the request models' parts above)
                **POOLING_SCHEMAS,
            },
        },
    }


def _keys_required(config: GatewayConfig) -> bool:
    return bool(config.api_keys)  # keys made with `phasegate keys` also apply; the description cannot know


def _json(ref: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _generation(operation_id: str, answer: str, security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """A POST that generates ``answer`` (``Create<answer>Request``), whole or streamed."""
    ok = _json(_REF + answer, "the whole answer; with stream: true, server-sent events ending with data: [DONE]")
    ok["content"]["text/event-stream"] = {"schema": _EVENT}
    return {
        "operationId": operation_id,
        "security": security,
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "pattern": "^[ -~]{1,255}$"},
                "description": "binds retries of this POST to one request (per tenant); printable ASCII",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"{_REF}Create{answer}Request"}}},
        },
        "responses": {"200": ok} | {status: _json(_REF + "Error", why) for status, why in _REFUSALS.items()},
    }
