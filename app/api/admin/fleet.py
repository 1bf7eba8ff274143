"""The fleet's admin routes, behind the admin token (docs/design.md §16).

    GET    /admin/replicas                   every replica: its declaration, state, source, since,
                                             its live attempts across the fleet (from the log),
                                             and the latest fleet events
    POST   /admin/replicas                   add one: {"id", "url", "kind", "models"}
    POST   /admin/replicas/{id}/cordon       no new attempt; {"drain_s": N}: live ones fenced after N s
    POST   /admin/replicas/{id}/uncordon     takes new attempts again
    DELETE /admin/replicas/{id}?drain_s=N    cordon, then leave once its attempts end (or N s)

Only the admin token opens them (a tenant's API key does not): 401 without it, 403
``admin_disabled`` where none is configured. A body that cannot be used (an unknown
kind, a URL that does not answer or answers as something else, a model the gateway does
not serve) is a 4xx with a stable code, and changes nothing. Removing a replica that a
declared source still lists is 409 ``replica_declared``: change the source, or cordon it.
Every change is a fleet event whose actor is ``admin``; the keeper of every gateway
process applies it within a second (app/driver/fleet.py).
"""

from __future__ import annotations

import hmac
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.bodies import json_body
from app.api.errors import (
    ApiError,
    Forbidden,
    InvalidRequest,
    LogUnavailable,
    NotFound,
    Unauthorized,
)
from app.api.request_ids import new_request_id
from app.config import REPLICA_KINDS, ConfigError, ReplicaConfig, replica_entry
from app.driver.context import GatewayContext
from app.driver.fleet import FleetKeeper, declared_by_file
from app.store.errors import InstanceFenced, StoreUnavailable
from app.store.fleet_model import DECLARED_SOURCES, Member, Written

log = logging.getLogger("phasegate.admin")

ACTOR = "admin"
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
URL = re.compile(r"https?://[A-Za-z0-9._~%:@\[\]-]+(/[!-~]*)?")  # printable ASCII: no NUL, no space
NAME = re.compile(r"[^\x00-\x20\x7f=][^\x00-\x1f\x7f]{0,255}")  # a model's name or revision
MAX_DRAIN_S = 86400.0
PROBE_S = 5.0  # how long an added replica has to answer its probe

Handler = Callable[[Request], Awaitable[Response]]


async def fleet_exchange(what: str, answer: Callable[[], Awaitable[Response]]) -> Response:
    """One exchange with the fleet's routes (the admin API's, a worker's join): ``answer``'s
    response under a request id of its own, a refusal in the OpenAI shape, or 503 while the
    fleet's store is away or this instance is fenced (logged as ``what``'s)."""
    exchange = new_request_id()
    try:
        response = await answer()
    except ApiError as error:
        return JSONResponse(error.body(exchange), status_code=error.status, headers={"x-request-id": exchange})
    except (StoreUnavailable, InstanceFenced) as exc:
        log.error("%s: %s", what, exc)
        unavailable = LogUnavailable("the fleet's store")
        return JSONResponse(unavailable.body(exchange), status_code=503, headers={"x-request-id": exchange})
    response.headers["x-request-id"] = exchange
    return response


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"
    retryable = False


class Unprocessable(InvalidRequest):
    status = 422


def fleet_routes(ctx: GatewayContext, keeper: FleetKeeper) -> list[Route]:
    admin = _FleetAdmin(ctx, keeper)
    return [
        Route("/admin/replicas", admin.guarded(admin.list), methods=["GET"]),
        Route("/admin/replicas", admin.guarded(admin.add), methods=["POST"]),
        Route("/admin/replicas/{replica_id}/cordon", admin.guarded(admin.cordon), methods=["POST"]),
        Route("/admin/replicas/{replica_id}/uncordon", admin.guarded(admin.uncordon), methods=["POST"]),
        Route("/admin/replicas/{replica_id}", admin.guarded(admin.remove), methods=["DELETE"]),
    ]


