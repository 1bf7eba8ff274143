"""The HTTP API: OpenAI-compatible generation, models, health, readiness, metrics.

How a generation request is served: authenticate, read and validate the body
(every refusal is an OpenAI-style error with a stable code, counted, and never
reaches a replica), accept it into the log, then pull the driver's outputs until
the first thing the client should get. Headers are held back until then, so a
failure before any output is a real HTTP status (400 for an upstream refusal, 502
or 503 when retries are spent) rather than an error inside a 200 stream. A
streamed request then commits its first delta durably and hands the rest of the
driver's outputs to sse-starlette; a non-streamed one collects the whole answer,
commits, and answers once. While headers are held back a watcher notices a client
that leaves, which detaches it from the driver: generation goes on for the resume
grace, then is cancelled (docs/design.md §12).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from app.api.admin.routes import admin_routes
from app.api.answers import (
    failure_response,
    log_unavailable,
    shape_for,
    stream_body,
    unless_client_leaves,
    until_committed,
    whole_answer,
)
from app.api.auth import Authenticator
from app.api.bodies import json_body
from app.api.cancel.routes import cancel_routes
from app.api.chat.request import parse_request
from app.api.errors import (
    ApiError,
    IdempotencyKeyReused,
    InvalidRequest,
    LogUnavailable,
    NotFound,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
    retry_headers,
)
from app.api.limits import TenantLimiter
from app.api.messages.routes import messages_routes
from app.api.openapi import openapi_document
from app.api.request_ids import new_request_id
from app.api.responses.log import earlier_turns
from app.api.responses.request import parse_responses_request
from app.api.responses.routes import responses_routes
from app.api.responses.shape import ResponsesShape
from app.api.resume.attach import attach
from app.api.resume.routes import resume_routes
from app.api.token_stream import TokenStreamResponse, client_gone
from app.api.utility.routes import unready, utility_routes
from app.api.utility.unserved import unserved_routes
from app.driver import log_loss
from app.driver.context import GatewayContext
from app.driver.driver import RequestDriver
from app.driver.outputs import Cancelled, Delta, Failed, Finished, Output, Restarted
from app.driver.request import CHAT, COMPLETIONS, GenerationRequest
from app.http_cycle import CHUNK_WRITER
from app.logs import LogContext, bind_request
from app.store.errors import StoreError
from app.tracing import RequestSpans

log = logging.getLogger("phasegate.api")

CLIENT_CLOSED = 499  # nginx's code for "the client went away"; nobody reads it
MAX_IDEMPOTENCY_KEY = 255
REFUSALS = {
    # true with one instance and with many: the request was not accepted, and may be sent again
    "gateway_draining": "this gateway is draining (shutting down) and accepted nothing of this request;"
    " send it again after Retry-After, to another instance or to this one once it is back",
    "gateway_lost": "the gateway lost its place in the request log and is rejoining; retry shortly",
}


def build_app(ctx: GatewayContext, *, extra_routes: Sequence[BaseRoute] = (), **starlette_options: Any) -> Starlette:
    authenticator = Authenticator(ctx.config, ctx.store)
    limiter = TenantLimiter(ctx.config.tenant_limits, ctx.drivers, lambda: ctx.budget.share)
    ctx.reloaded += [authenticator.reconfigure, lambda config: limiter.reconfigure(config.tenant_limits)]
    api = _Api(ctx, authenticator, limiter)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        *admin_routes(ctx, authenticator),
        *resume_routes(ctx, authenticator),
        *cancel_routes(ctx, authenticator),
        *responses_routes(ctx, authenticator),
        *messages_routes(ctx, authenticator, api._generate),
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


class _Api:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator, limiter: TenantLimiter) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.limiter = limiter

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, self._parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, self._parse_completion)

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, self._parse_response)

    async def _parse_chat(self, body: Any, tenant: str) -> GenerationRequest:
        return parse_request(CHAT, body, self.ctx.config.limits)

    async def _parse_completion(self, body: Any, tenant: str) -> GenerationRequest:
        return parse_request(COMPLETIONS, body, self.ctx.config.limits)

    async def _parse_response(self, body: Any, tenant: str) -> GenerationRequest:
        """A Responses request, after the conversation its ``previous_response_id`` names
        (from the log, within the tenant)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        earlier = await earlier_turns(self.ctx.store, tenant, previous) if isinstance(previous, str) else []
        return parse_responses_request(body, self.ctx.config.limits, earlier)

    async def _generate(self, request: Request, parse: Callable[[Any, str], Awaitable[GenerationRequest]]) -> Response:
        request_id = new_request_id()
        bind_request(request_id)  # this task's log lines, and those of every task it starts
        headers = {"x-request-id": request_id}
        if self.ctx.refusal is not None:  # draining, or fenced until it registers again
            refused = ServiceUnavailable(
                REFUSALS.get(self.ctx.refusal, "the gateway is unavailable"), code=self.ctx.refusal
            )
            self.ctx.metrics.rejected.labels(code=refused.code).inc()
            return JSONResponse(refused.body(request_id), status_code=503, headers={**headers, "retry-after": "1"})
        try:
            tenant = await self.authenticator.tenant(request.headers.get("authorization", ""))
            body = _with_model(await json_body(request, self.ctx.config.max_body_bytes), self.ctx.config.models)
            generation = await parse(body, tenant)
            if generation.model not in self.ctx.config.models:
                raise NotFound(f"the model '{generation.model}' does not exist", param="model", code="model_not_found")
            key = _idempotency_key(request)
            if key is not None:
                original = await self._claim(tenant, key, request_id, generation)
                if original is not None:  # the same POST again: its request, from the log
                    return await attach(self.ctx, original, request, generation)
            # no await from here to driver.accept(): the admitted request is live at once
            self.limiter.admit(tenant, request_id, generation.estimated_prompt_tokens)
        except ApiError as error:
            self.ctx.metrics.rejected.labels(code=error.code).inc()
            log.info("rejected request %s: %s %s", request_id, error.code, error.message)
            headers |= retry_headers(error.retryable)
            if isinstance(error, RateLimited):
                headers["retry-after"] = str(error.retry_after_s)
            return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
        if not self.ctx.store.accepting:
            log.error("request %s refused: the event log is unavailable", request_id)
            return failure_response(request_id, log_loss.failure(0), headers)
        driver = RequestDriver(self.ctx, request_id, generation, tenant)
        driver.accept(idempotency_key=key, background=generation.background)
        log.debug(
            "request %s accepted: %s, model %s, tenant %s",
            request_id,
            generation.logged_endpoint,
            generation.model,
            tenant,
        )
        if generation.background and not generation.stream:
            return await self._in_background(driver, headers)
        try:
            first = await unless_client_leaves(request, driver, self._until_response(driver))
        except StoreError:
            return log_unavailable(driver, headers)
        if first is None:
            return Response(status_code=CLIENT_CLOSED, headers=headers)
        if not isinstance(first, Delta | Finished) or not generation.stream:  # answered whole, or failed
            self.limiter.charge(tenant, driver.state.delivered_output_tokens)
        if isinstance(first, Failed):
            return failure_response(request_id, first, headers)
        if isinstance(first, JSONResponse):
            first.headers.update(headers)
            return first
        assert isinstance(first, Delta | Finished)
        # the commit point's append runs while the response is made ready; its first
        # events wait for it (``until_committed``), and so does its head
        committing = driver.begin_commit()
        await asyncio.sleep(0)  # the store's writer sends it first: PostgreSQL works while this goes on
        shape = shape_for(generation, request_id, driver.created, driver.answered_by)
        gone = client_gone(request.scope, request.receive)
        charge = functools.partial(self.limiter.charge, tenant)
        committed = functools.partial(until_committed, driver, committing, headers)
        writer = request.scope.get(CHUNK_WRITER)
        body = stream_body(driver, shape, first, gone, charge, writer=writer, committed=committed)
        return TokenStreamResponse(body, headers=headers)

    async def _in_background(self, driver: RequestDriver, headers: dict[str, str]) -> Response:
        """A background response (docs/design.md §15): answered ``queued`` once its accept is
        durable, so that any instance finds it; it generates on with no client attached."""
        try:
            await asyncio.shield(driver.run_in_background())
        except StoreError:
            return log_unavailable(driver, headers)
        shape = ResponsesShape(driver.request, driver.request_id, driver.created)
        return JSONResponse(shape.response("queued"), headers=headers)

    async def _until_response(self, driver: RequestDriver) -> Output | JSONResponse:
        """Pull until the response can start: a failure, the first delta (to commit), or
        for a non-streamed request the whole answer."""
        async for output in driver.outputs:
            if isinstance(output, Restarted):
                continue
            if isinstance(output, Failed | Cancelled):
                return output
            if not driver.request.stream:
                return await whole_answer(driver, output)
            return output
        state = driver.state  # pragma: no cover - a bug in the driver if it happens
        raise RuntimeError(f"request {driver.request_id} ended without an outcome in {state.phase} at seq {state.seq}")

    async def _claim(self, tenant: str, key: str, request_id: str, generation: GenerationRequest) -> str | None:
        """Claim ``key`` for this request: ``None`` when it starts one, else the request
        that the same body started with it before (another body: 422)."""
        keys = self.ctx.idempotency
        if keys is None:
            raise InvalidRequest("this gateway's log does not keep idempotency keys", param="Idempotency-Key")
        digest = f"{generation.logged_endpoint}:{generation.params_digest()}"
        try:
            claimed = await keys.claim(tenant, key, request_id, digest, self.ctx.config.idempotency_ttl_s)
        except StoreError:
            raise LogUnavailable() from None
        if claimed.new:
            return None
        if claimed.body_digest != digest:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used for another request body; use a new key", param="Idempotency-Key"
            )
        return claimed.request_id

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


def _with_model(body: Any, models: Mapping[str, str]) -> Any:
    """A body that names no ``model`` asks for the one the gateway serves, as ``vllm serve``
    takes its own; where it serves several, which is meant is the client's to say."""
    if not isinstance(body, dict) or body.get("model") is not None:
        return body
    if len(models) == 1:
        return {**body, "model": next(iter(models))}
    raise InvalidRequest(
        f"'model' is required: this gateway serves {len(models)} models ({', '.join(sorted(models))})",
        param="model",
        code="model_required",
    )


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isascii() and key.isprintable()):
        raise InvalidRequest(
            f"'Idempotency-Key' must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return key


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
