"""The composition root: one gateway process's store, pool, probes, instance and app.

``Gateway.open(config, database_url)`` connects the event log (applying migrations
when asked) and returns a gateway whose ``app`` is the Starlette application. Its
lifespan registers the gateway instance (:mod:`app.driver.instance`: lease, heartbeat,
sweeps), then keeps the pool to the fleet in PostgreSQL (:mod:`app.driver.fleet`: the
configuration's replicas join it as source ``file``), and starts the health probes;
on shutdown it waits for in-flight bookkeeping (fences that complete after a stream
ended), gives the instance's lease back, then flushes and closes the log.

The fleet's declared sources are the file's ``[[replicas]]`` and each ``[[discover]]``
name, resolved while the gateway runs (app/replicas/discovery.py) by the process that
holds the fleet's lock: each hands what it read to its
:class:`~app.driver.fleet.FleetKeeper`, and the lock holder writes the changes; every
pool follows the membership. ``reload`` applies a configuration that the parent process
checked whole (app/process/reload.py), at once, between two requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette

from app.api.admin.fleet import fleet_routes
from app.api.admin.fleet_join import join_routes
from app.api.routes import build_app
from app.config import GatewayConfig, ReplicaConfig
from app.discover_config import DiscoverConfig
from app.driver import gauges
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext, ToolRunner
from app.driver.fleet import FleetKeeper
from app.driver.instance import GatewayInstance
from app.driver.tools import WebhookRunner
from app.process import heap
from app.replicas.base import ReplicaClient
from app.replicas.declared import dns_replicas
from app.replicas.discovery import Address, Discovery, DiscoveryLoops
from app.replicas.openai_upstream import OpenAIUpstream
from app.replicas.pool import ReplicaPool
from app.replicas.worker import WorkerReplica
from app.store.idempotency import IdempotencyKeys
from app.store.migrate import upgrade_async
from app.store.postgres import PostgresEventStore
from app.tasks import ended
from app.telemetry.metrics import Metrics
from app.telemetry.tracing import AttemptSpans

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
        self._trims: asyncio.Task[None] | None = None  # freed heap memory returned (app/process/heap.py)
        self.discovery = DiscoveryLoops(self._discovery, self._forget)
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

    def _discovery(self, entry: DiscoverConfig) -> Discovery:
        metrics = self.ctx.metrics

        def found(entry: DiscoverConfig, addresses: frozenset[Address]) -> None:
            metrics.discovered.labels(name=entry.name).set(len(addresses))
            # this process holds the fleet's lock: it writes what it found (app/driver/fleet.py)
            self.fleet.declare("dns", dns_replicas(entry, addresses), scope=entry.name, drain_s=entry.drain_s)

        def failed(entry: DiscoverConfig, reason: str) -> None:
            metrics.discovery_failures.labels(name=entry.name).inc()

        # resolved by the process holding the fleet's lock, the one that writes what it finds
        return Discovery(entry, found, failed, active=lambda: self.fleet.listener.leading)

    def _forget(self, name: str) -> None:
        """A ``[[discover]]`` name a reload removed: its replicas leave, its series go."""
        self.fleet.forget("dns", name)
        for family in (self.ctx.metrics.discovered, self.ctx.metrics.discovery_failures):
            with contextlib.suppress(KeyError):
                family.remove(name)

    def reload(self, config: GatewayConfig) -> None:
        """Serve ``config`` from now on: checked whole by the parent (app/process/reload.py), applied
        here at once, with no await in between, so no request sees half of it. A request
        accepted before keeps what it was accepted with (its routing, revision, timeouts)."""
        self.ctx.config = config
        for reconfigure in self.ctx.reloaded:  # the API keys, the tenants' limits
            reconfigure(config)
        self.fleet.declare("file", config.replicas)  # the fleet's lock holder reconciles it
        self.discovery.follow(config.discover)
        log.info("gateway instance %s serves the configuration reloaded", self.instance_id)

    async def start(self) -> None:
        await self.instance.start()
        await self.fleet.start()
        await self.ctx.pool.probe_all()
        self.discovery.follow(self.ctx.config.discover)
        self._probes = asyncio.get_running_loop().create_task(
            self.ctx.pool.run_probes(self.ctx.config.health_interval_s), name="replica probes"
        )
        self._trims = asyncio.get_running_loop().create_task(heap.trim_every(), name="heap trims")

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, give open streams ``drain_s``, end the rest."""
        log.warning("gateway instance %s drains (up to %gs)", self.instance_id, self.ctx.config.drain_s)
        await self.instance.drain(self.ctx.config.drain_s)

    async def stop(self) -> None:
        await self.discovery.stop()
        await ended(self._probes, self._trims)
        await self.ctx.drain(SHUTDOWN_GRACE_S)
        await self.fleet.stop()
        await self.instance.stop()
        await self.ctx.store.close()
        await self.ctx.pool.close()
        if isinstance(self.ctx.tool_runner, WebhookRunner):
            await self.ctx.tool_runner.aclose()
