"""``ops/bench/commit_point.py`` measures what it says on a real log: every way of each
append a sample a request, EXPLAIN's parts with the day's projection trigger among them, and
the report printed whole (the test database loads no pg_stat_statements: that table is
said to be missing, not left out silently)."""

from __future__ import annotations

import asyncpg
import pytest

from app.store import PostgresEventStore
from app.store.database import asyncpg_dsn
from ops.bench.commit_point import KINDS, WAYS, measure, report
from statemachine import events as ev


async def test_each_append_is_measured_every_way_and_lands_in_the_log(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    found = await measure(database_url, 2)
    for kind in KINDS:
        assert {way: len(found.results[kind][way]) for way in WAYS} == dict.fromkeys(WAYS, 2)
        assert all(seconds > 0 for way in WAYS for seconds in found.results[kind][way])
        (first, second) = found.explains[kind]
        assert first.keys() == second.keys() >= {"planning", "executor", "trigger request_events_project_day"}
    # the store's appends are real ones: the commit point's events, then the delivery
    store = await PostgresEventStore.connect(database_url)
    try:
        stored = await store.read("store-d-1")
    finally:
        await store.close()
    assert [type(e) for e in stored[2:]] == [ev.FirstTokenReceived, ev.FirstDeltaCommitted, ev.DeltasDelivered]
    # each way in appended the same events; only the bare way's were not projected
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        for way in ("day", "parent", "bare"):
            versions = await conn.fetch(f"SELECT version FROM request_events WHERE request_id = '{way}-d-1' ORDER BY 1")
            assert [row[0] for row in versions] == [1, 2, 3, 4, 5]
            projected = await conn.fetchval(f"SELECT last_seq FROM requests WHERE request_id = '{way}-d-1'")
            assert projected == (None if way == "bare" else 5)
    finally:
        await conn.close()
    report(found, 2)
    printed = capsys.readouterr().out
    assert "commit point" in printed and "delivery batch" in printed and "no pg_stat_statements here" in printed
