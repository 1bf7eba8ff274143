"""A bulk load (COPY, the read models in one pass) builds exactly the read models that
the per-append trigger builds, and the partitions that maintenance makes, on real
PostgreSQL."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from app.store import PostgresEventStore
from app.store.audit import fold_disagreements
from app.store.bulk import load_events
from app.store.database import asyncpg_dsn
from app.store.partitions import PARTITIONED, ensure_days, partitions
from ops.seed import MODEL_REVISION, generate, seeded_requests, templates
from statemachine import events as ev

END = datetime(2026, 11, 30, 18, 0, tzinfo=UTC)
# ~350 requests over 29 minutes: every kind of the mix, and the last two minutes' in flight
SEED = {"events": 3500, "days": 0.02, "end": END, "policy": "full", "seed": 7}
# every table the projection trigger writes (requests, request_attempts), and the loaded ones
TABLES = {
    "requests": "request_id",
    "request_attempts": "request_id, attempt",
    "request_events": "request_id, version",
    "request_inputs": "request_id",
}
# what the database adds on its own (when it recorded, which transaction, where in the log)
SKIPPED = {"request_events": "position, recorded_at, txid", "request_inputs": "recorded_at"}

INDEXES = "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1, 2"
CONSTRAINTS = (
    "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), convalidated FROM pg_constraint"
    " WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2"
)
# the legacy partition's bound moves (a fresh log's is empty): compared apart
BOUNDS = (
    "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_class c"
    " WHERE c.relispartition AND c.relnamespace = 'public'::regnamespace ORDER BY 1"
)


def day_of(name: str) -> str | None:
    """The day a partition's table, index or constraint name is of (``_pYYYYMMDD``)."""
    for table in PARTITIONED:
        if name.startswith(f"{table}_p") and name[len(table) + 2 : len(table) + 10].isdigit():
            return name[len(table) + 2 : len(table) + 10]
    return None


def of_day(rows: list[asyncpg.Record], day: str) -> list[tuple[str, ...]]:
    """The rows of day ``day``'s partitions (by their table), with the day written as ``D``."""
    return sorted(tuple(str(value).replace(day, "D") for value in row) for row in rows if day_of(row[0]) == day)


def not_of(rows: list[asyncpg.Record], days: set[str]) -> list[asyncpg.Record]:
    return [row for row in rows if day_of(row[0]) not in days]


async def snapshot(connection: asyncpg.Connection) -> dict[str, list[asyncpg.Record]]:
    found = {}
    for table, key in TABLES.items():
        columns = await connection.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = $1 ORDER BY ordinal_position",
            table,
        )
        skipped = set(SKIPPED.get(table, "").replace(" ", "").split(","))
        kept = ", ".join(c["column_name"] for c in columns if c["column_name"] not in skipped)
        found[table] = await connection.fetch(f"SELECT {kept} FROM {table} ORDER BY {key}")
    return found


