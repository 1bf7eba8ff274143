"""Resuming a stream from the log (docs/design.md §12): ``GET /v1/requests/{id}/stream``.

How this works: a client that lost its stream asks again with ``Last-Event-ID: k`` (what
an SSE client library sends on reconnect) or ``?after=k``, as the tenant that made the
request. SSE event ids are delta indexes, and ``DeltasDelivered`` records each delta's
choice, length and tokens, so the log alone rebuilds deltas ``k+1…`` exactly once, with
their ids, and then the end: the finish (and ``[DONE]``) or the final error the request
ended with. A request still live is followed in the log: its deliveries reach the log
while it streams (within a delivery batch and a group commit), so the resumer reads on
until the terminal event, with no seam between the log and a live tail to get wrong,
and it never appends to a live request, which only its owner does. Any instance
serves any request. Once the end was sent, the instance records what it sent as
``StreamResumed``, bookkeeping after the terminal event (expected-version guarded).

A client that left a request live on this instance, within its grace
(``resume_grace_s``), attaches to its loop instead (:func:`attach_live`): the deltas
after the one it names, those produced while nobody was attached first, then the live
tail, from memory; it becomes the request's one attached client. A live request of
another instance is resumed there: the call is forwarded to the owner's address
(``gateway_instances.address``), which alone may attach a client and append. A request
that ended is served from the log by any instance, the deltas produced while no client
was attached included (docs/design.md §12).

A POST whose ``Idempotency-Key`` another POST of the same body already used attaches
to that request the same way (:func:`attach`): to the live loop as above, or from the
log (from ``Last-Event-ID`` if it sends one), a whole answer once the request ended.

Under ``content_policy`` ``digest`` or ``none`` the log has no text: 409
``resume_unavailable``, carrying the recorded outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.answers import failure_response, stream_body, unless_client_leaves, whole_answer
from app.api.auth import Authenticator
from app.api.chat.shape import ResponseShape
from app.api.errors import ApiError, InvalidRequest, NotFound, ServiceUnavailable
from app.api.messages.shape import MessagesShape
from app.api.owner import forward_stream, owner_address
from app.api.request_ids import check_request_id, id_header
from app.api.responses.shape import ResponsesShape, shape_for
from app.api.resume.log import (
    LoggedDelta,
    check_resumable,
    delta_event,
    deltas_of,
    ending,
    produced_tail,
    shape_from_log,
    whole_from_log,
)
from app.api.token_stream import TokenStreamResponse, client_gone
from app.contract.integers import IntegerRefused, parse_integer
from app.driver.context import GatewayContext
from app.driver.driver import RequestDriver
from app.driver.feed import AttachedClient
from app.driver.outputs import Delta, Failed, Output, Restarted
from app.driver.request import MESSAGES
from app.http_cycle import CHUNK_WRITER
from app.logs import bind_request
from app.store.errors import StoreError, StoreUnavailable, StreamConflict
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.request_state import RequestState
from statemachine.state import advance, fold

log = logging.getLogger("phasegate.api")

FOLLOW_EVERY_S = 0.02  # how often a live request's log is read again
HANDOVER_WAIT_S = 3.0  # how long a resume waits for the instance to see its old connection gone
ATTACH_WAIT_S = 10.0  # how long an attaching POST waits for the request it names to reach the log
MAX_EVENT_ID = 1 << 31


def resume_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    return [Route("/v1/requests/{request_id}/stream", _Resume(ctx, authenticator).stream, methods=["GET"])]


class _Resume:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.follower = _Follower(ctx)

    async def stream(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        headers = id_header(request_id)
        try:
            tenant = await self.authenticator.tenant(request.headers.get("authorization", ""))
            check_request_id(request_id)
            after = _after(request)
            events = await self.follower.read(request_id)
            accepted = events[0] if events else None
            if not isinstance(accepted, ev.RequestAccepted) or accepted.tenant != tenant:
                raise NotFound(f"no request '{request_id}'", code="request_not_found")  # nor another tenant's
            bind_request(request_id)  # a request of the log: this task's lines (and its stream's) are about it
            check_resumable(events)
        except ApiError as error:
            return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
        if accepted.endpoint == MESSAGES:  # its events are numbered, not its deltas (docs/design.md §17)
            from app.api.messages.routes import resume_message  # (it follows the log as this module does)

            return await resume_message(self.ctx, request, request_id, events, after)
        log.info("request %s: its stream resumes from delta %d", request_id, after + 1)
        live = await attach_live(self.ctx, request_id, request, after, stream=True)
        if live is None:
            live = await at_owner(self.ctx, request, events, f"/v1/requests/{request_id}/stream")
        if live is not None:
            return live
        shape = shape_from_log(request_id, events)
        return EventSourceResponse(
            self.follower.follow(request_id, events, after, shape), headers=headers, ping=15, send_timeout=30, sep="\n"
        )


class _Follower:
    """Reads a request's log, and follows it to its end."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def read(self, request_id: str) -> list[ev.Event]:
        try:
            return await self.ctx.store.read(request_id)
        except StoreUnavailable:
            raise ServiceUnavailable(
                "the request log is unavailable; retry shortly", code="event_log_unavailable"
            ) from None

    async def follow(
        self, request_id: str, events: list[ev.Event], after: int, shape: ResponseShape
    ) -> AsyncIterator[bytes]:
        """Deltas after ``after`` from the log, reading on while the request is live."""
        position = after + 1  # the next delta index to send
        seen = 0  # events of the log taken into account
        if position == 0:
            shape.from_the_start()  # each chat choice's first delta after its role

        def sent(delta: LoggedDelta) -> bytes:
            return shape.opening(delta.choice, delta.prompt) + delta_event(shape, delta)

        while True:
            for event in events[seen:]:
                seen = event.seq
                if isinstance(event, ev.DeltasDelivered):
                    for delta in deltas_of(event):
                        if delta.index >= position:
                            yield sent(delta)
                            position = delta.index + 1
                        elif delta.key != TOOL_CALLS:
                            shape.passed(delta.text, delta.choice)  # where the next tokens start in its text
                elif isinstance(event, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled):
                    state = fold(events[:seen])
                    # then what the last attempt produced with no client attached (docs/design.md §12)
                    for delta in produced_tail(events[:seen], state):
                        if delta.index >= position:
                            yield sent(delta)
                            position = delta.index + 1
                    for chunk in ending(shape, request_id, events[:seen], state):
                        yield chunk
                    await record_resumed(self.ctx, request_id, after + 1, max(position, after + 1))
                    return
            await asyncio.sleep(FOLLOW_EVERY_S)
            try:
                events = await self.ctx.store.read(request_id)
            except StoreUnavailable:
                continue  # the log is away: the follower waits for it


