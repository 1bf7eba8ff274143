"""The Responses API (docs/design.md §15): ``POST /v1/responses``, served as every generation
is (app/api/generate.py, the body read by app/api/responses/request.py); and ``GET
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``: a response as the log
holds it, on any instance (app/api/responses/log.py).

A finished response comes back whole: its output, usage and status, or its failure
with the output the client was sent. A live one is ``in_progress``, with the output its
owner shows, and records as delivered, since showing output is a delivery
(app/api/responses/poll.py; another instance passes the poll on). ``?stream=true``
reads its stream again (``starting_after``: from the event after that one): attached
to its live loop where it waits for a reader (a background response, a client back
within its grace), at its owner while it is live on another instance, else from the
log, as its client was sent it, then what was produced with nobody attached.
``POST /v1/responses/{id}/cancel`` is the stop button (app/api/cancel/routes.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.cancel.routes import stop
from app.api.errors import ApiError, InvalidRequest, LogUnavailable, NotFound
from app.api.generate import Generate
from app.api.json_answer import JSONAnswer
from app.api.request_ids import id_header
from app.api.responses.log import (
    ENDED,
    body_of,
    earlier_turns,
    kept_body,
    response_events,
    response_from_log,
    shape_of,
    shown_deltas,
)
from app.api.responses.poll import poll_live
from app.api.responses.request import parse_responses_request
from app.api.resume.attach import at_owner, ended, stream_from
from app.api.resume.follow import record_resumed
from app.api.resume.log import check_resumable
from app.contract.integers import IntegerRefused, parse_integer
from app.driver.context import GatewayContext
from app.driver.request import GenerationRequest
from app.store.base import RequestInput
from app.store.errors import StoreUnavailable
from statemachine import events as ev

log = logging.getLogger("phasegate.api")

MAX_ITEMS = 100


def responses_routes(ctx: GatewayContext, authenticator: Authenticator, generate: Generate) -> list[Route]:
    routes = _Responses(ctx, authenticator, generate)
    return [
        Route("/v1/responses", routes.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", routes.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", routes.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", routes.input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", routes.cancel, methods=["POST"]),
    ]


class _Responses:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator, generate: Generate) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.generate = generate

    async def create(self, request: Request) -> Response:
        return await self.generate(request, self._parse)

    async def _parse(self, body: Any, tenant: str) -> GenerationRequest:
        """A Responses request, after the conversation its ``previous_response_id`` names
        (from the log, within the tenant)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        earlier = await earlier_turns(self.ctx.store, tenant, previous) if isinstance(previous, str) else []
        return parse_responses_request(body, self.ctx.config.limits, earlier)

    async def retrieve(self, request: Request) -> Response:
        return await self._answer(request, self._retrieve)

    async def input_items(self, request: Request) -> Response:
        return await self._answer(request, self._input_items)

    async def delete(self, request: Request) -> Response:
        return await self._answer(request, self._delete)

    async def cancel(self, request: Request) -> Response:
        return await self._answer(request, self._cancel)

    async def _answer(self, request: Request, serve: Callable[[Request, _Stored], Awaitable[Response]]) -> Response:
        """``serve`` the tenant's stored response the path names; a refusal in the OpenAI shape."""
        response_id = request.path_params["response_id"]
        try:
            tenant = await self.authenticator.tenant(request.headers.get("authorization", ""))
            return await serve(request, await self._read(tenant, response_id))
        except StoreUnavailable:
            error: ApiError = LogUnavailable()
        except ApiError as refused:
            error = refused
        return JSONResponse(error.body(response_id), status_code=error.status, headers=id_header(response_id))

    async def _read(self, tenant: str, response_id: str) -> _Stored:
        """The tenant's response, its log and its recorded input, each read once. A deleted
        one is gone (404): with every input kept (``content_policy`` full), a completed
        response with none had its content erased, since its completion waits for its
        input. One that failed without it (the log lost it first) is read as it failed."""
        request_id, events = await response_events(self.ctx.store, tenant, response_id, "response_id")
        recorded = await self.ctx.store.read_input(request_id)
        ended = any(isinstance(e, ENDED) for e in events)
        completed = any(isinstance(e, ev.RequestCompleted) for e in events)
        if completed and recorded is None and self.ctx.config.content_policy == "full":
            raise NotFound(f"response '{response_id}' was deleted", param="response_id", code="response_not_found")
        return _Stored(response_id, request_id, tenant, events, recorded, ended)

    async def _retrieve(self, request: Request, stored: _Stored) -> Response:
        stream, after = _streaming(request)
        shape = shape_of(self.ctx, stored.request_id, stored.events, kept_body(stored.recorded))
        if stream:
            check_resumable(stored.events, responses=True)
            shape.after = after
            path = f"/v1/responses/{stored.response_id}"
            return await stream_from(self.ctx, request, stored.request_id, stored.events, shape, path)
        headers = id_header(stored.request_id)
        if not stored.ended:  # its owner shows its output, and records that it did
            polled = await poll_live(self.ctx, stored.request_id, shape)
            if polled is not None:
                return JSONAnswer(polled, headers=headers)
            forwarded = await at_owner(self.ctx, request, stored.events, f"/v1/responses/{stored.response_id}")
            if forwarded is not None:
                return forwarded
        answer = response_from_log(stored.request_id, stored.events, shape)
        if stored.ended and (shown := shown_deltas(stored.events)):  # a read, recorded (docs/design.md §15)
            await record_resumed(self.ctx, stored.request_id, 0, shown)
        return JSONAnswer(answer, headers=headers)

    async def _cancel(self, request: Request, stored: _Stored) -> Response:
        """Stop a live response at once (as ``POST /v1/requests/{id}/cancel``); the answer
        is the response as the log has it then (``cancelled``, or how it ended before)."""
        events = stored.events
        if not stored.ended:
            stopped = await stop(self.ctx, request, stored.request_id, _owner(events))
            if isinstance(stopped, httpx.Response) and stopped.status_code != 200:
                return Response(stopped.content, status_code=stopped.status_code, media_type="application/json")
            events = await ended(self.ctx, stored.request_id, events)
        shape = shape_of(self.ctx, stored.request_id, events, kept_body(stored.recorded))
        return JSONAnswer(response_from_log(stored.request_id, events, shape), headers=id_header(stored.request_id))

    async def _input_items(self, request: Request, stored: _Stored) -> Response:
        order, limit, after = _paging(request)
        items = input_items(body_of(stored.recorded, stored.response_id, "response_id")["input"], stored.response_id)
        if order == "desc":
            items.reverse()
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else 0
        page = items[start : start + limit]
        listed = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }
        return JSONAnswer(listed, headers=id_header(stored.request_id))

    async def _delete(self, request: Request, stored: _Stored) -> Response:
        """Erase the response's content as ``phasegate tenants erase`` does; its events stay."""
        if not stored.ended:
            raise InvalidRequest(
                f"response '{stored.response_id}' is in progress: cancel it first", code="response_in_progress"
            )
        await self.ctx.store.erase_request(stored.tenant, stored.request_id)
        log.info("request %s: its content was erased (DELETE of its response)", stored.request_id)
        deleted = {"id": stored.response_id, "object": "response.deleted", "deleted": True}
        return JSONResponse(deleted, headers=id_header(stored.request_id))