async def test_a_bulk_load_builds_the_read_models_the_triggers_build(database_url: str, tmp_path: Path) -> None:
    requests = list(seeded_requests(**SEED))  # type: ignore[arg-type]
    kinds = Counter(type(e).__name__ for r in requests for e in r.events)
    # every kind of event the seed's templates hold, so every branch of the projection is compared
    assert {type(e).__name__ for t in templates(random.Random(SEED["seed"]))[0] for e in t.events} <= set(kinds)
    assert {
        "AttemptFenced",
        "LeaseExpired",
        "AttemptReleased",
        "UpstreamFailed",
        "CancelAcked",
        "ToolCallEmitted",
        "DeltasProduced",
        "ClientDisconnected",
        "ClientResumed",
        "ResumeGraceExpired",
        "RequestFailed",
        "RequestCancelled",
    } <= set(kinds)
    assert sum(not any(isinstance(e, ev.RequestAccepted) for e in r.events[1:]) for r in requests) == len(requests)

    # through the trigger, as a gateway appends: one event at a time, group-committed across requests
    store = await PostgresEventStore.connect(database_url, content_policy=SEED["policy"])
    try:
        for request in requests:
            for seq, event in enumerate(request.events):
                await store.append(request.request_id, seq, [event], durable=False)
        await asyncio.gather(
            *(store.record_input(r.request_id, r.body, model_revision=MODEL_REVISION, seed=r.seed) for r in requests)
        )
        await store.flush()
    finally:
        await store.close()
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        by_triggers = await snapshot(connection)
        indexes = await connection.fetch(INDEXES)
        constraints = await connection.fetch(CONSTRAINTS)
        await connection.execute("TRUNCATE request_events, request_attempts, requests, request_inputs")

        # in bulk: the same requests as COPY text, each day loaded into tables of its own
        generated = generate(tmp_path, **SEED)  # type: ignore[arg-type]
        times = await load_events(connection, list(generated.days.values()))
        assert times.events == generated.events == sum(kinds.values())
        in_bulk = await snapshot(connection)
        loaded = {f"{day:%Y%m%d}" for day in generated.days}
        # a day of maintenance's making, far from the loaded ones, to compare a loaded day with
        made = date(2030, 1, 1)
        await ensure_days(connection, [made])
        bulk_indexes, bulk_constraints = await connection.fetch(INDEXES), await connection.fetch(CONSTRAINTS)
        bounds = {row[0]: row[1] for row in await connection.fetch(BOUNDS)}
        legacy_end = {p.end for table in PARTITIONED for p in await partitions(connection, table) if not p.first_day}
        trigger_enabled = await connection.fetchval(
            "SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'request_events_project'"
        )
        day_triggers = await connection.fetch(  # each day's own projection (0010)
            "SELECT tgrelid::regclass::text, tgname FROM pg_trigger WHERE tgname LIKE 'request_events\\_%\\_day'"
        )
    finally:
        await connection.close()
    # every other table, index and constraint as it was; each loaded day's as maintenance makes a day
    assert not_of(bulk_indexes, loaded | {f"{made:%Y%m%d}"}) == not_of(indexes, loaded)
    assert not_of(bulk_constraints, loaded | {f"{made:%Y%m%d}"}) == not_of(constraints, loaded)
    for day in loaded:
        assert of_day(bulk_indexes, day) == of_day(bulk_indexes, f"{made:%Y%m%d}")
        assert of_day(bulk_constraints, day) == of_day(bulk_constraints, f"{made:%Y%m%d}")
        for table in PARTITIONED:
            low = datetime.strptime(day, "%Y%m%d").date()
            assert bounds[f"{table}_p{day}"] == f"FOR VALUES FROM ('{low}') TO ('{low + timedelta(days=1)}')"
    for day in (*loaded, f"{made:%Y%m%d}"):
        assert sorted(name for table, name in day_triggers if table == f"request_events_p{day}") == [
            "request_events_guard_day",
            "request_events_project_day",
        ]
    # the legacy partition (empty in a fresh log) now ends where the loaded days begin
    assert legacy_end == {min(generated.days)}
    assert trigger_enabled == "O"  # on again for the appends that follow
    for table in TABLES:
        assert len(in_bulk[table]) == len(by_triggers[table]) > 0, table
        for bulk_row, trigger_row in zip(in_bulk[table], by_triggers[table], strict=True):
            assert dict(bulk_row) == dict(trigger_row), table
    open_requests = [r for r in in_bulk["requests"] if r["outcome"] is None]
    assert 0 < len(open_requests) < len(requests)


async def test_a_loaded_log_agrees_with_the_fold(database_url: str, tmp_path: Path) -> None:
    generated = generate(tmp_path, **{**SEED, "policy": "digest"})  # type: ignore[arg-type]
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await load_events(connection, list(generated.days.values()))
        texts = await connection.fetchval(
            "SELECT count(*) FROM request_events WHERE type = 'DeltasDelivered' AND body->>'text' IS NOT NULL"
        )
        assert texts == 0  # the digest policy keeps no delivered text
    finally:
        await connection.close()
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as db:
            assert await fold_disagreements(db) == []
    finally:
        await engine.dispose()


async def test_a_load_that_breaks_a_stream_leaves_nothing(database_url: str, tmp_path: Path) -> None:
    generated = generate(tmp_path, **{**SEED, "events": 200})  # type: ignore[arg-type]
    (rows,) = generated.days.values()
    assert isinstance(rows.events, Path)
    lines = rows.events.read_text().splitlines(keepends=True)
    rows.events.write_text("".join(lines[:3] + lines[4:]))  # a version skipped
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        partitions_before = await connection.fetch(BOUNDS)
        with pytest.raises(asyncpg.PostgresError, match="does not follow the stream"):
            await load_events(connection, [rows])
        assert await connection.fetchval("SELECT count(*) FROM request_events") == 0
        assert await connection.fetch(BOUNDS) == partitions_before
        assert (
            await connection.fetchval("SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'request_events_project'")
            == "O"
        )
    finally:
        await connection.close()


async def test_a_load_into_a_log_with_rows_goes_through_the_parents(database_url: str, tmp_path: Path) -> None:
    first = generate(tmp_path / "first", **SEED)  # type: ignore[arg-type]
    # other requests (another seed), two days later: a day of their own among the first load's
    later = {**SEED, "seed": 8, "end": END + timedelta(days=2)}
    second = generate(tmp_path / "second", **later)  # type: ignore[arg-type]
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await load_events(connection, list(first.days.values()))  # into the empty log: apart
        times = await load_events(connection, list(second.days.values()))  # through the parents
        assert times.events == second.events
        assert await connection.fetchval("SELECT count(*) FROM request_events") == first.events + second.events
        assert await connection.fetchval("SELECT count(*) FROM requests") == first.requests + second.requests
        assert await connection.fetchval("SELECT count(*) FROM request_inputs") == first.requests + second.requests
        assert (
            await connection.fetchval("SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'request_events_project'")
            == "O"
        )
    finally:
        await connection.close()
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as db:
            assert await fold_disagreements(db) == []
    finally:
        await engine.dispose()
