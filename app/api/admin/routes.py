"""Admin endpoints for incident responders, behind the admin token.

    GET /v1/requests/{id}                       the request as the read models tell it
    GET /v1/requests/{id}/events?after_seq=&limit=   its events, a page at a time
    GET /ui/requests/{id}                       the timeline page (HTML with an SVG)

Authentication: ``Authorization: Bearer <admin_token>``, or HTTP Basic auth with the
token as the password (any user name), so a browser can open the page: a 401 from
``/ui/`` asks for it with ``WWW-Authenticate: Basic``. The pages under ``/ui/`` also
take the admin token once in the URL, as ``phasegate serve`` prints it (``?token=…``):
the answer is a redirect to the same page without it, setting an HttpOnly,
SameSite=Strict cookie (an HMAC of the token, not the token) that the pages accept
from then on (``/ui/requests`` lists recent requests). The admin token reads every
request; a tenant's API key (in the same places) reads only that tenant's requests,
and another tenant's request is 404 as an unknown one is, so that a key cannot learn
which ids exist. With neither an ``admin_token`` nor API keys configured the
endpoints answer 403 ``admin_disabled``: they exist, but nobody may use them. Errors
have the OpenAI shape of :mod:`app.api.errors`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import date, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from app.api.auth import Authenticator
from app.api.errors import (
    ApiError,
    Forbidden,
    InvalidRequest,
    LogUnavailable,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
    retry_headers,
)
from app.api.request_ids import check_request_id, new_request_id
from app.contract.integers import IntegerRefused, parse_integer
from app.driver.context import GatewayContext
from app.store import queries
from app.store.errors import StoreUnavailable
from app.ui.fleet_panel import fleet_panel
from app.ui.page import render_page
from app.ui.request_list import BadFilter, RequestFilter, recent_requests, render_requests_page
from statemachine.events import Event, RequestAccepted
from statemachine.jsonform import to_json

log = logging.getLogger("phasegate.admin")

DEFAULT_PAGE = 100
MAX_PAGE = 1000
MAX_SEQ = 2**31 - 1  # events.version is a PostgreSQL integer
UI_COOKIE = "phasegate_admin"

Handler = Callable[[Request, "str | None"], Awaitable[Response]]  # the request, and the tenant it is read for
Guarded = Callable[[Request], Awaitable[Response]]


def admin_routes(ctx: GatewayContext, authenticator: Authenticator) -> list[Route]:
    """The admin routes of the gateway over ``ctx``."""
    admin = _Admin(ctx, authenticator)
    return [
        Route("/v1/requests/{request_id}", admin.guarded(admin.summary), methods=["GET"]),
        Route("/v1/requests/{request_id}/events", admin.guarded(admin.events), methods=["GET"]),
        Route("/ui/requests", admin.guarded(admin.request_list, browser=True), methods=["GET"]),
        Route("/ui/requests/{request_id}", admin.guarded(admin.page, browser=True), methods=["GET"]),
    ]


class _Admin:
    def __init__(self, ctx: GatewayContext, authenticator: Authenticator) -> None:
        self.ctx = ctx
        self.authenticator = authenticator

    def guarded(self, handler: Handler, *, browser: bool = False) -> Guarded:
        """``handler`` behind the admin token or a tenant's key; every ApiError becomes its JSON answer."""

        async def guarded(request: Request) -> Response:
            exchange = new_request_id()  # this HTTP exchange, as every response names one
            try:
                if browser and "token" in request.query_params:
                    return self._hand_over(request, exchange)
                tenant = await self._reader(request, browser=browser)
                check_request_id(request.path_params.get("request_id", ""))
                response = await handler(request, tenant)
            except ApiError as error:
                headers = {"x-request-id": exchange, **retry_headers(error.retryable)}
                if isinstance(error, Unauthorized) and browser:
                    headers["www-authenticate"] = 'Basic realm="phasegate admin", charset="UTF-8"'
                return JSONResponse(error.body(exchange), status_code=error.status, headers=headers)
            except StoreUnavailable as exc:
                log.error("admin read failed: %s", exc)
                unavailable = LogUnavailable()
                return JSONResponse(unavailable.body(exchange), status_code=503, headers={"x-request-id": exchange})
            response.headers["x-request-id"] = exchange
            response.headers["cache-control"] = "no-store"
            return response

        return guarded

    async def _reader(self, request: Request, *, browser: bool = False) -> str | None:
        """Who reads: ``None`` for the admin token (every request), else the key's tenant."""
        token = self.ctx.config.admin_token
        cookie = request.cookies.get(UI_COOKIE) if browser and token else None
        if token and cookie is not None and hmac.compare_digest(cookie.encode(), _cookie_value(token).encode()):
            return None
        keys = await self.authenticator.required()
        if not token and not keys:
            raise Forbidden(
                "the admin endpoints are disabled: set admin_token in the gateway's configuration",
                code="admin_disabled",
            )
        code = "invalid_admin_token" if token else "invalid_api_key"
        offered = _offered_token(request.headers.get("authorization", ""))
        if offered is None:
            raise Unauthorized("missing admin token or API key: send 'Authorization: Bearer <token>'", code=code)
        if token and hmac.compare_digest(offered.encode(), token.encode()):
            return None
        tenant = await self.authenticator.tenant_of_key(offered) if keys else None
        if tenant is None:
            raise Unauthorized("incorrect admin token or API key", code=code)
        return tenant

    def _hand_over(self, request: Request, exchange: str) -> Response:
        """``?token=`` once: the same page without it, and a cookie that stands for it."""
        token = self.ctx.config.admin_token
        if not token:
            raise Forbidden(
                "the admin endpoints are disabled: set admin_token in the gateway's configuration",
                code="admin_disabled",
            )
        if not hmac.compare_digest(request.query_params["token"].encode(), token.encode()):
            raise Unauthorized("incorrect admin token", code="invalid_admin_token")
        rest = [(name, value) for name, value in request.query_params.multi_items() if name != "token"]
        target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        response = RedirectResponse(target, status_code=303, headers={"x-request-id": exchange})
        response.set_cookie(
            UI_COOKIE,
            _cookie_value(token),
            path="/ui/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        response.headers["cache-control"] = "no-store"
        response.headers["referrer-policy"] = "no-referrer"  # the token must not leave in a Referer
        return response

    async def request_list(self, request: Request, tenant: str | None) -> Response:
        try:
            wanted = RequestFilter.parse(request.query_params)
        except BadFilter as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None
        if tenant is not None:  # a tenant's key lists its own requests only
            wanted = dataclasses.replace(wanted, tenant=tenant)
        async with self._reading() as connection:
            page = await recent_requests(connection, wanted)
        fleet = await fleet_panel(self.ctx.store) if tenant is None else ""  # the operator's, not a tenant's
        return HTMLResponse(render_requests_page(page, wanted, fleet=fleet))

    async def summary(self, request: Request, tenant: str | None) -> Response:
        request_id = request.path_params["request_id"]
        async with self._reading() as connection:
            found = await queries.request_summary(connection, request_id)
        if found is None or (tenant is not None and found.request.get("tenant") != tenant):
            raise _unknown(request_id)
        return JSONResponse(
            {
                "object": "request",
                "id": request_id,
                "request": _jsonable(found.request),
                "attempts": [_jsonable(attempt) for attempt in found.attempts],
                "trace_id": found.trace_id,
            }
        )

    async def events(self, request: Request, tenant: str | None) -> Response:
        request_id = request.path_params["request_id"]
        after_seq = _integer(request, "after_seq", 0, minimum=0, maximum=MAX_SEQ)
        limit = _integer(request, "limit", DEFAULT_PAGE, minimum=1, maximum=MAX_PAGE)
        async with self._reading() as connection:
            if tenant is not None and await queries.request_tenant(connection, request_id) != tenant:
                raise _unknown(request_id)
            page = await queries.events_page(connection, request_id, after_seq=after_seq, limit=limit + 1)
            if not page and not await queries.known_requests(connection, [request_id]):
                raise _unknown(request_id)
        has_more = len(page) > limit
        page = page[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": [to_json(event) for event in page],
                "has_more": has_more,
                "next_after_seq": page[-1].seq if has_more else None,
            }
        )

    async def page(self, request: Request, tenant: str | None) -> Response:
        request_id = request.path_params["request_id"]
        events = await self.ctx.store.read(request_id)
        if not events or (tenant is not None and not _tenants(events[0], tenant)):
            raise _unknown(request_id)
        return HTMLResponse(render_page(events))

    def _reading(self) -> Any:
        reading = getattr(self.ctx.store, "reading", None)
        if reading is None:
            raise ServiceUnavailable("the read models need the PostgreSQL log", code="read_models_unavailable")
        return reading()


def _offered_token(authorization: str) -> str | None:
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer" and credentials:
        return credentials
    if scheme.lower() == "basic" and credentials:
        try:
            _user, _, password = base64.b64decode(credentials, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or None
    return None


def _cookie_value(token: str) -> str:
    """What the UI cookie holds: derived from the token, so the cookie is not the token itself."""
    return hmac.new(token.encode(), b"phasegate ui cookie", hashlib.sha256).hexdigest()


def _integer(request: Request, name: str, default: int, *, minimum: int, maximum: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return parse_integer(text, name, minimum=minimum, maximum=maximum)
    except IntegerRefused as exc:
        raise InvalidRequest(str(exc), param=name) from None


def _tenants(first: Event, tenant: str) -> bool:
    return isinstance(first, RequestAccepted) and first.tenant == tenant


def _unknown(request_id: str) -> NotFound:
    return NotFound(f"no request {request_id} in the log", param="request_id", code="request_not_found")


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """A read model's row as JSON values: times and days (``accepted_on``, the partition key) in ISO form."""
    return {key: value.isoformat() if isinstance(value, datetime | date) else value for key, value in row.items()}