@dataclass(frozen=True, slots=True)
class _Stored:
    """A stored response as the log has it."""

    response_id: str
    request_id: str
    tenant: str
    events: list[ev.Event]
    recorded: RequestInput | None  # the client's body, as the content policy kept it
    ended: bool


def _owner(events: list[ev.Event]) -> str | None:
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    return accepted.gateway


def input_items(given: Any, response_id: str) -> list[dict[str, Any]]:
    """The response's input as items, each with an id (its own where the client gave one)."""
    items: list[dict[str, Any]] = (
        [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)
    )
    listed = []
    for n, given_item in enumerate(items):
        item = dict(given_item)
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", f"in_{response_id.removeprefix('resp_')}_{n}")
        listed.append(item)
    return listed


def _streaming(request: Request) -> tuple[bool, int]:
    """``?stream=true`` and ``starting_after`` (the last event the reader has; -1: none)."""
    stream = request.query_params.get("stream", "false")
    if stream not in ("true", "false"):
        raise InvalidRequest("'stream' must be true or false", param="stream")
    raw = request.query_params.get("starting_after")
    if raw is None:
        return stream == "true", -1
    if stream != "true":
        raise InvalidRequest("'starting_after' is only allowed with stream=true", param="starting_after")
    try:
        return True, parse_integer(raw, "'starting_after' (an event's sequence_number)", maximum=(1 << 31) - 1)
    except IntegerRefused as exc:
        raise InvalidRequest(str(exc), param="starting_after") from None


def _paging(request: Request) -> tuple[str, int, str | None]:
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc", param="order")
    raw = request.query_params.get("limit", "20")
    try:
        limit = parse_integer(raw, "'limit'", minimum=1, maximum=MAX_ITEMS)
    except IntegerRefused as exc:
        raise InvalidRequest(str(exc), param="limit") from None
    return order, limit, request.query_params.get("after")
