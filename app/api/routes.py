"""The HTTP API: the gateway's Starlette app, its rooms' routes put together.

Each API has a room (``app/api/chat/``, ``app/api/responses/``, ``app/api/messages/``) with
the same modules for the same jobs: ``request`` (the body read into the chat completion
its attempts ask for), ``shape`` (its answer's bytes, over the protocol of
app/api/shape.py), ``routes``, ``log`` (its answer rebuilt from the log) and ``openapi``
where it has one. Every generation is served the same way (app/api/generate.py). Beside
them: resuming a stream from the log (``app/api/resume/``), cancelling
(``app/api/cancel/``), the admin and fleet routes (``app/api/admin/``), and vLLM's
utility routes with the gateway's own (``app/api/utility/``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from app.api.admin.routes import admin_routes
from app.api.auth import Authenticator
from app.api.cancel.routes import cancel_routes
from app.api.chat.routes import chat_routes
from app.api.errors import ApiError, retry_headers
from app.api.generate import Generator
from app.api.limits import TenantLimiter
from app.api.messages.routes import messages_routes
from app.api.pooling.routes import pooling_routes
from app.api.request_ids import new_request_id
from app.api.responses.routes import responses_routes
from app.api.resume.routes import resume_routes
from app.api.utility.gateway import gateway_routes
from app.api.utility.routes import utility_routes
from app.api.utility.unserved import unserved_routes
from app.driver.context import GatewayContext
from app.telemetry.logs import LogContext
from app.telemetry.tracing import RequestSpans

log = logging.getLogger("phasegate.api")


def build_app(ctx: GatewayContext, *, extra_routes: Sequence[BaseRoute] = (), **starlette_options: Any) -> Starlette:
    authenticator = Authenticator(ctx.config, ctx.store)
    limiter = TenantLimiter(ctx.config.tenant_limits, ctx.drivers, lambda: ctx.budget.share)
    ctx.reloaded += [authenticator.reconfigure, lambda config: limiter.reconfigure(config.tenant_limits)]
    generate = Generator(ctx, authenticator, limiter).generate
    routes = [
        *chat_routes(ctx, generate),
        *gateway_routes(ctx, authenticator),
        *admin_routes(ctx, authenticator),
        *resume_routes(ctx, authenticator),
        *cancel_routes(ctx, authenticator),
        *responses_routes(ctx, authenticator, generate),
        *messages_routes(ctx, authenticator, generate),
        *pooling_routes(generate),
        *utility_routes(ctx, authenticator),
        *extra_routes,  # the fleet's admin routes (app/api/admin/fleet.py)
        *unserved_routes(),
    ]
    handlers = {HTTPException: _http_error, Exception: _unexpected_error}
    # every log line names the gateway instance, and a request's lines its current attempt
    middleware = [Middleware(LogContext, instance=lambda: ctx.gateway_id, attempt_of=_attempt_of(ctx))]
    middleware.append(Middleware(RequestSpans))  # a span per generation request, when tracing is on
    origins = ctx.config.cors_allow_origins
    if origins:  # off unless configured: no page elsewhere may read an answer
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta"],
                expose_headers=["x-request-id"],
                max_age=600,
            )
        )
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware, **starlette_options)


def _attempt_of(ctx: GatewayContext) -> Any:
    def attempt_of(request_id: str) -> int | None:
        driver = ctx.drivers.get(request_id)
        current = driver.state.current_attempt if driver is not None else None
        return current.attempt if current is not None else None

    return attempt_of


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.detail if isinstance(exc.detail, str) else "error")
    error.status = exc.status_code
    error.type = "invalid_request_error"
    error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    error.retryable = exc.status_code >= 500
    return JSONResponse(
        error.body(new_request_id()), status_code=exc.status_code, headers=retry_headers(error.retryable)
    )


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    request_id = new_request_id()
    log.exception("unexpected error serving %s (%s)", request.url.path, request_id, exc_info=exc)
    error = ApiError("the gateway hit an internal error")
    return JSONResponse(error.body(request_id), status_code=500, headers={"x-request-id": request_id})
