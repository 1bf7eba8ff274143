"""Gateway instances in PostgreSQL (migration 0004): leases, the guard on appends, sweeps.

The guard is PostgreSQL's: an append by an instance whose lease lapsed, was swept or
was given back is refused in the insert's own statement (``InstanceFenced``), whoever
sends it; a store that names no instance is not guarded.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from app.store.database import asyncpg_dsn
from app.store.errors import InstanceFenced
from app.store.instances import InstanceInfo, InstanceRegistry, renew_lease
from app.store.postgres import PostgresEventStore
from ops import traces


def info(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id, f"{instance_id}:8000", "host", 1, "test", None)


async def renew(store: PostgresEventStore, instance_id: str, ttl_s: float) -> int | None:
    """A renewal as the lease keeper makes it, on a connection of its own."""
    connection = await asyncpg.connect(asyncpg_dsn(store.url))
    try:
        return await renew_lease(connection, instance_id, ttl_s)
    finally:
        await connection.close()


async def test_a_lapsed_instance_appends_nothing_more(event_store: PostgresEventStore) -> None:
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_short"), ttl_s=0.5)
    event_store.writer.bind_instance("gw_short")
    trace = traces.completed("req_guarded")
    await event_store.append("req_guarded", 0, trace.events[:3])  # live: taken
    await asyncio.sleep(0.6)
    with pytest.raises(InstanceFenced, match="gw_short is fenced"):
        await event_store.append("req_guarded", 3, trace.events[3:4])
    assert await renew(event_store, "gw_short", 10.0) is None  # a lapsed lease is not revived
    assert await event_store.read("req_guarded") == trace.events[:3]
    event_store.writer.bind_instance(None)  # unguarded (the CLI, trace import)
    other = traces.completed("req_unguarded")
    await event_store.append("req_unguarded", 0, other.events)
    assert await event_store.read("req_unguarded") == other.events


async def test_a_released_instance_is_refused_and_a_live_one_renews(event_store: PostgresEventStore) -> None:
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_live"), ttl_s=30.0)
    await registry.register(info("gw_gone"), ttl_s=30.0)
    assert await renew(event_store, "gw_live", 30.0) == 2  # and both are live
    await registry.release("gw_gone")
    assert await renew(event_store, "gw_live", 30.0) == 1
    event_store.writer.bind_instance("gw_gone")
    trace = traces.completed("req_released")
    with pytest.raises(InstanceFenced):
        await event_store.append("req_released", 0, trace.events[:2])
    event_store.writer.bind_instance("gw_live")
    await event_store.append("req_released", 0, trace.events[:2])
    assert len(await event_store.read("req_released")) == 2


async def test_many_sweepers_take_a_lapsed_instance_over_once(event_store: PostgresEventStore) -> None:
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_dead"), ttl_s=0.01)
    for sweeper in ("gw_a", "gw_b", "gw_c"):
        await registry.register(info(sweeper), ttl_s=30.0)
    await asyncio.sleep(0.05)
    claims = await asyncio.gather(*(registry.claim_lapsed(s) for s in ("gw_a", "gw_b", "gw_c")))
    assert sorted(claims) == [[], [], ["gw_dead"]]
    assert await asyncio.gather(*(registry.claim_lapsed(s) for s in ("gw_a", "gw_b"))) == [[], []]
    (winner,) = [s for s, claimed in zip(("gw_a", "gw_b", "gw_c"), claims, strict=True) if claimed]
    await registry.swept("gw_dead", winner, closed=0)
    rows = {row["instance_id"]: row for row in await registry.recent()}
    assert rows["gw_dead"]["swept_by"] == winner and rows["gw_dead"]["swept_at"] is not None
    assert rows["gw_dead"]["live"] is False and rows[winner]["live"] is True


async def test_a_claim_whose_sweeper_lapsed_is_taken_again(event_store: PostgresEventStore) -> None:
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_dead2"), ttl_s=0.01)
    await registry.register(info("gw_sweeper_dies"), ttl_s=0.3)
    await registry.register(info("gw_next"), ttl_s=30.0)
    await asyncio.sleep(0.05)
    assert await registry.claim_lapsed("gw_sweeper_dies") == ["gw_dead2"]  # then it dies mid-sweep
    assert await registry.claim_lapsed("gw_next") == []  # its claim holds while it lives
    await asyncio.sleep(0.35)
    assert sorted(await registry.claim_lapsed("gw_next")) == ["gw_dead2", "gw_sweeper_dies"]


async def test_a_held_writer_writes_what_it_kept_under_the_id_it_is_bound_to_next(
    event_store: PostgresEventStore,
) -> None:
    """A fenced instance holds its writer: an acknowledged append (a delivery its client
    got) is written neither under the lapsed id (refused) nor dropped, but once the
    instance registered again, under the new id that took the old one over."""
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_before"), ttl_s=0.3)
    event_store.writer.bind_instance("gw_before")
    trace = traces.completed("req_kept")
    await event_store.append("req_kept", 0, trace.events[:3])
    event_store.writer.hold()
    await event_store.append("req_kept", 3, trace.events[3:4], durable=False)  # acknowledged: kept
    await asyncio.sleep(0.4)  # gw_before lapses; nothing was written meanwhile
    assert await event_store.read("req_kept") == trace.events[:3]
    assert await registry.register(info("gw_after"), ttl_s=30.0, taking_over="gw_before") is True
    event_store.writer.bind_instance("gw_after")
    await event_store.flush()
    assert await event_store.read("req_kept") == trace.events[:4]
