"""Migration 0007 on a populated log: the conversion to day partitions, up and down,
with appends going on while it runs, and the previous release's requests carried on
by the new code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import timedelta

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from app.store import PostgresEventStore, migrate
from app.store.audit import fold_disagreements
from app.store.codec import to_row
from app.store.database import asyncpg_dsn
from ops import traces
from statemachine.events import Event
from tests.app.store.test_partitions import conversion_day, noon

PREVIOUS = "0006"

# The previous release's append (0006's app/store/insert.py), word for word.
PREVIOUS_INSERT_EVENTS = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
SELECT request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body::jsonb
  FROM unnest($1::text[], $2::integer[], $3::uuid[], $4::text[], $5::smallint[],
              $6::integer[], $7::integer[], $8::timestamptz[], $9::text[])
       AS batch(request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
ON CONFLICT (event_id) DO NOTHING
"""
# A statement of both schemas: the previous release's, without its ON CONFLICT (whose
# arbiter, a unique index on event_id alone, a partitioned table cannot have).
BOTH_SCHEMAS_INSERT_EVENTS = PREVIOUS_INSERT_EVENTS.replace("ON CONFLICT (event_id) DO NOTHING", "")

SCENARIOS = (
    traces.completed,
    traces.fenced_then_retried,
    traces.interrupted_in_decode,
    traces.with_tool_call,
    traces.cancelled_by_client,
)


def scenario(number: int) -> traces.Trace:
    return SCENARIOS[number % len(SCENARIOS)](f"req_{number:05d}")


async def append_as_before(connection: asyncpg.Connection, events: Sequence[Event], statement: str) -> None:
    """Append ``events`` as the previous release's writer did (no accept day named)."""
    rows = [to_row(event)[:9] for event in events]  # its nine columns
    await connection.execute(statement, *[list(column) for column in zip(*rows, strict=True)])


