"""The gateway's side of a worker joining the fleet, under the worker token
(app/contract/fleet_join.py; docs/worker-protocol.md).

A gateway with no ``worker_token`` configured refuses every one with 403
``worker_join_disabled``: the token is the fleet's credential (docs/design.md §13, §16),
and with none anyone could join and receive prompts. A wrong or missing token is 401.
A join is probed first (its health, as the kind ``worker``): one that does not answer,
or answers in another protocol, is recorded as ``refused`` and answered 422. The same
id with a new incarnation replaces the old one, which leaves.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.admin.fleet import NAME, REPLICA_ID, URL, Unprocessable, fleet_exchange
from app.api.bodies import json_body
from app.api.errors import (
    Forbidden,
    InvalidRequest,
    NotFound,
    Unauthorized,
)
from app.config import ReplicaConfig
from app.contract.fleet_join import (
    CORDON_PATH,
    JOIN_PATH,
    LEASE_TTL_S,
    LEAVE_PATH,
    NOT_MEMBER,
    RENEW_EVERY_S,
    RENEW_PATH,
)
from app.driver.context import GatewayContext
from app.driver.fleet import FleetKeeper
from app.store.fleet_model import DeclaredReplica

log = logging.getLogger("phasegate.fleet")

PROBE_S = 5.0
Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


def join_routes(ctx: GatewayContext, keeper: FleetKeeper) -> list[Route]:
    joins = _Joins(ctx, keeper)
    return [
        Route(JOIN_PATH, joins.guarded(joins.join), methods=["POST"]),
        Route(RENEW_PATH, joins.guarded(joins.renew), methods=["POST"]),
        Route(CORDON_PATH, joins.guarded(joins.cordon), methods=["POST"]),
        Route(LEAVE_PATH, joins.guarded(joins.leave), methods=["POST"]),
    ]


class _Joins:
    def __init__(self, ctx: GatewayContext, keeper: FleetKeeper) -> None:
        self.ctx = ctx
        self.keeper = keeper
        self.fleet = keeper.fleet

    def guarded(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            async def answer() -> Response:
                self._authorize(request)
                body = await json_body(request, self.ctx.config.max_body_bytes)
                if not isinstance(body, dict):
                    raise InvalidRequest('the body is {"id", "incarnation", ...}', code="invalid_body")
                return await handler(request, body)

            return await fleet_exchange("fleet join", answer)

        return guarded

    def _authorize(self, request: Request) -> None:
        token = self.ctx.config.worker_token
        if not token:
            raise Forbidden(
                "this gateway has no worker_token: workers cannot join it (configure one)",
                code="worker_join_disabled",
            )
        scheme, _, offered = request.headers.get("authorization", "").partition(" ")
        presented = offered.strip() if scheme.lower() == "bearer" else ""
        digest = hashlib.sha256(token.encode()).digest()
        if not hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), digest):
            raise Unauthorized("missing or incorrect worker token", code="invalid_worker_token")

    @staticmethod
    def _identity(body: dict[str, Any]) -> tuple[str, str]:
        replica_id, incarnation = body.get("id"), body.get("incarnation")
        if not isinstance(replica_id, str) or not REPLICA_ID.fullmatch(replica_id):
            raise InvalidRequest(
                "id: 1-64 letters, digits, '.', '_', ':' or '-'", param="id", code="invalid_replica_id"
            )
        if not isinstance(incarnation, str) or not REPLICA_ID.fullmatch(incarnation):
            raise InvalidRequest("incarnation: 1-64 letters or digits", param="incarnation", code="invalid_incarnation")
        return replica_id, incarnation

    async def join(self, request: Request, body: dict[str, Any]) -> Response:
        replica_id, incarnation = self._identity(body)
        url, models = body.get("url"), body.get("models", {})
        if not isinstance(url, str) or not URL.fullmatch(url):
            raise InvalidRequest("url must be http(s)://host[:port]", param="url", code="invalid_url")
        if not isinstance(models, dict) or not all(
            NAME.fullmatch(name) and (rev is None or (isinstance(rev, str) and NAME.fullmatch(rev)))
            for name, rev in models.items()
        ):
            raise InvalidRequest("models: {NAME: REVISION or null}", param="models", code="invalid_models")
        served = self.ctx.config.models
        unknown = [name for name in models if served and name not in served]
        declared = DeclaredReplica(replica_id, url.rstrip("/"), "worker", tuple(sorted(models.items())), incarnation)
        actor = f"worker {replica_id}"
        if unknown:
            await self._refused(declared, actor, f"model {unknown[0]!r} is not served by this gateway")
            raise Unprocessable(
                f"model {unknown[0]!r} is not served by this gateway", param="models", code="model_not_served"
            )
        config = ReplicaConfig(id=replica_id, url=declared.url, models=tuple(models))
        answer, incompatible = await self.keeper.probe_new(config, PROBE_S)
        if answer != "healthy":
            why = f"{declared.url} did not answer the gateway's health probe ({incompatible or answer})"
            await self._refused(declared, actor, why)
            raise Unprocessable(why, param="url", code="replica_unreachable")
        written = await self.fleet.join(
            declared, source="join", actor=actor, instance_id=self.ctx.gateway_id, reason="joined by itself"
        )
        await self.fleet.renew(replica_id, incarnation, LEASE_TTL_S)
        return JSONResponse(
            {
                "id": replica_id,
                "incarnation": incarnation,
                "seq": written.seq,
                "lease_ttl_s": LEASE_TTL_S,
                "renew_every_s": RENEW_EVERY_S,
            },
            status_code=201,
        )

    async def _refused(self, declared: DeclaredReplica, actor: str, reason: str) -> None:
        log.warning("fleet: %s refused: %s", actor, reason)
        await self.fleet.refuse(declared, source="join", actor=actor, reason=reason, instance_id=self.ctx.gateway_id)

    async def renew(self, request: Request, body: dict[str, Any]) -> Response:
        replica_id, incarnation = self._identity(body)
        state = await self.fleet.renew(replica_id, incarnation, LEASE_TTL_S)
        if state is None:
            raise NotFound(f"replica {replica_id} ({incarnation}) is not a member: join again", code=NOT_MEMBER)
        return JSONResponse({"id": replica_id, "state": state, "lease_ttl_s": LEASE_TTL_S})

    async def cordon(self, request: Request, body: dict[str, Any]) -> Response:
        return await self._change(body, "cordoned", "the worker is draining")

    async def leave(self, request: Request, body: dict[str, Any]) -> Response:
        return await self._change(body, "left", "the worker stopped")

    async def _change(self, body: dict[str, Any], event: str, reason: str) -> Response:
        replica_id, incarnation = self._identity(body)
        written = await self.fleet.change(
            replica_id,
            event,
            source="join",
            actor=f"worker {replica_id}",
            instance_id=self.ctx.gateway_id,
            reason=reason,
            incarnation=incarnation,
        )
        if written is None:
            raise NotFound(f"replica {replica_id} ({incarnation}) is not a member", code=NOT_MEMBER)
        return JSONResponse({"id": replica_id, "event": event, "seq": written.seq})