def shown_tokens(events: list[ev.Event], state: RequestState, to_index: int) -> int:
    """The output tokens of deltas ``[0, to_index)``: those delivered live, then those of the
    produced tail a reader of the ended request gets (0 where it had fewer than the live
    deliveries: the count stands at those)."""
    if to_index < state.delivered_deltas:
        return 0
    delivered = sum(e.tokens for e in events if isinstance(e, ev.DeltasDelivered))
    return delivered + sum(d.tokens for d in produced_tail(events, state) if d.index < to_index)


async def record_resumed(ctx: GatewayContext, request_id: str, from_index: int, to_index: int) -> None:
    """``StreamResumed`` after the terminal event: what a read from the log sent."""
    for _ in range(3):  # another resumer, or the owner's late bookkeeping, may append first
        try:
            events = await ctx.store.read(request_id)
            state = fold(events)
            to_index = min(to_index, max(state.delivered_deltas, state.produced_deltas))
            _, resumed = advance(  # stamped no earlier than the log's last event, whatever our clock says
                state,
                ev.StreamResumed,
                ctx.wall_clock(),
                from_index=min(from_index, to_index),
                to_index=to_index,
                gateway=ctx.gateway_id,
                tokens=shown_tokens(events, state, to_index),
            )
            await ctx.store.append(request_id, state.seq, [resumed], durable=True)
            log.debug("request %s: resumed deltas %d..%d sent", request_id, resumed.from_index, to_index - 1)
            return
        except StreamConflict:
            continue
        except StoreError as exc:
            log.warning("request %s: the resume was not recorded: %s", request_id, exc)
            return


async def attach(ctx: GatewayContext, request_id: str, request: Request, *, stream: bool) -> Response:
    """Answer a POST whose ``Idempotency-Key`` started ``request_id``, from its log."""
    bind_request(request_id)  # the POST is about the request its key started, not a new one
    headers = {"x-request-id": request_id}
    follower = _Follower(ctx)
    try:
        after = _after(request)
        live = await attach_live(ctx, request_id, request, after, stream=stream)
        if live is not None:
            return live
        events = await logged(ctx, request_id)
        check_resumable(events)
    except ApiError as error:
        return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
    if stream:
        forwarded = await at_owner(ctx, request, events, f"/v1/requests/{request_id}/stream")
        if forwarded is not None:
            return forwarded
    shape = shape_from_log(request_id, events)
    if stream:
        body = follower.follow(request_id, events, after, shape)
        return EventSourceResponse(body, headers=headers, ping=15, send_timeout=30, sep="\n")
    return whole_from_log(request_id, await ended(ctx, request_id, events), shape, headers)


async def logged(ctx: GatewayContext, request_id: str) -> list[ev.Event]:
    """The log of the request an ``Idempotency-Key`` started: its first POST may still be
    being accepted (up to ``ATTACH_WAIT_S``)."""
    follower = _Follower(ctx)
    waited = 0.0
    while not (events := await follower.read(request_id)) and waited < ATTACH_WAIT_S:
        await asyncio.sleep(FOLLOW_EVERY_S)
        waited += FOLLOW_EVERY_S
    if not events:
        raise ServiceUnavailable("the request this idempotency key started is not in the log yet; retry")
    return events


async def ended(ctx: GatewayContext, request_id: str, events: list[ev.Event]) -> list[ev.Event]:
    """The request's log once it ended (a whole answer goes out then), read on from ``events``."""
    follower = _Follower(ctx)
    while fold(events).outcome is None:
        await asyncio.sleep(FOLLOW_EVERY_S)
        events = await follower.read(request_id)
    return events


async def attach_live(
    ctx: GatewayContext, request_id: str, request: Request, after: int, *, stream: bool, events_after: int = -1
) -> Response | None:
    """Attach to the request's live loop on this instance, if it waits for a client
    within its grace (docs/design.md §12) or is a background response (§15); ``None`` when it
    does not (follow the log). A Responses API stream is read from its first delta and
    sent from the event after ``events_after`` (its ``starting_after``)."""
    driver = ctx.drivers.get(request_id)
    if not isinstance(driver, RequestDriver):
        return None
    client = await _attachment(driver, after)
    if client is None:
        return None
    headers = {"x-request-id": request_id}
    request_shape = driver.request
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
    shape = shape_for(request_shape, request_id, driver.created, driver.answered_by)
    if isinstance(shape, ResponsesShape | MessagesShape):
        shape.after = events_after
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


def _after(request: Request) -> int:
    """The last delta index the client has: ``Last-Event-ID`` or ``?after``; -1 for none."""
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
