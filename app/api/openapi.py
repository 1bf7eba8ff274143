"""``GET /openapi.json``: an OpenAPI 3.1 description of the OpenAI routes phasegate serves
(chat completions, completions, models, and the Responses API's routes:
app/api/openapi_responses.py), for client generators and API fuzzers.

It is built from what the gateway checks, not written beside it: the fields each endpoint
takes are vLLM's (app/contract/request_fields.py: a passed-on field is described by its
JSON type there, or as any value; phasegate's own are described as refused; a field vLLM
does not declare is allowed, as vLLM allows it), the models are the configured ones and
``max_tokens`` and ``n`` go to the configured limits. Messages, tools, ``tool_choice`` and
``response_format`` are described to the depth app/contract/engine_inputs.py checks them;
what JSON Schema cannot say (a named tool_choice must name one of the tools, tool names
are unique, ``stream_options`` only with ``stream``) is left to the 400 that names the
``param``. Served behind the same key as ``/v1/models``: it lists the models.
"""

from __future__ import annotations

from typing import Any

from app.api.openapi_responses import SCHEMAS as RESPONSES_SCHEMAS
from app.api.openapi_responses import responses_paths, responses_request
from app.config import GatewayConfig
from app.contract.engine_inputs import MAX_NAME_CHARS, RESPONSE_FORMATS, ROLES, TOOL_CHOICES
from app.contract.request_fields import FIELD_TYPES, OWN, PASSED_CHAT, PASSED_COMPLETIONS, RECORDED, WHOLE_ONLY

_REF = "#/components/schemas/"
_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": ["string", "null"]},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _NAME, "arguments": {"type": ["string", "object", "null"]}},
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": sorted(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "name": {"type": ["string", "null"]},
        "tool_call_id": {"type": ["string", "null"]},
    },
}
_ASSISTANT_CALLING = {  # an assistant message may carry tool calls instead of content
    "type": "object",
    "required": ["role", "tool_calls"],
    "properties": {
        "role": {"const": "assistant"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
        "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL},
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": _NAME,
                "description": {"type": ["string", "null"]},
                "strict": {"type": ["boolean", "null"]},
                "parameters": {
                    "type": ["object", "null"],
                    "properties": {"properties": {"type": ["object", "null"]}},
                },
            },
        },
    },
}
_RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": [kind for kind in RESPONSE_FORMATS if kind != "json_schema"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "schema": {"type": "object"},
                        "name": {"type": ["string", "null"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
    ]
}
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
# one server-sent event of a stream: a chunk, the final error (DESIGN.md §6), or [DONE]
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
    "422": "an Idempotency-Key already used with another body",
    "429": "the tenant is over one of its limits (Retry-After)",
    "502": "every attempt failed before any output",
    "503": "no replica available, the retry budget spent, the log unavailable, or the gateway draining",
}


def openapi_document(config: GatewayConfig) -> dict[str, Any]:
    """The description of this gateway's OpenAI routes."""

    def nullable(schema: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [schema, {"type": "null"}]}

    number = {"type": "number"}
    limit = {"maximum": config.limits.max_tokens} if config.limits.max_tokens is not None else {}
    max_tokens = nullable({"type": "integer", "minimum": 1, **limit})
    common: dict[str, Any] = {name: nullable(kind.schema) for name, kind in FIELD_TYPES.items()}
    common |= {
        "model": {"type": "string", "enum": sorted(config.models)} if config.models else {"type": "string"},
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable(
            {
                "type": "object",
                "properties": {
                    "include_usage": nullable({"type": "boolean"}),
                    "continuous_usage_stats": nullable({"type": "boolean"}),
                },
            }
        ),
        "max_tokens": max_tokens,
        "temperature": nullable(number | {"minimum": 0}),
        "top_p": nullable(number | {"exclusiveMinimum": 0, "maximum": 1}),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": config.limits.max_n}),
        "stop": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
        "metadata": nullable(
            {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 512}}
        ),
        "seed": nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        "presence_penalty": nullable(number | {"minimum": -2, "maximum": 2}),
        "frequency_penalty": nullable(number | {"minimum": -2, "maximum": 2}),
        "user": nullable({"type": "string"}),
        "ignore_eos": nullable({"type": "boolean"}),
    }
    chat = common | {
        "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [_MESSAGE, _ASSISTANT_CALLING]}},
        "max_completion_tokens": max_tokens,
        "tools": nullable({"type": "array", "items": _TOOL}),
        "tool_choice": nullable({"anyOf": [{"enum": list(TOOL_CHOICES)}, {"$ref": _REF + "NamedToolChoice"}]}),
        "response_format": nullable(_RESPONSE_FORMAT),
    }
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    completion = common | {
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                token_ids,
                {"type": "array", "minItems": 1, "items": token_ids},
            ]
        },
        # instead of a prompt: base64 tensors, passed on (a replica may refuse them)
        "prompt_embeds": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
            ]
        },
    }
    security: list[dict[str, list[str]]] = [{"bearer": []}] if _keys_required(config) else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "phasegate", "version": "1", "description": "An OpenAI-compatible gateway (the routes)"},
        "paths": {
            "/v1/chat/completions": {"post": _generation("createChatCompletion", "ChatCompletion", security)},
            "/v1/completions": {"post": _generation("createCompletion", "Completion", security)},
            **responses_paths(_generation("createResponse", "Response", security), security),
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
                "CreateChatCompletionRequest": _request(chat, PASSED_CHAT | RECORDED, ["model", "messages"]),
                "CreateCompletionRequest": _request(completion, PASSED_COMPLETIONS | RECORDED, ["model"])
                | {"anyOf": [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]},
                "NamedToolChoice": {
                    "type": "object",
                    "required": ["function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
                    },
                },
                "CreateResponseRequest": responses_request(chat, max_tokens),
                "ChatCompletion": _CHAT_COMPLETION,
                "Completion": _TEXT_COMPLETION,
                "ModelList": _MODEL_LIST,
                "Error": _ERROR,
                **RESPONSES_SCHEMAS,
            },
        },
    }


def _keys_required(config: GatewayConfig) -> bool:
    return bool(config.api_keys)  # keys made with `phasegate keys` also apply; the description cannot know


def _request(properties: dict[str, Any], fields: frozenset[str], required: list[str]) -> dict[str, Any]:
    """A request body: each field described (any value where no schema is given), phasegate's
    own refused (``false``: not allowed), ``stream`` and ``stream_options`` as the client may
    give them, and any other field allowed, as vLLM allows it."""
    described: dict[str, Any] = {
        name: properties.get(name, {}) for name in sorted(fields | {"stream", "stream_options"})
    }
    described |= dict.fromkeys(sorted(OWN), False)
    described |= {name: {"type": "null"} for name in sorted(WHOLE_ONLY)}  # refused unless null
    return {"type": "object", "required": required, "properties": described}


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
