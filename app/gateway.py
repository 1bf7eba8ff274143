"""The composition root: one gateway process's store, pool, probes, instance and app.

``Gateway.open(config, database_url)`` connects the event log (applying migrations
when asked) and returns a gateway whose ``app`` is the Starlette application. Its
lifespan registers the gateway instance (:mod:`app.driver.instance`: lease, heartbeat,
sweeps), then keeps the pool to the fleet in PostgreSQL (:mod:`app.driver.fleet`: the
configuration's replicas join it as source ``file``), and starts the health probes;
on shutdown it waits for in-flight bookkeeping (fences that complete after a stream
ended), gives the instance's lease back, then flushes and closes the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette

from app.api.fleet_admin import fleet_routes
from app.api.fleet_join import join_routes
from app.api.routes import build_app
from app.config import GatewayConfig, ReplicaConfig
from app.driver import gauges
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext, ToolRunner
from app.driver.fleet import FleetKeeper
from app.driver.instance import GatewayInstance
from app.driver.tools import WebhookRunner
from app.metrics import Metrics
from app.replicas.base import ReplicaClient
from app.replicas.openai_upstream import OpenAIUpstream
from app.replicas.pool import ReplicaPool
from app.replicas.worker import WorkerReplica
from app.store.idempotency import IdempotencyKeys
from app.store.migrate import upgrade_async
from app.store.postgres import PostgresEventStore
from app.tracing import AttemptSpans

log = logging.getLogger("phasegate.gateway")

SHUTDOWN_GRACE_S = 10.0


def replica_client(replica: ReplicaConfig, config: GatewayConfig) -> ReplicaClient:
    timeouts = config.timeouts
    if replica.kind == "openai":
        models = replica.models or tuple(config.models)
        return OpenAIUpstream(
            replica.id,
            replica.url,
            health_model=models[0] if models else "default",
            connect_timeout_s=timeouts.connect_s,
            response_timeout_s=timeouts.upstream_response_s,
        )
    return WorkerReplica(replica.id, replica.url, connect_timeout_s=timeouts.connect_s, token=config.worker_token)


class Gateway:
    def __init__(self, ctx: GatewayContext, store: PostgresEventStore) -> None:
        self.ctx = ctx
        self.instance = GatewayInstance(ctx, store, address=f"http://{ctx.config.host}:{ctx.config.port}")
        self.fleet = FleetKeeper(ctx, store, lambda replica: replica_client(replica, ctx.config))
        self._probes: asyncio.Task[None] | None = None
        fleet = [*fleet_routes(ctx, self.fleet), *join_routes(ctx, self.fleet)]
        self.app: Starlette = build_app(ctx, extra_routes=fleet, lifespan=self._lifespan)

    @classmethod
    async def open(
        cls,
        config: GatewayConfig,
        database_url: str,
        *,
        tool_runner: ToolRunner | None = None,
    ) -> Gateway:
        if config.apply_migrations:
            await upgrade_async(database_url)
        store = await PostgresEventStore.connect(database_url, content_policy=config.content_policy)
        metrics = Metrics()
        pool = ReplicaPool(  # its replicas are the fleet's, from PostgreSQL (app/driver/fleet.py)
            [],
            eject_after_failures=config.eject_after_failures,
            ejection_s=config.ejection_s,
            ejection_max_s=config.ejection_max_s,
        )
        pool.on_health_change = lambda replica: metrics.replica_healthy.labels(replica=replica.id).set(
            1 if replica.healthy else 0
        )
        ctx = GatewayContext(
            config=config,
            store=store,
            pool=pool,
            budget=RetryBudget(config.retry_budget_burst, config.retry_budget_per_s),
            metrics=metrics,
            tool_runner=tool_runner or (WebhookRunner(config.tool_webhook_url) if config.tool_webhook_url else None),
            idempotency=IdempotencyKeys(store),
            tracing=AttemptSpans(),
        )
        metrics.on_scrape = lambda: gauges.sample(ctx)
        return cls(ctx, store)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await self.start()
        try:
            yield {}
        finally:
            await self.stop()

    @property
    def instance_id(self) -> str:
        return self.ctx.gateway_id

    async def start(self) -> None:
        await self.instance.start()
        await self.fleet.start()
        await self.ctx.pool.probe_all()
        self._probes = asyncio.get_running_loop().create_task(
            self.ctx.pool.run_probes(self.ctx.config.health_interval_s), name="replica probes"
        )

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, give open streams ``drain_s``, end the rest."""
        log.warning("gateway instance %s drains (up to %gs)", self.instance_id, self.ctx.config.drain_s)
        await self.instance.drain(self.ctx.config.drain_s)

    async def stop(self) -> None:
        if self._probes is not None:
            self._probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probes
        await self.ctx.drain(SHUTDOWN_GRACE_S)
        await self.fleet.stop()
        await self.instance.stop()
        await self.ctx.store.close()
        await self.ctx.pool.close()
        if isinstance(self.ctx.tool_runner, WebhookRunner):
            await self.ctx.tool_runner.aclose()
