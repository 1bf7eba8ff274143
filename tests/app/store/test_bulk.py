"""A bulk load (COPY with the trigger off, the read models in one pass) builds exactly
the read models that the per-append trigger builds, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import io
import random
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from app.store import PostgresEventStore
from app.store.audit import fold_disagreements
from app.store.bulk import load_events
from app.store.database import asyncpg_dsn
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

        # in bulk: the same requests as COPY text, loaded with the trigger off
        events_text, inputs_text = io.StringIO(), io.StringIO()
        generated = generate(events_text, inputs_text, **SEED)
        (tmp_path / "events.copy").write_text(events_text.getvalue())
        (tmp_path / "inputs.copy").write_text(inputs_text.getvalue())
        times = await load_events(connection, tmp_path / "events.copy", inputs=tmp_path / "inputs.copy")
        assert times.events == generated.events == sum(kinds.values())
        in_bulk = await snapshot(connection)
        assert await connection.fetch(INDEXES) == indexes  # dropped for the load, built again
        assert await connection.fetch(CONSTRAINTS) == constraints  # the foreign key too
        trigger_enabled = await connection.fetchval(
            "SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'request_events_project'"
        )
    finally:
        await connection.close()
    assert trigger_enabled == "O"  # on again for the appends that follow
    for table in TABLES:
        assert len(in_bulk[table]) == len(by_triggers[table]) > 0, table
        for bulk_row, trigger_row in zip(in_bulk[table], by_triggers[table], strict=True):
            assert dict(bulk_row) == dict(trigger_row), table
    open_requests = [r for r in in_bulk["requests"] if r["outcome"] is None]
    assert 0 < len(open_requests) < len(requests)


async def test_a_loaded_log_agrees_with_the_fold(database_url: str, tmp_path: Path) -> None:
    events_path, inputs_path = tmp_path / "events.copy", tmp_path / "inputs.copy"
    with events_path.open("w") as events_file, inputs_path.open("w") as inputs_file:
        generate(events_file, inputs_file, **{**SEED, "policy": "digest"})
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await load_events(connection, events_path, inputs=inputs_path)
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
    events_text, inputs_text = io.StringIO(), io.StringIO()
    generate(events_text, inputs_text, **{**SEED, "events": 200})
    lines = events_text.getvalue().splitlines(keepends=True)
    (tmp_path / "events.copy").write_text("".join(lines[:3] + lines[4:]))  # a version skipped
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        with pytest.raises(asyncpg.PostgresError, match="does not follow the stream"):
            await load_events(connection, tmp_path / "events.copy")
        assert await connection.fetchval("SELECT count(*) FROM request_events") == 0
        assert (
            await connection.fetchval("SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'request_events_project'")
            == "O"
        )
    finally:
        await connection.close()
