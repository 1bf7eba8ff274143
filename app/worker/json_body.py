"""A worker request's JSON body, decoded only as deep and as wide as the worker can hold.

Every body the worker reads (start, renews, cancel, faults) goes through
:func:`decode_json_value`: at most :data:`MAX_JSON_DEPTH` levels (the gateway's limit and
the start body's own levels around it: app/contract/json_depth.py), no ``NaN`` or
``Infinity``, strings that are Unicode text; anything else is a 400 ``invalid_json``
(docs/worker-protocol.md).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from app.contract.json_depth import WORKER_MAX_JSON_DEPTH
from app.worker.protocol import Code, Refusal

MAX_JSON_DEPTH = WORKER_MAX_JSON_DEPTH  # objects and arrays nested in one another


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_json_value(raw: bytes) -> Any:
    """``raw`` as JSON of at most :data:`MAX_JSON_DEPTH` levels whose strings are Unicode text
    (no lone surrogates, which no UTF-8 writer can write back); else a 400 ``invalid_json``."""
    try:
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:  # deeper than this stack lets the standard library read
            body = orjson.loads(raw)  # which reads to 1,024 levels, past the limit
    except orjson.JSONDecodeError as exc:
        if "depth limit exceeded" in str(exc):
            raise Refusal(400, Code.INVALID_JSON, f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
        raise Refusal(400, Code.INVALID_JSON, f"the body is not JSON: {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError and over-long integers too
        raise Refusal(400, Code.INVALID_JSON, f"the body is not JSON: {exc}") from None
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    stack: list[tuple[Any, int]] = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise Refusal(400, Code.INVALID_JSON, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise Refusal(400, Code.INVALID_JSON, "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None


def decode_json(raw: bytes) -> dict[str, Any]:
    """:func:`decode_json_value` of a JSON object."""
    body = decode_json_value(raw)
    if not isinstance(body, dict):
        raise Refusal(400, Code.INVALID_JSON, "the body must be a JSON object")
    return body
