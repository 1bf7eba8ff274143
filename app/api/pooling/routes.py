"""The pooling routes (docs/design.md §17): embeddings (``/v1/embeddings``, Cohere's
``/v2/embed``), ``/pooling``, ``/classify``, score (``/score``, ``/v1/score``) and rerank
(``/rerank``, ``/v1/rerank``, ``/v2/rerank``), on every path ``vllm serve`` serves them.

A pooling request is served as any request is (app/api/generate.py: authenticated, limited,
accepted into the log, retried before its answer): its body is checked against its route's
declaration (app/api/pooling/request.py), each attempt asks its replica on the same path,
and its answer is the replica's, whole (app/api/pooling/answer.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.errors import UnsupportedParameter, retry_headers
from app.api.generate import Generate
from app.api.pooling.request import parse_pooling_request
from app.api.request_ids import id_header, new_request_id
from app.contract.pooling import ROUTES
from app.driver.request import GenerationRequest


def pooling_routes(generate: Generate) -> list[Route]:
    """The routes; ``generate`` serves a request as the gateway serves every one."""
    return [Route(path, _route(path, generate), methods=["POST"]) for path in ROUTES]


def _route(path: str, generate: Generate) -> Callable[[Request], Awaitable[Response]]:
    async def parse(body: Any, tenant: str) -> GenerationRequest:
        return parse_pooling_request(path, body)

    async def serve(request: Request) -> Response:
        if "idempotency-key" in request.headers:  # its answer is not stored: nothing to give again
            request_id = new_request_id()
            refused = UnsupportedParameter(
                f"'Idempotency-Key' is not served for {path}: a pooling answer is not stored to be given again",
                param="Idempotency-Key",
            )
            headers = id_header(request_id) | retry_headers(refused.retryable)
            return JSONResponse(refused.body(request_id), refused.status, headers=headers)
        return await generate(request, parse)

    return serve
