"""A live request's owner (docs/design.md §11-12): only the instance that accepted it appends
to it, so a call about it that reaches another instance is passed on to the owner's
address (``gateway_instances.address``). ``owner_address`` finds it; ``forward_stream``
passes a resumed stream through, bytes as they come.
"""

from __future__ import annotations

import logging

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from app.driver.context import GatewayContext
from app.store.errors import StoreError
from app.store.instances import InstanceRegistry
from app.store.postgres import PostgresEventStore

log = logging.getLogger("phasegate.api")

FORWARD_TIMEOUT_S = 10.0  # to connect and for the owner's first bytes; a stream then runs on
FORWARDED_HEADERS = ("authorization", "last-event-id")


async def owner_address(ctx: GatewayContext, owner: str | None) -> str | None:
    """The address of ``owner`` while its lease holds; ``None`` for this instance, an
    owner that is gone (its requests are swept) or a log without instances."""
    if owner is None or owner == ctx.gateway_id or not isinstance(ctx.store, PostgresEventStore):
        return None
    try:
        rows = await InstanceRegistry(ctx.store).recent(limit=1000)
    except StoreError:
        return None
    address = next((row["address"] for row in rows if row["instance_id"] == owner and row["live"]), None)
    return address if isinstance(address, str) else None


async def forward_stream(request: Request, address: str, path: str) -> Response | None:
    """``GET path`` at the owner (a request's stream, a response's), as this client asked
    it (its ``Last-Event-ID``, its query); ``None`` if the owner does not answer."""
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    http = httpx.AsyncClient(timeout=httpx.Timeout(FORWARD_TIMEOUT_S, read=None))
    url = f"{address}{path}"
    try:
        answer = await http.send(
            http.build_request("GET", url, params=request.query_params, headers=headers), stream=True
        )
    except httpx.HTTPError as exc:
        log.warning("forwarding %s to %s failed: %r", path, address, exc)
        await http.aclose()
        return None

    async def close() -> None:
        await answer.aclose()
        await http.aclose()

    kept = {name: answer.headers[name] for name in ("content-type", "x-request-id") if name in answer.headers}
    return StreamingResponse(
        answer.aiter_raw(), status_code=answer.status_code, headers=kept, background=BackgroundTask(close)
    )