async def fold_agrees(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as db:
            assert await fold_disagreements(db) == []
    finally:
        await engine.dispose()


async def count(connection: asyncpg.Connection, table: str) -> int:
    return int(await connection.fetchval(f"SELECT count(*) FROM {table}"))


async def test_a_populated_log_converts_up_and_down(empty_database_url: str) -> None:
    url = empty_database_url
    await migrate.upgrade_async(url, PREVIOUS)
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        requests = [scenario(number) for number in range(300)]
        halves = {trace.request_id: len(trace.events) // 2 for trace in requests[:50]}  # in flight across it
        for trace in requests:
            await append_as_before(
                connection, trace.events[: halves.get(trace.request_id, len(trace.events))], PREVIOUS_INSERT_EVENTS
            )
        before = await count(connection, "request_events")

        began = time.perf_counter()
        await migrate.upgrade_async(url)
        print(f"0007 on {before} events: {time.perf_counter() - began:.2f} s")
        assert await count(connection, "request_events") == before
        assert await count(connection, "request_events_legacy") == before

        store = await PostgresEventStore.connect(url)
        try:
            for trace in requests[:50]:  # the new code carries the previous release's requests on
                await store.append(trace.request_id, halves[trace.request_id], trace.events[halves[trace.request_id] :])
            converted = await conversion_day(connection)
            later = [traces.completed(f"req_new_{n}", at=noon(converted + timedelta(days=1))) for n in range(20)]
            for trace in later:
                await store.append(trace.request_id, 0, trace.events)
            for trace in (*requests[:60], *later[:3]):
                assert await store.read(trace.request_id) == trace.events
        finally:
            await store.close()
        await fold_agrees(url)
        total = await count(connection, "request_events")
        assert total == sum(len(trace.events) for trace in (*requests, *later))

        await migrate.downgrade_async(url, PREVIOUS)
        assert await count(connection, "request_events") == total
        assert await count(connection, "requests") == len(requests) + len(later)
        await fold_agrees(url)
        extra = traces.completed("req_after_downgrade")
        await append_as_before(connection, extra.events, PREVIOUS_INSERT_EVENTS)  # the previous release appends again
        positions = await connection.fetch("SELECT position FROM request_events ORDER BY position")
        assert len({row[0] for row in positions}) == total + len(extra.events)

        await migrate.upgrade_async(url)
        await fold_agrees(url)
    finally:
        await connection.close()


async def test_the_conversion_runs_while_appends_go_on(empty_database_url: str) -> None:
    url = empty_database_url
    await migrate.upgrade_async(url, PREVIOUS)
    writer = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for number in range(200):
            await append_as_before(writer, scenario(number).events, PREVIOUS_INSERT_EVENTS)
        upgraded = asyncio.Event()
        written: list[traces.Trace] = []
        waits: list[float] = []

        async def append_in_a_loop() -> None:
            number, after = 1000, 0
            while after < 20:  # until 20 requests went in after the conversion
                trace = scenario(number)
                began = time.perf_counter()
                await append_as_before(writer, trace.events, BOTH_SCHEMAS_INSERT_EVENTS)
                waits.append(time.perf_counter() - began)
                written.append(trace)
                number += 1
                after += upgraded.is_set()
                await asyncio.sleep(0)

        appending = asyncio.ensure_future(append_in_a_loop())
        async with asyncio.timeout(60):
            while len(written) < 3:  # appends are going on
                await asyncio.sleep(0.01)
        during = len(written)
        await migrate.upgrade_async(url)
        after_upgrade = len(written)
        upgraded.set()
        await appending
        assert after_upgrade > during > 0  # it appended before and while the conversion ran
        print(f"{len(written)} requests appended meanwhile; longest append {max(waits) * 1000:.1f} ms")
        expected = sum(len(scenario(n).events) for n in range(200)) + sum(len(t.events) for t in written)
        assert await count(writer, "request_events") == expected
    finally:
        await writer.close()
    await fold_agrees(url)


async def test_the_previous_releases_requests_carried_on_under_load(empty_database_url: str) -> None:
    """Requests the previous release accepted (schema 0006, events of its schema
    versions) go on after the conversion under the new code, amid new requests, all
    group-committed together."""
    url = empty_database_url
    await migrate.upgrade_async(url, PREVIOUS)
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        previous = [scenario(number) for number in range(200)]
        cut = {trace.request_id: 1 + number % (len(trace.events) - 1) for number, trace in enumerate(previous)}
        for trace in previous:
            await append_as_before(connection, trace.events[: cut[trace.request_id]], PREVIOUS_INSERT_EVENTS)
        await migrate.upgrade_async(url)
        day = await conversion_day(connection) + timedelta(days=1)
        fresh = [SCENARIOS[n % len(SCENARIOS)](f"req_new_{n:05d}", at=noon(day)) for n in range(200)]

        store = await PostgresEventStore.connect(url)
        try:

            async def carry_on(trace: traces.Trace, start: int) -> None:
                for seq in range(start, len(trace.events)):  # one event an append, as a driver does
                    await store.append(trace.request_id, seq, [trace.events[seq]], durable=False)

            await asyncio.gather(
                *(carry_on(trace, cut[trace.request_id]) for trace in previous),
                *(carry_on(trace, 0) for trace in fresh),
            )
            await store.flush()
            for trace in (*previous[:20], *fresh[:20]):
                assert await store.read(trace.request_id) == trace.events
        finally:
            await store.close()
        placed = await connection.fetch(
            "SELECT tableoid::regclass::text AS partition, count(DISTINCT request_id) AS requests"
            " FROM request_events GROUP BY 1 ORDER BY 1"
        )
        assert {row["partition"]: row["requests"] for row in placed} == {
            "request_events_legacy": len(previous),
            f"request_events_p{day:%Y%m%d}": len(fresh),
        }
    finally:
        await connection.close()
    await fold_agrees(url)


async def test_a_conversion_stopped_half_way_runs_again(empty_database_url: str) -> None:
    """Stopped in its second step (outside any transaction), 0007 has committed its first
    and may leave an invalid index behind; run again, it completes."""
    url = empty_database_url
    await migrate.upgrade_async(url, PREVIOUS)
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for number in range(20):
            await append_as_before(connection, scenario(number).events, PREVIOUS_INSERT_EVENTS)
        await connection.execute("ALTER TABLE request_attempts DROP CONSTRAINT request_attempts_request_id_fkey")
        for table in ("request_events", "requests", "request_attempts"):
            await connection.execute(f"ALTER TABLE {table} ADD COLUMN accepted_on date NOT NULL DEFAULT '2026-11-01'")
        # a unique build that failed, as a cancelled CREATE INDEX CONCURRENTLY leaves it: invalid
        with pytest.raises(asyncpg.UniqueViolationError):
            await connection.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY request_events_stream_part_key_legacy ON request_events (type)"
            )
        await migrate.upgrade_async(url, "0007")
        assert await migrate.current_revision_async(url) == "0007"
        assert await count(connection, "request_events_legacy") == sum(len(scenario(n).events) for n in range(20))
    finally:
        await connection.close()
    await fold_agrees(url)


async def test_the_store_appends_through_the_conversion(empty_database_url: str) -> None:
    """This release's store on a log still at 0006 (a rolling upgrade, before `phasegate db
    upgrade`) appends with 0006's statements; its drivers go on appending, one event at a
    time, while the log is converted, and its writer takes the new statements at the
    switch. Requests that straddle the switch end in the legacy partition; nothing is lost."""
    url = empty_database_url
    await migrate.upgrade_async(url, PREVIOUS)
    store = await PostgresEventStore.connect(url)
    upgraded = asyncio.Event()
    done: list[traces.Trace] = []

    async def driver(lane: int) -> None:
        number, after = 0, 0
        while after < 3:  # whole requests begun after the conversion
            after += upgraded.is_set()
            trace = scenario(lane * 10_000 + number)
            for seq, event in enumerate(trace.events):
                await store.append(trace.request_id, seq, [event], durable=seq < 3)
                if seq == 0:
                    await store.record_input(trace.request_id, {"model": "tiny-llm", "lane": lane})
                await asyncio.sleep(0.001)
            done.append(trace)
            number += 1

    try:
        assert not store.writer.schema.partitioned
        drivers = asyncio.gather(*(driver(lane) for lane in range(8)))
        async with asyncio.timeout(30):  # some requests whole before the conversion, however slow the machine
            while len(done) < 8:
                await asyncio.sleep(0.01)
        before = len(done)
        await migrate.upgrade_async(url)
        upgraded.set()
        await drivers
        await store.flush()
        assert store.writer.schema.partitioned
        assert 0 < before < len(done)
    finally:
        await store.close()
    fresh = await PostgresEventStore.connect(url)
    try:
        for trace in done:
            assert await fresh.read(trace.request_id) == trace.events
            assert await fresh.read_input(trace.request_id) is not None
    finally:
        await fresh.close()
    await fold_agrees(url)
