"""How a generation request is served, whichever API it came by (chat completions,
completions, the Responses API, the Messages API): authenticate, read and validate the body
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
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
from app.api.errors import (
    ApiError,
    IdempotencyKeyReused,
    InvalidRequest,
    LogUnavailable,
    NotFound,
    RateLimited,
    ServiceUnavailable,
    retry_headers,
)
from app.api.limits import TenantLimiter
from app.api.request_ids import new_request_id
from app.api.responses.shape import ResponsesShape
from app.api.resume.attach import attach
from app.api.token_stream import TokenStreamResponse, client_gone
from app.driver import log_loss
from app.driver.context import GatewayContext
from app.driver.driver import RequestDriver
from app.driver.outputs import Cancelled, Delta, Failed, Finished, Output, Restarted
from app.driver.request import GenerationRequest
from app.http.cycle import CHUNK_WRITER
from app.store.errors import StoreError
from app.telemetry.logs import bind_request

log = logging.getLogger("phasegate.api")

Parse = Callable[[Any, str], Awaitable[GenerationRequest]]  # a body and its tenant: the request it asks for
Generate = Callable[[Request, Parse], Awaitable[Response]]  # a generation request served (``Generator.generate``)
CLIENT_CLOSED = 499  # nginx's code for "the client went away"; nobody reads it
MAX_IDEMPOTENCY_KEY = 255
REFUSALS = {
    # true with one instance and with many: the request was not accepted, and may be sent again
    "gateway_draining": "this gateway is draining (shutting down) and accepted nothing of this request;"
    " send it again after Retry-After, to another instance or to this one once it is back",
    "gateway_lost": "the gateway lost its place in the request log and is rejoining; retry shortly",
}


class Generator:
    """Serves a generation request of any API: its room parses the body (``parse``), and
    its answer takes the API's shape (app/api/answers.py ``shape_for``)."""

    def __init__(self, ctx: GatewayContext, authenticator: Authenticator, limiter: TenantLimiter) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.limiter = limiter

    async def generate(self, request: Request, parse: Parse) -> Response:
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
