"""Anthropic's Messages API (docs/design.md §17): ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``, and a message's stream resumed from the log.

A message is generated as any request is (app/api/generate.py): the body is read into the
chat completion its attempts ask for (app/api/messages/request.py), and its answer and
stream take this API's shape (app/api/messages/shape.py). Clients speak Anthropic's way:
the key comes in ``x-api-key`` (or ``Authorization``), ``anthropic-version`` and
``anthropic-beta`` are taken, and every refusal is in Anthropic's error shape, with
phasegate's stable ``code`` and ``request_id`` beside its ``type``.

``count_tokens`` asks a replica serving the model to tokenize the chat messages the body
makes (vLLM's ``/tokenize``), as vLLM's own counts them; it generates nothing and is not
logged as a request. A message's stream is resumed with ``GET /v1/requests/{id}/stream``
and ``Last-Event-ID`` (the id of the last event the client has): attached to its live loop
here, at its owner while it is live on another instance, else rebuilt from the log.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.bodies import json_body
from app.api.errors import ApiError, BadGateway, InvalidRequest, NotFound, ServiceUnavailable, retry_headers
from app.api.generate import Generate
from app.api.messages.request import count_body_of, parse_messages_request
from app.api.messages.shape import anthropic_error
from app.api.request_ids import id_header, new_request_id
from app.driver.context import GatewayContext
from app.driver.request import GenerationRequest

log = logging.getLogger("phasegate.api")

KEPT_HEADERS = ("x-request-id", "x-should-retry", "retry-after", "www-authenticate")


def messages_routes(ctx: GatewayContext, authenticator: Authenticator, generate: Generate) -> list[Route]:
    """The routes; ``generate`` serves a generation request as the gateway serves every one."""
    routes = _Messages(ctx, authenticator, generate)
    return [
        Route("/v1/messages", routes.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
    ]


class _Messages:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator, generate: Generate) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.generate = generate

    async def create(self, request: Request) -> Response:
        if "idempotency-key" in request.headers:
            refused = InvalidRequest(
                "'Idempotency-Key' is not served for /v1/messages: resume a stream by its request id instead",
                param="Idempotency-Key",
                code="unsupported_parameter",
            )
            return _refused(refused, new_request_id())
        return anthropic_answer(await self.generate(with_key(request), self._parse))

    async def _parse(self, body: Any, tenant: str) -> GenerationRequest:
        return parse_messages_request(body, self.ctx.config.limits)

    async def count_tokens(self, request: Request) -> Response:
        request_id = new_request_id()
        try:
            await self.authenticator.tenant(with_key(request).headers.get("authorization", ""))
            tokenize = count_body_of(await json_body(request, self.ctx.config.max_body_bytes))
            model = tokenize["model"]
            if model not in self.ctx.config.models:
                raise NotFound(f"the model '{model}' does not exist", param="model", code="model_not_found")
            asked: dict[str, Any] = {key: tokenize[key] for key in ("model", "messages", "tools") if key in tokenize}
            try:
                status, answer = await self.ctx.pool.utility("tokenize", asked, model)
            except LookupError:
                raise ServiceUnavailable("no replica is available for it now", code="no_replica_available") from None
            except ConnectionError as exc:
                log.warning("%s", exc)
                raise BadGateway("the replica gave no answer to /tokenize") from None
        except ApiError as error:
            return _refused(error, request_id)
        headers = id_header(request_id)
        if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("count"), int):
            said = answer.get("error") if isinstance(answer, dict) else None
            message = said.get("message") if isinstance(said, dict) else None
            refused = {
                "message": message if isinstance(message, str) else f"the replica answered {status} to /tokenize",
                "code": "upstream_refused_request" if 400 <= status < 600 else "upstream_unavailable",
                "request_id": request_id,
            }
            status = status if 400 <= status < 600 else 502
            return JSONResponse(anthropic_error(status, refused), status_code=status, headers=headers)
        count = answer["count"]
        counted = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        return JSONResponse(counted, headers=headers)


def with_key(request: Request) -> Request:
    """The request with its ``x-api-key`` as the ``Authorization`` every route reads, where
    it sends no ``Authorization`` (Anthropic's clients send the key that way)."""
    key = request.headers.get("x-api-key")
    if key is None or "authorization" in request.headers:
        return request
    scope = dict(request.scope)
    scope["headers"] = [*request.scope["headers"], (b"authorization", f"Bearer {key}".encode("latin-1"))]
    return Request(scope, request.receive)


def anthropic_answer(response: Response) -> Response:
    """A refusal in the OpenAI error shape (``{"error": {...}}``) in Anthropic's; anything else as it is."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    body = json.loads(bytes(response.body))
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return response
    headers = {name: response.headers[name] for name in KEPT_HEADERS if name in response.headers}
    return JSONResponse(anthropic_error(response.status_code, body["error"]), response.status_code, headers=headers)


def _refused(error: ApiError, request_id: str) -> JSONResponse:
    headers = id_header(request_id) | retry_headers(error.retryable)
    return JSONResponse(anthropic_error(error.status, error.body(request_id)["error"]), error.status, headers=headers)
