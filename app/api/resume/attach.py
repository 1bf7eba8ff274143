"""A reader back for a request it started (docs/design.md §12, §15): attached to the live
loop here, passed on to its owner while it is live on another instance, else followed in
the log; the one way in for every API.

A client that left a request live on this instance, within its grace
(``resume_grace_s``), attaches to its loop (:func:`attach_live`): the deltas after the
one it names, those produced while nobody was attached first, then the live tail, from
memory; it becomes the request's one attached client. A live request of another instance
is resumed there: the call is forwarded to the owner's address
(``gateway_instances.address``), which alone may attach a client and append. A request
that ended is served from the log by any instance (app/api/resume/follow.py).

A POST whose ``Idempotency-Key`` another POST of the same body already used attaches to
that request the same way (:func:`attach`): to the live loop as above, or from the log
(from ``Last-Event-ID`` if it sends one), a whole answer once the request ended.
"""

from __future__ import annotations

import asyncio

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.api.answers import failure_response, shape_for, stream_body, unless_client_leaves, whole_answer
from app.api.chat.log import shape_from_log, whole_from_log
from app.api.errors import ApiError, InvalidRequest, LogUnavailable, ServiceUnavailable
from app.api.json_answer import JSONAnswer
from app.api.owner import forward_stream, owner_address
from app.api.request_ids import id_header
from app.api.responses.log import kept_body, response_from_log, shape_of
from app.api.resume.follow import FOLLOW_EVERY_S, Follower
from app.api.resume.log import check_resumable
from app.api.shape import Shape
from app.api.token_stream import TokenStreamResponse, client_gone
from app.contract.integers import IntegerRefused, parse_integer
from app.driver.context import GatewayContext
from app.driver.driver import RequestDriver
from app.driver.feed import AttachedClient
from app.driver.outputs import Delta, Failed, Output, Restarted
from app.driver.request import GenerationRequest
from app.http.cycle import CHUNK_WRITER
from app.store.errors import StoreUnavailable
from app.telemetry.logs import bind_request
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.state import fold

HANDOVER_WAIT_S = 3.0  # how long a resume waits for the instance to see its old connection gone
ATTACH_WAIT_S = 10.0  # how long an attaching POST waits for the request it names to reach the log
MAX_EVENT_ID = 1 << 31


async def stream_from(
    ctx: GatewayContext, request: Request, request_id: str, events: list[ev.Event], shape: Shape, path: str
) -> Response:
    """The request's stream after its reader's event (``shape.after``): attached to its
    live loop here, passed through from its owner (``GET path``) while live elsewhere,
    else followed in the log."""
    if shape.numbered:  # read from its first delta; the events up to the reader's left out
        live = await attach_live(ctx, request_id, request, -1, stream=True, events_after=shape.after)
    else:
        live = await attach_live(ctx, request_id, request, shape.after, stream=True)
    return live or await elsewhere(ctx, request, request_id, events, shape, path)


async def elsewhere(
    ctx: GatewayContext, request: Request, request_id: str, events: list[ev.Event], shape: Shape, path: str
) -> Response:
    """A stream not attached here: from its owner while it is live there, else from the log."""
    forwarded = await at_owner(ctx, request, events, path)
    if forwarded is not None:
        return forwarded
    body = Follower(ctx).follow(request_id, events, shape)
    return EventSourceResponse(body, headers=id_header(request_id), ping=15, send_timeout=30, sep="\n")


async def attach(ctx: GatewayContext, request_id: str, request: Request, generation: GenerationRequest) -> Response:
    """Answer a POST whose ``Idempotency-Key`` started ``request_id`` (the same POST again),
    from its log: a response's as the Responses API reads it again (:func:`_attach_response`)."""
    if generation.responses is not None:
        return await _attach_response(ctx, request_id, request, stream=generation.stream)
    bind_request(request_id)  # the POST is about the request its key started, not a new one
    headers = {"x-request-id": request_id}
    try:
        after = after_of(request)
        live = await attach_live(ctx, request_id, request, after, stream=generation.stream)
        if live is not None:
            return live
        events = await logged(ctx, request_id)
        check_resumable(events)
    except ApiError as error:
        return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
    shape = shape_from_log(request_id, events)
    if generation.stream:
        shape.after = after
        return await elsewhere(ctx, request, request_id, events, shape, f"/v1/requests/{request_id}/stream")
    return whole_from_log(request_id, await ended(ctx, request_id, events), shape, headers)


async def _attach_response(ctx: GatewayContext, request_id: str, request: Request, *, stream: bool) -> Response:
    """A response's: its stream from the start (attached where it waits for a reader), a
    background one at once as it stands, or, whole, once it ended."""
    headers = id_header(request_id)
    try:
        events = await logged(ctx, request_id)
        shape = shape_of(ctx, request_id, events, kept_body(await ctx.store.read_input(request_id)))
        check_resumable(events, responses=True)  # the log keeps its text (content_policy)
        if stream:
            return await stream_from(ctx, request, request_id, events, shape, f"/v1/responses/{shape.response_id}")
        accepted = events[0]
        if isinstance(accepted, ev.RequestAccepted) and accepted.background:
            return JSONAnswer(response_from_log(request_id, events, shape), headers=headers)
        events = await ended(ctx, request_id, events)
        return JSONAnswer(response_from_log(request_id, events, shape), headers=headers)
    except StoreUnavailable:
        return _refused(LogUnavailable(), request_id, headers)
    except ApiError as refused:
        return _refused(refused, request_id, headers)


def _refused(error: ApiError, request_id: str, headers: dict[str, str]) -> Response:
    return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)


