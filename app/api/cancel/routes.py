"""``POST /v1/requests/{id}/cancel``: a stop button (docs/design.md §12).

The request's tenant ends it at once: recorded as ``RequestCancelled`` (reason
``cancelled_by_client``), its attempt cancelled as bookkeeping, and a client still
reading its stream gets the final error ``request_cancelled``. Only the instance that
owns a live request may append to it, so another instance forwards the call to the
owner's address (``gateway_instances.address``). An ended request is left as it is:
the answer says how it ended.
"""

from __future__ import annotations

import logging

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.errors import ApiError, LogUnavailable, NotFound, ServiceUnavailable
from app.api.owner import FORWARD_TIMEOUT_S, owner_address
from app.api.request_ids import check_request_id, id_header
from app.driver.context import GatewayContext
from app.store.errors import StoreUnavailable
from app.telemetry.logs import bind_request
from statemachine import events as ev
from statemachine.state import fold

log = logging.getLogger("phasegate.api")


def cancel_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    return [Route("/v1/requests/{request_id}/cancel", _Cancel(ctx, authenticator).cancel, methods=["POST"])]


class _Cancel:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        headers = id_header(request_id)
        try:
            tenant = await self.authenticator.tenant(request.headers.get("authorization", ""))
            check_request_id(request_id)
            try:
                events = await self.ctx.store.read(request_id)
            except StoreUnavailable:
                raise LogUnavailable() from None
            accepted = events[0] if events else None
            if not isinstance(accepted, ev.RequestAccepted) or accepted.tenant != tenant:
                raise NotFound(f"no request '{request_id}'", code="request_not_found")
            bind_request(request_id)  # a request of the log: this task's lines are about it
            state = fold(events)
            if state.outcome is not None:
                log.info("request %s: a cancel came after it ended (%s)", request_id, state.outcome.value)
                return JSONResponse(_answer(request_id, "ended", state.outcome.value), headers=headers)
            stopped = await stop(self.ctx, request, request_id, accepted.gateway)
            if isinstance(stopped, httpx.Response):  # the owner's answer
                return Response(
                    stopped.content, status_code=stopped.status_code, headers=headers, media_type="application/json"
                )
            if not stopped:  # it ended here between the read and the cancel
                log.info("request %s: a cancel came as it ended", request_id)
                return JSONResponse(_answer(request_id, "ended", "ended"), headers=headers)
            return JSONResponse(_answer(request_id, "cancelled", "cancelled"), headers=headers)
        except ApiError as error:
            return JSONResponse(error.body(request_id), status_code=error.status, headers=headers)


async def stop(ctx: GatewayContext, request: Request, request_id: str, owner: str | None) -> bool | httpx.Response:
    """Cancel the live request: at once where this instance owns it (``True``; ``False``
    if it ended here meanwhile), else at its owner, which alone appends to it (the
    owner's answer)."""
    driver = ctx.drivers.get(request_id)
    if driver is not None:
        log.info("request %s: cancelled by its client", request_id)
        driver.cancel_now()
        return True
    if owner == ctx.gateway_id:
        return False
    address = await owner_address(ctx, owner)
    if address is None:
        # no live owner: it is being swept (gateway_lost) or it just ended
        raise ServiceUnavailable("the request's gateway is not reachable; it ends shortly", code="owner_unavailable")
    forwarded = {"authorization": request.headers.get("authorization", "")}
    try:
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S) as http:
            return await http.post(f"{address}/v1/requests/{request_id}/cancel", headers=forwarded)
    except httpx.HTTPError as exc:
        log.warning("request %s: forwarding the cancel to %s failed: %r", request_id, address, exc)
        raise ServiceUnavailable("the request's gateway did not answer", code="owner_unavailable") from None


def _answer(request_id: str, status: str, outcome: str) -> dict[str, str]:
    return {"object": "request.cancel", "id": request_id, "status": status, "outcome": outcome}
