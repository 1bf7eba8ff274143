"""The gateway's own routes: ``GET /v1/models``, ``GET /openapi.json``, ``GET /healthz``,
``GET /readyz`` and ``GET /metrics``.

``/v1/models`` lists each model as a replica serving it describes it, under the configured
name; ``/openapi.json`` describes every route (app/api/openapi.py); both are behind the same
key as a generation. ``/healthz`` says the process answers, ``/readyz`` whether it can serve
(the log, a replica, not draining: :func:`app.api.utility.routes.unready`), ``/metrics`` is
Prometheus's, behind its own token when one is set.
"""

from __future__ import annotations

import asyncio
import hmac

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.errors import ApiError, ServiceUnavailable, Unauthorized, retry_headers
from app.api.openapi import openapi_document
from app.api.request_ids import new_request_id
from app.api.utility.routes import unready
from app.driver.context import GatewayContext


def gateway_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    routes = _Gateway(ctx, authenticator)
    return [
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/openapi.json", routes.openapi, methods=["GET"]),
        Route("/healthz", routes.healthz, methods=["GET"]),
        Route("/readyz", routes.readyz, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
    ]


class _Gateway:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator

    async def models(self, request: Request) -> Response:
        try:  # with API keys configured, listing models needs one too
            await self.authenticator.tenant(request.headers.get("authorization", ""))
        except (Unauthorized, ServiceUnavailable) as error:
            return _refused(error)
        # each model as a replica serving it describes it (vLLM: max_model_len, root,
        # permission …), under the configured name; phasegate's own card where none answers
        models = self.ctx.config.models
        cards = await asyncio.gather(*(self.ctx.pool.model_card(name) for name in models))
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "phasegate", "root": revision}
            | {key: value for key, value in card.items() if key not in ("id", "object")}
            for (name, revision), card in zip(models.items(), cards, strict=True)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def openapi(self, request: Request) -> Response:
        try:  # it lists the models: behind the same key as /v1/models
            await self.authenticator.tenant(request.headers.get("authorization", ""))
        except (Unauthorized, ServiceUnavailable) as error:
            return _refused(error)
        return JSONResponse(openapi_document(self.ctx.config))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        problems = await unready(self.ctx)
        # a replica out for its protocol version is named, and makes the gateway unready only
        # with the rest (a rolling upgrade of the workers must not take the gateways out)
        replicas = self.ctx.pool.replicas.values()
        unused = [f"replica {r.id} not used: {r.incompatible}" for r in replicas if r.incompatible]
        if problems:
            return JSONResponse({"status": "unavailable", "problems": problems + unused}, status_code=503)
        return JSONResponse({"status": "ready", **({"problems": unused} if unused else {})})

    async def metrics(self, request: Request) -> Response:
        token = self.ctx.config.metrics_token
        if token is not None:
            scheme, _, offered = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(offered.strip().encode(), token.encode()):
                return _refused(
                    Unauthorized("/metrics needs 'Authorization: Bearer <metrics token>'", code="invalid_metrics_token")
                )
        return Response(self.ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _refused(error: ApiError) -> JSONResponse:
    request_id = new_request_id()
    headers = {"x-request-id": request_id, **retry_headers(error.retryable)}
    if isinstance(error, Unauthorized):
        headers["www-authenticate"] = "Bearer"
    return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
