"""The fleet's membership on real PostgreSQL (docs/design.md §16): events, projection,
declared sources reconciled once, worker leases lapsed exactly once, the fenced guard."""

from __future__ import annotations

import asyncio
import os
import socket

import asyncpg
import pytest
from sqlalchemy import text

from app.store.database import asyncpg_dsn
from app.store.errors import InstanceFenced
from app.store.fleet import FleetStore
from app.store.fleet_model import DeclaredReplica
from app.store.instances import InstanceInfo, InstanceRegistry
from app.store.postgres import PostgresEventStore


async def instance(store: PostgresEventStore, instance_id: str, ttl_s: float = 30.0) -> str:
    info = InstanceInfo(instance_id, "test", socket.gethostname(), os.getpid(), "test", None)
    await InstanceRegistry(store).register(info, ttl_s)
    return instance_id


def replica(replica_id: str, url: str = "http://127.0.0.1:9", **options: object) -> DeclaredReplica:
    return DeclaredReplica(replica_id, url, **options)  # type: ignore[arg-type]


async def test_events_are_projected_into_replicas(event_store: PostgresEventStore) -> None:
    fleet = FleetStore(event_store)
    gw = await instance(event_store, "gw_a")
    joined = await fleet.join(
        replica("r1", models=(("m", "rev-b"),)), source="admin", actor="admin-token", instance_id=gw
    )
    cordoned = await fleet.change(
        "r1", "cordoned", source="admin", actor="ops", instance_id=gw, reason="disk", drain_s=5
    )
    assert cordoned is not None and cordoned.seq > joined.seq
    (member,) = await fleet.members()
    assert (member.state, member.source, member.models, member.url) == (
        "cordoned",
        "admin",
        (("m", "rev-b"),),
        replica("r1").url,
    )
    assert member.drain_until is not None
    assert await fleet.change("r1", "cordoned", source="admin", actor="ops", instance_id=gw) is not None
    uncordoned = await fleet.change("r1", "uncordoned", source="admin", actor="ops", instance_id=gw)
    assert uncordoned is not None
    assert await fleet.change("r1", "uncordoned", source="admin", actor="ops", instance_id=gw) is None  # not cordoned
    assert (await fleet.member("r1")).state == "serving"  # type: ignore[union-attr]
    assert await fleet.change("r1", "left", source="admin", actor="ops", instance_id=gw) is not None
    assert (await fleet.member("r1")).state == "left"  # type: ignore[union-attr]
    assert await fleet.change("r1", "cordoned", source="admin", actor="ops", instance_id=gw) is None  # left
    events = await fleet.events()
    assert [e["event"] for e in events] == ["left", "uncordoned", "cordoned", "cordoned", "joined"]
    assert events[-2]["actor"] == "ops" and events[-2]["reason"] == "disk" and events[-2]["instance_id"] == gw
    assert events[-1]["models"] == {"m": "rev-b"}


async def test_fleet_events_are_append_only(event_store: PostgresEventStore) -> None:
    fleet = FleetStore(event_store)
    await fleet.join(replica("r1"), source="admin", actor="a", instance_id=None)
    for statement in ("UPDATE fleet_events SET actor = 'x'", "DELETE FROM fleet_events"):
        with pytest.raises(Exception, match="append-only"):
            async with event_store.writing() as connection:
                await connection.execute(text(statement))
    assert len(await fleet.events()) == 1


async def test_a_fenced_instance_writes_no_fleet_event(event_store: PostgresEventStore) -> None:
    fleet = FleetStore(event_store)
    gw = await instance(event_store, "gw_fenced")
    await fleet.join(replica("r1"), source="admin", actor="a", instance_id=gw)
    await InstanceRegistry(event_store).release(gw)
    with pytest.raises(InstanceFenced):
        await fleet.join(replica("r2"), source="admin", actor="a", instance_id=gw)
    with pytest.raises(InstanceFenced):
        await fleet.change("r1", "cordoned", source="admin", actor="a", instance_id=gw)
    with pytest.raises(InstanceFenced):
        await fleet.reconcile_declared("file", [replica("r3")], actor=gw, instance_id=gw)
    assert [(m.replica_id, m.state) for m in await fleet.members()] == [("r1", "serving")]
    assert len(await fleet.events()) == 1


async def test_a_new_incarnation_replaces_the_old_which_leaves(event_store: PostgresEventStore) -> None:
    fleet = FleetStore(event_store)
    await fleet.join(replica("w1", incarnation="a"), source="join", actor="w1", instance_id=None)
    await fleet.change("w1", "cordoned", source="admin", actor="ops", instance_id=None)
    await fleet.join(replica("w1", "http://127.0.0.1:10", incarnation="b"), source="join", actor="w1", instance_id=None)
    member = await fleet.member("w1")
    assert member is not None
    assert (member.incarnation, member.url, member.state) == (
        "b",
        "http://127.0.0.1:10",
        "cordoned",
    )  # the cordon stays
    events = list(reversed(await fleet.events()))
    assert [(e["event"], e["incarnation"]) for e in events] == [
        ("joined", "a"),
        ("cordoned", "a"),
        ("left", "a"),
        ("joined", "b"),
        ("cordoned", "b"),
    ]


