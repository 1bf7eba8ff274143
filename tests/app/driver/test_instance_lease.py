"""An instance's lease on real PostgreSQL: renewed while the process is busy, lost when it is wedged.

The renewals run on a thread and a connection of their own (app/store/lease.py), so
neither a pool whose every connection is taken (a burst of new requests recording
their inputs) nor an event loop that runs late (thousands of held streams) lets the
lease lapse. A loop that runs nothing at all for half the TTL is wedged: its lease
lapses in PostgreSQL, and once it runs again the instance is fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import asyncpg

from app.config import GatewayConfig
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext
from app.driver.instance import GatewayInstance
from app.replicas.pool import ReplicaPool
from app.store.database import asyncpg_dsn
from app.store.postgres import PostgresEventStore
from app.telemetry.metrics import Metrics

TTL_S = 1.5


@contextlib.asynccontextmanager
async def started_instance(database_url: str) -> AsyncIterator[GatewayInstance]:
    """An instance with a short lease, on a store whose pool holds three connections."""
    store = await PostgresEventStore.connect(database_url, pool_size=1)
    config = GatewayConfig(instance_lease_ttl_s=TTL_S, maintain_interval_s=0)
    ctx = GatewayContext(
        config=config, store=store, pool=ReplicaPool([]), budget=RetryBudget(10, 1.0), metrics=Metrics()
    )
    instance = GatewayInstance(ctx, store)
    await instance.start()
    try:
        yield instance
    finally:
        await instance.stop()
        await store.close()


async def lease_in_postgres(database_url: str, instance_id: str) -> bool:
    """Whether PostgreSQL holds ``instance_id``'s lease valid now (asked outside the pool)."""
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        return bool(
            await connection.fetchval(
                "SELECT lease_expires_at > now() FROM gateway_instances WHERE instance_id = $1", instance_id
            )
        )
    finally:
        await connection.close()


def busy(seconds: float) -> None:
    """Hold the event loop (and take the GIL as Python code does) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def test_the_lease_is_renewed_while_every_pooled_connection_is_taken(database_url: str) -> None:
    async with started_instance(database_url) as instance, contextlib.AsyncExitStack() as taken:
        first = instance.instance_id
        for _ in range(3):  # pool_size 1 and its overflow of 2: a fourth query would wait
            await taken.enter_async_context(instance.store.reading())
        await asyncio.sleep(3 * TTL_S)
        assert instance.ctx.refusal is None
        assert instance.instance_id == first  # never fenced, never registered again
        assert instance.valid_until > instance.ctx.clock() + TTL_S / 3
        assert await lease_in_postgres(database_url, first)


async def test_the_lease_is_renewed_while_the_event_loop_runs_late(database_url: str) -> None:
    async with started_instance(database_url) as instance:
        first = instance.instance_id
        end = time.monotonic() + 3 * TTL_S
        while time.monotonic() < end:  # each turn of the loop takes a third of the TTL
            busy(TTL_S / 3)
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # the last answers reach the loop
        assert instance.ctx.refusal is None
        assert instance.instance_id == first
        assert instance.valid_until > instance.ctx.clock()
        assert await lease_in_postgres(database_url, first)


async def test_a_wedged_event_loop_loses_its_lease_and_is_fenced(database_url: str) -> None:
    async with started_instance(database_url) as instance:
        first = instance.instance_id
        registry = instance.ctx.metrics.registry
        busy(2 * TTL_S)  # the keeper may renew within half the TTL, then no more
        assert not await lease_in_postgres(database_url, first)  # lapsed while wedged
        async with asyncio.timeout(5):
            while instance.instance_id == first:
                await asyncio.sleep(0.01)
        assert registry.get_sample_value("phasegate_gateway_instance_fenced_total") == 1
        assert instance.ctx.refusal is None  # registered again under a new id
        assert await lease_in_postgres(database_url, instance.instance_id)
