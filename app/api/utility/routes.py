"""vLLM's utility routes through the gateway (docs/design.md §14): ``POST /tokenize``,
``POST /detokenize``, ``GET /version`` and ``GET /health``, at the root as ``vllm serve``
has them.

``/tokenize`` and ``/detokenize`` go to an available replica that serves the body's
``model`` (the gateway's first model when the body names none, as vLLM's one model is the
default), ``/version`` to any available replica; the replica's status and JSON answer are
the client's. They are authenticated as any request is, refused with the same errors
(unknown model, no replica, a body over the limit, not JSON), and not logged as requests:
they generate nothing. ``/health`` answers as vLLM's does, 200 with an empty body while
the gateway is ready (``/readyz``) and 503 otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.bodies import json_body
from app.api.errors import ApiError, BadGateway, InvalidRequest, NotFound, ServiceUnavailable
from app.api.request_ids import new_request_id
from app.contract.integers import quoted
from app.driver.context import GatewayContext

log = logging.getLogger("phasegate.api")


def utility_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    routes = _Utility(ctx, authenticator)
    return [
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/version", routes.version, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
    ]


async def unready(ctx: GatewayContext) -> list[str]:
    """Why the gateway is not ready (``/readyz`` lists them, ``/health`` is 503); none: ready."""
    problems = []
    if ctx.refusal is not None:
        problems.append(f"gateway: {ctx.refusal}")
    try:
        await ctx.store.ping()
    except Exception as exc:
        problems.append(f"event log: {exc}")
    if ctx.pool.unready():  # an empty fleet is ready: docs/design.md §16
        problems.append("no healthy replica")
    return problems


class _Utility:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator

    async def tokenize(self, request: Request) -> Response:
        return await self._relay(request, "tokenize", with_body=True)

    async def detokenize(self, request: Request) -> Response:
        return await self._relay(request, "detokenize", with_body=True)

    async def version(self, request: Request) -> Response:
        return await self._relay(request, "version", with_body=False)

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if await unready(self.ctx) else 200)

    async def _relay(self, request: Request, path: str, *, with_body: bool) -> Response:
        request_id = new_request_id()
        headers = {"x-request-id": request_id}
        try:
            await self.authenticator.tenant(request.headers.get("authorization", ""))
            body: dict[str, Any] | None = None
            model = None
            if with_body:
                body = await json_body(request, self.ctx.config.max_body_bytes)
                if not isinstance(body, dict):
                    raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
                model = self._model_of(body)
            try:
                status, answer = await self.ctx.pool.utility(path, body, model)
            except LookupError:
                raise ServiceUnavailable("no replica is available for it now", code="no_replica_available") from None
            except ConnectionError as exc:
                log.warning("%s", exc)
                raise BadGateway(f"the replica gave no answer to /{path}") from None
        except ApiError as error:
            return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
        return JSONResponse(answer, status_code=status, headers=headers)

    def _model_of(self, body: dict[str, Any]) -> str:
        models = self.ctx.config.models
        model = body.get("model")
        if model is None and models:
            return next(iter(models))
        if not isinstance(model, str):  # quoted back, a nested value could not even be written
            raise InvalidRequest("'model' must be a string naming a served model", param="model")
        if model not in models:
            raise NotFound(f"the model {quoted(model)} does not exist", param="model", code="model_not_found")
        return model