async def test_a_declared_source_is_reconciled_once_by_concurrent_instances(database_url: str) -> None:
    stores = [await PostgresEventStore.connect(database_url) for _ in range(3)]
    try:
        fleets = [FleetStore(store) for store in stores]
        declared = [replica("f1"), replica("f2", kind="openai", models=(("m", None),))]
        written = await asyncio.gather(
            *(f.reconcile_declared("file", declared, actor=f"gw{i}", instance_id=None) for i, f in enumerate(fleets))
        )
        assert sorted(w.replica_id for batch in written for w in batch) == ["f1", "f2"]  # each once
        assert await fleets[0].reconcile_declared("file", declared, actor="gw0", instance_id=None) == []
        # cordoned f1 stays cordoned while still declared; f2 removed from the file leaves
        await fleets[0].change("f1", "cordoned", source="admin", actor="ops", instance_id=None)
        again = await fleets[1].reconcile_declared("file", declared[:1], actor="gw1", instance_id=None)
        assert [(w.event, w.replica_id) for w in again] == [("left", "f2")]
        states = {m.replica_id: m.state for m in await fleets[2].members()}
        assert states == {"f1": "cordoned", "f2": "left"}
        # another source's replica is not the file's to take
        await fleets[0].join(replica("a1"), source="admin", actor="ops", instance_id=None)
        assert (
            await fleets[0].reconcile_declared(
                "file", [*declared[:1], replica("a1", "http://x:1")], actor="g", instance_id=None
            )
            == []
        )
        with pytest.raises(ValueError, match="declared source"):
            await fleets[0].reconcile_declared("admin", [], actor="g", instance_id=None)
    finally:
        for store in stores:
            await store.close()


async def test_a_dns_names_set_removes_only_its_own_replicas_each_cordoned_with_its_drain(
    event_store: PostgresEventStore,
) -> None:
    fleet = FleetStore(event_store)
    a1, a2, b1 = replica("10.0.0.1:80@a.test"), replica("10.0.0.2:80@a.test"), replica("10.0.0.1:80@b.test")
    for name, found in (("a.test", [a1, a2]), ("b.test", [b1])):
        await fleet.reconcile_declared("dns", found, actor="g", instance_id=None, scope=name, drain_s=30)
    await fleet.reconcile_declared("file", [replica("f1")], actor="g", instance_id=None)
    gone = await fleet.reconcile_declared("dns", [a1], actor="g", instance_id=None, scope="a.test", drain_s=30)
    assert [(w.event, w.replica_id) for w in gone] == [("cordoned", "10.0.0.2:80@a.test")]
    members = {m.replica_id: m for m in await fleet.members()}
    assert {rid: m.state for rid, m in members.items()} == {
        "10.0.0.1:80@a.test": "serving",
        "10.0.0.2:80@a.test": "cordoned",
        "10.0.0.1:80@b.test": "serving",  # another name's: untouched
        "f1": "serving",  # the file's: untouched
    }
    leaving = members["10.0.0.2:80@a.test"]
    assert leaving.leaving and leaving.drain_left_s is not None and 25 < leaving.drain_left_s <= 30
    # asked again (the next resolution, another lock holder): on its way out already, no new event
    assert await fleet.reconcile_declared("dns", [a1], actor="g", instance_id=None, scope="a.test", drain_s=30) == []
    (event,) = await fleet.events(limit=1)
    assert (event["event"], event["source"], event["reason"]) == ("cordoned", "dns", "no longer in the dns a.test")


async def test_a_lapsed_worker_is_marked_lapsed_exactly_once(database_url: str) -> None:
    stores = [await PostgresEventStore.connect(database_url) for _ in range(3)]
    try:
        fleets = [FleetStore(store) for store in stores]
        await fleets[0].join(replica("w1", incarnation="i1"), source="join", actor="w1", instance_id=None)
        assert await fleets[0].renew("w1", "i1", 0.2) == "serving"
        assert await fleets[0].renew("w1", "other", 0.2) is None
        assert (
            sum(len(x) for x in await asyncio.gather(*(f.lapse_expired(actor="g", instance_id=None) for f in fleets)))
            == 0
        )
        await asyncio.sleep(0.3)
        for _ in range(3):  # each sweep round, three instances at once
            await asyncio.gather(*(f.lapse_expired(actor=f"gw{i}", instance_id=None) for i, f in enumerate(fleets)))
        events = [e["event"] for e in await fleets[0].events(replica_id="w1")]
        assert events == ["lapsed", "joined"]
        assert await fleets[0].renew("w1", "i1", 1.0) is None  # lapsed: it must join again
    finally:
        for store in stores:
            await store.close()


async def test_changes_are_announced_and_the_audit_role_reads_them(
    event_store: PostgresEventStore, database_url: str
) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    heard: asyncio.Queue[str] = asyncio.Queue()
    try:
        await connection.add_listener("phasegate_fleet", lambda *args: heard.put_nowait(args[3]))
        written = await FleetStore(event_store).join(replica("r1"), source="admin", actor="a", instance_id=None)
        assert await asyncio.wait_for(heard.get(), 5) == str(written.seq)
        for table in ("fleet_events", "replicas"):
            assert await connection.fetchval("SELECT has_table_privilege('phasegate_analysts', $1, 'SELECT')", table)
    finally:
        await connection.close()
