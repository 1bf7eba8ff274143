"""A request's JSON body, read within the gateway's limit: one reader for every route."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from app.api.errors import ClientGone, InvalidRequest, RequestTooLarge, UnsupportedMediaType
from app.contract.integers import exceeds
from app.contract.json_depth import MAX_JSON_DEPTH, depth_over


async def json_body(request: Request, limit: int) -> Any:
    # JSON only: a browser page may post text/plain or a form cross-origin without asking
    # (no CORS preflight), but not application/json
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            f"the body must be sent as 'Content-Type: application/json', not {media_type or 'none'!r}",
            param="content-type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and exceeds(declared, limit):
        raise RequestTooLarge(f"the request body is over the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestTooLarge(f"the request body is over the limit of {limit} bytes")
    except ClientDisconnect:  # gone mid-body, or cut by http_body_timeout_s: a refusal, not a 500
        raise ClientGone("the client closed the connection before its request body was read") from None
    try:
        # orjson refuses what the standard library lets through and nothing downstream
        # can hold: lone UTF-16 surrogates (not Unicode text), NaN and Infinity
        value = orjson.loads(body)
    except ValueError as exc:
        if "depth limit exceeded" in str(exc):  # orjson's own limit, a little past ours
            raise too_deep() from None
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    # one limit for every route and replica kind, here where the body is parsed: every
    # encoder on the path writes what it admits (app/contract/json_depth.py)
    if depth_over(value, MAX_JSON_DEPTH):
        raise too_deep()
    return value


def too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels of objects and arrays", code="invalid_json"
    )
