"""``ops/chaos_check.py`` judges a chaos run by the log itself: which requests were
accepted and which never ended, whatever the read models say (they may trail the log,
docs/design.md §8; here nothing projects at all)."""

from __future__ import annotations

import asyncio

import asyncpg

from app.store import PostgresEventStore
from app.store.database import asyncpg_dsn
from ops import traces
from ops.chaos_check import accepted, never_ended, until_all_ended


async def test_the_verdict_reads_the_log_not_the_read_models(database_url: str) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:  # read models that trail: no row is made
        days = await connection.fetch(
            "SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname = 'request_events_project_day'"
        )
        for (table,) in days:
            await connection.execute(f"ALTER TABLE {table} DISABLE TRIGGER request_events_project_day")
        await connection.execute("ALTER TABLE request_events DISABLE TRIGGER request_events_project")
        store = await PostgresEventStore.connect(database_url)
        try:
            ended, *open_ones = (
                traces.completed("req_ended"),
                traces.in_flight("req_open"),
                traces.in_flight("req_late"),
            )
            for trace in (ended, *open_ones):
                await store.append(trace.request_id, 0, trace.events)
            assert await connection.fetchval("SELECT count(*) FROM requests") == 0
            assert await accepted(database_url) == ["req_ended", "req_late", "req_open"]
            assert await never_ended(database_url) == ["req_late", "req_open"]
            waiting = asyncio.create_task(until_all_ended(database_url, timeout_s=60.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            for trace in open_ones:  # their sweep: each ends
                before = len(trace.events)
                await store.append(trace.request_id, before, trace.completed().events[before:])
            await asyncio.wait_for(waiting, timeout=10.0)
            assert await never_ended(database_url) == []
        finally:
            await store.close()
    finally:
        await connection.close()
