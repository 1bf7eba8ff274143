"""The pooling routes' part of ``GET /openapi.json`` (app/api/openapi.py): each route's
answer as vLLM's server gives it, and its refusals in the OpenAI error shape.

The request bodies are the JSON schemas of the models the gateway checks them with
(app/contract/pooling.py; app/api/openapi.py puts them in the document). What JSON Schema
cannot say (exactly one form of the input given) is left to the 400 that names the ``param``.
"""

from __future__ import annotations

from typing import Any

from app.contract.pooling import ROUTES

_REF = "#/components/schemas/"
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "total_tokens")},
}


def _list(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "list"},
            "created": {"type": "integer"},
            "model": {"type": ["string", "null"]},
            "data": {"type": "array", "items": {"type": "object", "required": ["index", *item], "properties": item}},
            "usage": _USAGE,
        },
    }


_NUMBERS = {"type": "array", "items": {"type": "number"}}
_VECTOR = {"anyOf": [_NUMBERS, {"type": "string", "description": "base64"}, {"type": "array"}]}
SCHEMAS: dict[str, Any] = {
    "EmbeddingList": _list({"embedding": _VECTOR}),
    "PoolingList": _list({"data": _VECTOR}),
    "ClassificationList": _list({"probs": _NUMBERS}),
    "ScoreList": _list({"score": {"type": "number"}}),
    "CohereEmbedding": {
        "type": "object",
        "required": ["embeddings"],
        "properties": {
            "id": {"type": "string"},
            "embeddings": {"type": "object"},
            "meta": {"type": ["object", "null"]},
        },
    },
    "RerankList": {
        "type": "object",
        "required": ["results", "usage"],
        "properties": {
            "id": {"type": "string"},
            "model": {"type": "string"},
            "usage": _USAGE,
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "relevance_score"],
                    "properties": {"index": {"type": "integer"}, "relevance_score": {"type": "number"}},
                },
            },
        },
    },
}
_ANSWERS = {
    "/v1/embeddings": ("createEmbedding", "EmbeddingList"),
    "/v2/embed": ("createCohereEmbedding", "CohereEmbedding"),
    "/pooling": ("createPooling", "PoolingList"),
    "/classify": ("createClassification", "ClassificationList"),
    "/score": ("createScore", "ScoreList"),
    "/v1/score": ("createScoreV1", "ScoreList"),
    "/rerank": ("createRerank", "RerankList"),
    "/v1/rerank": ("createRerankV1", "RerankList"),
    "/v2/rerank": ("createRerankV2", "RerankList"),
}
_REFUSALS = {
    "400": "a body the gateway (or a replica) refuses, or an Idempotency-Key (not served here); `param` names it",
    "401": "no API key, or a wrong one",
    "404": "an unknown model",
    "413": "the body is over max_body_bytes",
    "415": "a body not sent as application/json",
    "429": "the tenant is over one of its limits (Retry-After)",
    "501": "the replica's engine serves no pooling requests (a worker's vllm engine)",
    "502": "every attempt failed before the answer",
    "503": "no replica available, the retry budget spent, the log unavailable, or the gateway draining",
}


def pooling_paths(security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The paths of the pooling routes."""

    def json_(ref: str, why: str) -> dict[str, Any]:
        return {"description": why, "content": {"application/json": {"schema": {"$ref": _REF + ref}}}}

    paths: dict[str, Any] = {}
    for path, (operation_id, answer) in _ANSWERS.items():
        ok = json_(answer, "the replica's answer, whole")
        if "encoding_format" in ROUTES[path].model_fields:  # bytes or bytes_only: the vectors' bytes
            ok["content"]["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        paths[path] = {
            "post": {
                "operationId": operation_id,
                "security": security,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": _REF + ROUTES[path].__name__}}},
                },
                "responses": {"200": ok} | {status: json_("Error", why) for status, why in _REFUSALS.items()},
            }
        }
    return paths