class _FleetAdmin:
    def __init__(self, ctx: GatewayContext, keeper: FleetKeeper) -> None:
        self.ctx = ctx
        self.keeper = keeper
        self.fleet = keeper.fleet

    def guarded(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            async def answer() -> Response:
                self._authorize(request)
                response = await handler(request)
                response.headers["cache-control"] = "no-store"
                return response

            return await fleet_exchange("fleet admin", answer)

        return guarded

    def _authorize(self, request: Request) -> None:
        token = self.ctx.config.admin_token
        if not token:
            raise Forbidden(
                "the admin endpoints are disabled: set admin_token in the gateway's configuration",
                code="admin_disabled",
            )
        scheme, _, offered = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not offered.strip():
            raise Unauthorized("missing admin token: send 'Authorization: Bearer <token>'", code="invalid_admin_token")
        if not hmac.compare_digest(offered.strip().encode(), token.encode()):
            raise Unauthorized("incorrect admin token", code="invalid_admin_token")

    # --- the routes ----------------------------------------------------------------

    async def list(self, request: Request) -> Response:
        members = await self.fleet.members()
        live = await self.fleet.live_attempts()
        events = await self.fleet.events(limit=50)
        data = [self._described(member, live.get(member.replica_id, 0)) for member in members]
        return JSONResponse({"object": "list", "data": data, "events": events})

    async def add(self, request: Request) -> Response:
        body = await json_body(request, self.ctx.config.max_body_bytes)
        replica = self._declared(body)
        existing = await self.fleet.member(replica.id)
        if existing is not None and existing.member:
            raise Conflict(f"replica {replica.id} is already a member ({existing.state})", code="replica_exists")
        await self._probe(replica)
        (declared,) = declared_by_file([replica])
        await self.fleet.join(
            declared, source="admin", actor=ACTOR, instance_id=self.ctx.gateway_id, reason="added by the admin API"
        )
        return await self._answer(replica.id, status=201)

    async def _admin_change(
        self, replica_id: str, event: str, reason: str, drain_s: float | None = None, leaving: bool = False
    ) -> Written | None:
        """A fleet event written by this API, as its actor, through this instance."""
        return await self.fleet.change(
            replica_id,
            event,
            source="admin",
            actor=ACTOR,
            instance_id=self.ctx.gateway_id,
            reason=reason,
            drain_s=drain_s,
            leaving=leaving,
        )

    async def cordon(self, request: Request) -> Response:
        replica_id = self._replica_id(request)
        drain_s = await self._drain(request)
        written = await self._admin_change(
            replica_id,
            "cordoned",
            reason="cordoned by the admin API",
            drain_s=drain_s,
        )
        if written is None:
            raise NotFound(f"no member replica {replica_id}", code="replica_not_found")
        return await self._answer(replica_id)

    async def uncordon(self, request: Request) -> Response:
        replica_id = self._replica_id(request)
        member = await self._member(replica_id)
        if member.state != "cordoned":
            raise Conflict(f"replica {replica_id} is not cordoned", code="replica_not_cordoned")
        written = await self._admin_change(
            replica_id,
            "uncordoned",
            reason="uncordoned by the admin API",
        )
        if written is None:
            raise Conflict(f"replica {replica_id} is not cordoned", code="replica_not_cordoned")
        return await self._answer(replica_id)

    async def remove(self, request: Request) -> Response:
        replica_id = self._replica_id(request)
        drain_s = _drain_value(request.query_params.get("drain_s"))
        member = await self._member(replica_id)
        if member.source in DECLARED_SOURCES and self._still_declared(member):
            raise Conflict(
                f"replica {replica_id} is declared by the {member.source}: change the {member.source}, or cordon it",
                code="replica_declared",
            )
        written = await self._admin_change(
            replica_id,
            "cordoned",
            reason="removal asked: leaves once its attempts end",
            drain_s=drain_s,
            leaving=True,
        )
        if written is None:
            raise NotFound(f"no member replica {replica_id}", code="replica_not_found")
        return await self._answer(replica_id, status=202)

    # --- helpers ---------------------------------------------------------------------

    def _still_declared(self, member: Member) -> bool:
        if member.source == "file":
            return any(replica.id == member.replica_id for replica in self.ctx.config.replicas)
        return True  # a DNS name lists it until the name says otherwise

    def _described(self, member: Member, live: int) -> dict[str, Any]:
        described = member.as_json()
        for model in described["models"]:
            configured = self.ctx.config.model_revision(model["name"])
            model["configured_revision"] = configured
            model["current"] = model["revision"] is None or configured is None or model["revision"] == configured
        described["live_attempts"] = live
        return described

    async def _answer(self, replica_id: str, *, status: int = 200) -> Response:
        member = await self.fleet.member(replica_id)
        assert member is not None
        live = (await self.fleet.live_attempts()).get(replica_id, 0)
        return JSONResponse(self._described(member, live), status_code=status)

    async def _member(self, replica_id: str) -> Member:
        member = await self.fleet.member(replica_id)
        if member is None or not member.member:
            raise NotFound(f"no member replica {replica_id}", code="replica_not_found")
        return member

    @staticmethod
    def _replica_id(request: Request) -> str:
        replica_id = str(request.path_params["replica_id"])
        if not REPLICA_ID.fullmatch(replica_id):
            raise NotFound(f"no member replica {replica_id[:64]!r}", code="replica_not_found")
        return replica_id

    async def _drain(self, request: Request) -> float | None:
        if not await request.body():
            return None
        body = await json_body(request, self.ctx.config.max_body_bytes)
        if not isinstance(body, dict) or set(body) - {"drain_s"}:
            raise InvalidRequest('the body is {} or {"drain_s": seconds}', code="invalid_body")
        return _drain_value(body.get("drain_s"))

    def _declared(self, body: Any) -> ReplicaConfig:
        if not isinstance(body, dict):
            raise InvalidRequest('the body is {"id", "url", "kind", "models"}', code="invalid_body")
        unknown = sorted(set(body) - {"id", "url", "kind", "models"})
        if unknown:
            raise InvalidRequest(f"unknown fields: {', '.join(unknown)}", param=unknown[0], code="invalid_body")
        replica_id, url, kind = body.get("id"), body.get("url"), body.get("kind", "worker")
        if not isinstance(replica_id, str) or not REPLICA_ID.fullmatch(replica_id):
            why = "id: 1-64 letters, digits, '.', '_', ':' or '-'"
            raise InvalidRequest(why, param="id", code="invalid_replica_id")
        if kind not in REPLICA_KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(REPLICA_KINDS)}", param="kind", code="invalid_kind")
        if not isinstance(url, str) or not URL.fullmatch(url):
            raise InvalidRequest("url must be http(s)://host[:port]", param="url", code="invalid_url")
        try:
            entry = {"id": replica_id, "url": url.rstrip("/"), "kind": kind, "models": body.get("models", [])}
            replica = replica_entry(entry)
        except (ConfigError, TypeError) as exc:
            raise InvalidRequest(str(exc), param="models", code="invalid_models") from None
        if not all(NAME.fullmatch(text) for text in (*replica.models, *(rev for _, rev in replica.revisions))):
            raise InvalidRequest(
                "models: printable names, 256 characters at most", param="models", code="invalid_models"
            )
        served = self.ctx.config.models
        unknown_models = [model for model in replica.models if served and model not in served]
        if unknown_models:
            raise Unprocessable(
                f"model {unknown_models[0]!r} is not served by this gateway (models: {', '.join(served)})",
                param="models",
                code="model_not_served",
            )
        return replica

    async def _probe(self, replica: ReplicaConfig) -> None:
        """The replica answers its health probe as the kind it says it is, or it is refused."""
        answer, incompatible = await self.keeper.probe_new(replica, PROBE_S)
        if answer == "incompatible":
            why = f"{replica.url} does not answer as a {replica.kind} replica: {incompatible or 'incompatible'}"
            raise Unprocessable(why, param="url", code="replica_incompatible")
        if answer != "healthy":
            why = f"{replica.url} did not answer its health probe ({answer})"
            raise Unprocessable(why, param="url", code="replica_unreachable")


def _drain_value(value: Any) -> float | None:
    if value is None:
        return None
    try:
        drain_s = float(value)
    except (TypeError, ValueError):
        drain_s = math.nan
    if isinstance(value, bool) or not 0 <= drain_s <= MAX_DRAIN_S:
        why = f"drain_s must be between 0 and {MAX_DRAIN_S:g} seconds"
        raise InvalidRequest(why, param="drain_s", code="invalid_drain")
    return drain_s
