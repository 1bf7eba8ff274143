"""Resuming a stream from the log (docs/design.md §12): ``GET /v1/requests/{id}/stream``.

A client that lost its stream asks again with ``Last-Event-ID: k`` (what an SSE client
library sends on reconnect) or ``?after=k``, as the tenant that made the request. A chat
stream's SSE event ids are delta indexes, and ``DeltasDelivered`` records each delta's
choice, length and tokens, so the log alone rebuilds deltas ``k+1…`` exactly once, with
their ids, and then the end: the finish (and ``[DONE]``) or the final error the request
ended with; a message's events are numbered, and it is sent the events after ``k``
(docs/design.md §17). Any instance serves any request: attached to its live loop here
within its grace, at its owner while it is live elsewhere, else followed in the log
(app/api/resume/attach.py, app/api/resume/follow.py).

Under ``content_policy`` ``digest`` or ``none`` the log has no text: 409
``resume_unavailable``, carrying the recorded outcome.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.chat.log import shape_from_log
from app.api.errors import ApiError, NotFound
from app.api.messages import log as messages_log
from app.api.request_ids import check_request_id, id_header
from app.api.resume.attach import after_of, stream_from
from app.api.resume.follow import Follower
from app.api.resume.log import check_resumable
from app.api.shape import Shape
from app.driver.context import GatewayContext
from app.driver.request import MESSAGES
from app.telemetry.logs import bind_request
from statemachine import events as ev

log = logging.getLogger("phasegate.api")


def resume_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    return [Route("/v1/requests/{request_id}/stream", _Resume(ctx, authenticator).stream, methods=["GET"])]


class _Resume:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator
        self.follower = Follower(ctx)

    async def stream(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        headers = id_header(request_id)
        try:
            tenant = await self.authenticator.tenant(request.headers.get("authorization", ""))
            check_request_id(request_id)
            after = after_of(request)
            events = await self.follower.read(request_id)
            accepted = events[0] if events else None
            if not isinstance(accepted, ev.RequestAccepted) or accepted.tenant != tenant:
                raise NotFound(f"no request '{request_id}'", code="request_not_found")  # nor another tenant's
            bind_request(request_id)  # a request of the log: this task's lines (and its stream's) are about it
            check_resumable(events)
        except ApiError as error:
            return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)
        shape: Shape
        if accepted.endpoint == MESSAGES:  # its events are numbered, not its deltas (docs/design.md §17)
            shape = messages_log.shape_from_log(request_id, events)
        else:
            log.info("request %s: its stream resumes from delta %d", request_id, after + 1)
            shape = shape_from_log(request_id, events)
        shape.after = after
        return await stream_from(self.ctx, request, request_id, events, shape, f"/v1/requests/{request_id}/stream")