async def logged(ctx: GatewayContext, request_id: str) -> list[ev.Event]:
    """The log of the request an ``Idempotency-Key`` started: its first POST may still be
    being accepted (up to ``ATTACH_WAIT_S``)."""
    follower = Follower(ctx)
    waited = 0.0
    while not (events := await follower.read(request_id)) and waited < ATTACH_WAIT_S:
        await asyncio.sleep(FOLLOW_EVERY_S)
        waited += FOLLOW_EVERY_S
    if not events:
        raise ServiceUnavailable("the request this idempotency key started is not in the log yet; retry")
    return events


async def ended(ctx: GatewayContext, request_id: str, events: list[ev.Event]) -> list[ev.Event]:
    """The request's log once it ended (a whole answer goes out then), read on from ``events``."""
    follower = Follower(ctx)
    while fold(events).outcome is None:
        await asyncio.sleep(FOLLOW_EVERY_S)
        events = await follower.read(request_id)
    return events


async def attach_live(
    ctx: GatewayContext, request_id: str, request: Request, after: int, *, stream: bool, events_after: int = -1
) -> Response | None:
    """Attach to the request's live loop on this instance, if it waits for a client
    within its grace (docs/design.md §12) or is a background response (§15); ``None`` when it
    does not (follow the log). A numbered stream (Responses, Messages) is read from its
    first delta and sent from the event after ``events_after``."""
    driver = ctx.drivers.get(request_id)
    if not isinstance(driver, RequestDriver):
        return None
    client = await _attachment(driver, after)
    if client is None:
        return None
    headers = {"x-request-id": request_id}
    if not stream:  # a whole answer: it goes out once the request ended
        whole = await unless_client_leaves(request, driver, _whole(driver, client))
        if whole is None:
            return Response(status_code=499, headers=headers)
        if isinstance(whole, Failed):
            return failure_response(request_id, whole, headers)
        if isinstance(whole, JSONResponse):
            whole.headers.update(headers)
            return whole
        raise RuntimeError(f"request {request_id}: a whole answer ended in {whole!r}")  # pragma: no cover
    first = await unless_client_leaves(request, driver, _first(driver, client))
    if first is None:
        return Response(status_code=499, headers=headers)
    start = client.cursor - 1 if isinstance(first, Delta) else client.cursor
    shape = shape_for(driver.request, request_id, driver.created, driver.answered_by)
    shape.after = events_after  # (a numbered stream's: a chat stream goes from delta ``start``)
    for had in driver.feed.deltas[:start]:  # the deltas the reader had: later chunks count them
        shape.passed("" if had.key == TOOL_CALLS else had.text, had.choice, had.tokens, had.prompt_tokens)
    gone = client_gone(request.scope, request.receive)
    body = stream_body(driver, shape, first, gone, lambda tokens: None, start, request.scope.get(CHUNK_WRITER))
    return TokenStreamResponse(body, headers=headers)


async def _attachment(driver: RequestDriver, after: int) -> AttachedClient | None:
    """The resumer attached to the live request, waiting up to ``HANDOVER_WAIT_S`` for
    the instance to see the client's previous connection drop: a client that reconnects
    at once can be here before its old connection's end is. Followed from the log
    instead, it would have the deltas, but the request would wait out its grace for a
    client that never attaches, and be cancelled under it. A second reader that is not a
    reconnect (the first connection stays) follows the log after the wait."""
    waited = 0.0
    while (client := driver.attach(after)) is None and _may_attach_soon(driver) and waited < HANDOVER_WAIT_S:
        await asyncio.sleep(FOLLOW_EVERY_S)
        waited += FOLLOW_EVERY_S
    return client


def _may_attach_soon(driver: RequestDriver) -> bool:
    """The instance has yet to see the client's old connection drop, or a background
    response with no reader is between attempts (its first not placed yet)."""
    state = driver.state
    return driver.serves_a_client() or (state.background and state.client_gone and state.outcome is None)


async def at_owner(ctx: GatewayContext, request: Request, events: list[ev.Event], path: str) -> Response | None:
    """A live request of another instance: its stream (``GET path``) from there, which
    alone may attach a client to it and append to its log; ``None`` for one that ended
    or has no live owner."""
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    if fold(events).outcome is not None:
        return None
    address = await owner_address(ctx, accepted.gateway)
    return None if address is None else await forward_stream(request, address, path)


async def _first(driver: RequestDriver, client: AttachedClient) -> Output:
    """The resumed client's first output; its first delta is the commit point if no
    client received one before."""
    async for output in client:
        if isinstance(output, Restarted):
            continue
        if isinstance(output, Delta) and not driver.state.first_delta_sent:
            if driver.run is None:
                continue  # its attempt just failed, before any delivery: a retry restarts
            await driver.commit()
        return output
    raise RuntimeError(f"request {driver.request_id} ended with no outcome")  # pragma: no cover


async def _whole(driver: RequestDriver, client: AttachedClient) -> Output | JSONResponse:
    return await whole_answer(driver, await anext(client))


def after_of(request: Request) -> int:
    """The last event the client has: ``Last-Event-ID`` or ``?after``; -1 for none."""
    raw = request.headers.get("last-event-id")
    param = "Last-Event-ID"
    if raw is None:
        raw, param = request.query_params.get("after"), "after"
    if raw is None or raw == "":
        return -1
    try:
        return parse_integer(raw, f"'{param}' (a delta index)", maximum=MAX_EVENT_ID - 1)
    except IntegerRefused as exc:
        raise InvalidRequest(str(exc), param=param) from None
