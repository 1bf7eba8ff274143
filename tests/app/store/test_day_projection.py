"""A day's partition of the log projects into that day's read models alone (migration
0010): appended straight into it, a batch is projected and guarded exactly as through
the parent, and maintenance makes, closes and drops each day's projection with its
partitions."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from datetime import UTC, date, datetime, time, timedelta

import asyncpg
import pytest

from app.store import PostgresEventStore, migrate, partitions
from app.store.codec import EventRow, to_row
from app.store.database import asyncpg_dsn
from app.store.errors import STREAM_GAP_SQLSTATE
from app.store.insert import LogSchema, insert_rows
from ops import traces

KINDS: list[Callable[..., traces.Trace]] = [
    traces.completed,
    traces.retried_before_first_delta,
    traces.fenced_then_retried,
    traces.cancelled_by_client,
    traces.interrupted_in_decode,
    traces.stalled_in_decode,
]
# what differs between two requests projected from the same events
NAMED = {"request_id", "idempotency_key"}


@pytest.fixture
async def connection(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield conn
    finally:
        await conn.close()


async def a_day_of_its_own(connection: asyncpg.Connection) -> date:
    """A day with partitions of its own: the first after the legacy partition's."""
    (legacy,) = [p for p in await partitions.partitions(connection, "request_events") if p.first_day is None]
    return legacy.end


def rows_on(trace: traces.Trace, day: date) -> list[EventRow]:
    return [to_row(event, day) for event in trace.events]


def traced(prefix: str, day: date) -> list[traces.Trace]:
    at = datetime.combine(day, time(12), tzinfo=UTC)
    return [kind(f"{prefix}_{number}", at=at) for number, kind in enumerate(KINDS)]


async def projections_called(connection: asyncpg.Connection) -> dict[str, int]:
    await connection.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, flushed once idle
    rows = await connection.fetch(
        "SELECT funcname, calls FROM pg_stat_user_functions WHERE funcname LIKE 'project_request_events%'"
    )
    return {row["funcname"]: row["calls"] for row in rows}


async def read_models(connection: asyncpg.Connection, table: str, prefix: str) -> list[dict[str, object]]:
    order = "request_id, attempt" if table == "request_attempts" else "request_id"
    rows = await connection.fetch(f"SELECT * FROM {table} WHERE request_id LIKE $1 ORDER BY {order}", f"{prefix}\\_%")
    return [{key: value for key, value in row.items() if key not in NAMED} for row in rows]


async def test_a_days_own_projection_is_the_parents_but_for_the_tables_it_names(
    connection: asyncpg.Connection,
) -> None:
    parent = await connection.fetchval("SELECT pg_get_functiondef('project_request_events()'::regprocedure)")
    days = await connection.fetch(
        "SELECT proname, pg_get_functiondef(oid) AS definition FROM pg_proc"
        " WHERE proname ~ '^project_request_events_p[0-9]{8}$'"
    )
    assert len(days) == 3  # the conversion day and the two after it (0007)
    for day in days:
        suffix = day["proname"].removeprefix("project_request_events")
        expected = re.sub(r"\brequests\b", f"requests{suffix}", parent)
        expected = re.sub(r"\brequest_attempts\b", f"request_attempts{suffix}", expected)
        expected = expected.replace("project_request_events()", f"{day['proname']}()")
        assert day["definition"] == expected
        assert f"requests{suffix} r" in day["definition"]


async def test_appends_straight_into_a_day_are_projected_as_through_the_parent(
    connection: asyncpg.Connection,
) -> None:
    day = await a_day_of_its_own(connection)
    schema = LogSchema()
    await schema.learn(connection)
    assert schema.days[day] == f"request_events_p{day:%Y%m%d}"
    await connection.execute("SET track_functions = 'pl'")
    for prefix, chosen in (("parent", None), ("day", schema)):
        for trace in traced(prefix, day):  # two events at a time, as a gateway appends them
            rows = rows_on(trace, day)
            for start in range(0, len(rows), 2):
                await insert_rows(connection, rows[start : start + 2], copy=False, schema=chosen)
        # and one group commit of many requests, by COPY
        many = [row for trace in traced(f"{prefix}many", day) for row in rows_on(trace, day)]
        assert len(many) >= 64
        await insert_rows(connection, many, copy=True, schema=chosen)
    # a rolling upgrade: the previous release (through the parent) and this one (into the
    # day) append in turn to the same requests
    for trace in traced("mixed", day):
        rows = rows_on(trace, day)
        for start in range(0, len(rows), 2):
            chosen = schema if start % 4 else None
            await insert_rows(connection, rows[start : start + 2], copy=False, schema=chosen)
    called = await projections_called(connection)
    assert called.get(f"project_request_events_p{day:%Y%m%d}", 0) > len(KINDS)  # the day's own ran
    assert called.get("project_request_events", 0) > len(KINDS)  # and the parent's, for the others
    for table in ("requests", "request_attempts"):
        through_parent = await read_models(connection, table, "parent")
        assert len(through_parent) >= len(KINDS)
        assert await read_models(connection, table, "day") == through_parent
        assert await read_models(connection, table, "mixed") == through_parent
        assert await read_models(connection, table, "daymany") == await read_models(connection, table, "parentmany")


async def test_the_stores_writer_appends_straight_into_the_day(database_url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        database = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{database}\" SET track_functions = 'pl'")  # the writer's session counts
        day = await a_day_of_its_own(conn)
        trace = traces.completed("req_written", at=datetime.combine(day, time(12), tzinfo=UTC))
        store = await PostgresEventStore.connect(database_url)
        try:
            assert store.writer.schema.days.get(day) == f"request_events_p{day:%Y%m%d}"
            for number, event in enumerate(trace.events):
                await store.append(trace.request_id, number, [event], durable=True)
        finally:
            await store.close()
        ours = f"project_request_events_p{day:%Y%m%d}"
        called = await projections_called(conn)
        for _ in range(100):  # the writer's backend flushes its counts as it exits, after close() returned
            if called.get(ours, 0) >= len(trace.events):
                break
            await asyncio.sleep(0.05)
            called = await projections_called(conn)
        assert called.get(ours) == len(trace.events)
        assert "project_request_events" not in called
        assert await conn.fetchval("SELECT outcome FROM requests WHERE request_id = 'req_written'") == "completed"
    finally:
        await conn.close()


async def test_a_batch_of_two_days_goes_through_the_parent(connection: asyncpg.Connection) -> None:
    first = await a_day_of_its_own(connection)
    second = first + timedelta(days=1)  # made by the migration too, with its own projection
    schema = LogSchema()
    await schema.learn(connection)
    assert {first, second} <= schema.days.keys()
    await connection.execute("SET track_functions = 'pl'")
    before = await projections_called(connection)
    batch = [
        *rows_on(traces.completed("req_midnight_a", at=datetime.combine(first, time(23, 59), tzinfo=UTC)), first),
        *rows_on(traces.completed("req_midnight_b", at=datetime.combine(second, time(0, 1), tzinfo=UTC)), second),
    ]
    assert await schema.table_for(connection, batch) == "request_events"
    await insert_rows(connection, batch, copy=False, schema=schema)
    called = await projections_called(connection)
    assert called.get("project_request_events", 0) == before.get("project_request_events", 0) + 1
    for day in (first, second):
        ours = f"project_request_events_p{day:%Y%m%d}"
        assert called.get(ours, 0) == before.get(ours, 0)
    rows = await connection.fetch(
        "SELECT request_id, tableoid::regclass::text AS partition, outcome FROM requests"
        " WHERE request_id LIKE 'req_midnight_%' ORDER BY 1"
    )
    assert [(row["partition"], row["outcome"]) for row in rows] == [
        (f"requests_p{first:%Y%m%d}", "completed"),
        (f"requests_p{second:%Y%m%d}", "completed"),
    ]


async def test_the_guards_hold_on_a_days_own_partition(connection: asyncpg.Connection) -> None:
    day = await a_day_of_its_own(connection)
    schema = LogSchema()
    await schema.learn(connection)
    rows = rows_on(traces.completed("req_guarded", at=datetime.combine(day, time(12), tzinfo=UTC)), day)
    await insert_rows(connection, rows[:2], copy=False, schema=schema)
    # the stream guard: a batch must start right after the request's last version
    with pytest.raises(asyncpg.PostgresError) as gap:
        await insert_rows(connection, rows[3:5], copy=False, schema=schema)
    assert gap.value.sqlstate == STREAM_GAP_SQLSTATE
    # the instance guard: a fenced instance appends nothing
    await connection.execute("SELECT set_config('phasegate.instance', 'gw_gone', false)")
    with pytest.raises(asyncpg.PostgresError) as fenced:
        await insert_rows(connection, rows[2:4], copy=False, schema=schema)
    assert fenced.value.sqlstate == "PG410"
    await connection.execute("SELECT set_config('phasegate.instance', '', false)")
    await insert_rows(connection, rows[2:4], copy=False, schema=schema)
    assert await connection.fetchval("SELECT last_seq FROM requests WHERE request_id = 'req_guarded'") == 4
    assert await connection.fetchval("SELECT count(*) FROM request_events WHERE request_id = 'req_guarded'") == 4


async def test_maintenance_makes_a_days_projection_then_closes_and_drops_it(
    connection: asyncpg.Connection,
) -> None:
    later = await a_day_of_its_own(connection) + timedelta(days=10)
    done = await partitions.maintain(connection, on=later, days_ahead=0, wait=True)
    assert f"request_events_p{later:%Y%m%d}" in done.created
    schema = LogSchema()
    await schema.learn(connection)
    assert later in schema.days
    rows = rows_on(traces.completed("req_later", at=datetime.combine(later, time(12), tzinfo=UTC)), later)
    await insert_rows(connection, rows[:2], copy=False, schema=schema)

    # made once: maintenance again leaves the day's function and triggers as they are
    made = await day_objects(connection, later)
    await partitions.maintain(connection, on=later, days_ahead=0, wait=True)
    assert await day_objects(connection, later) == made

    # closed for retention: an append is refused as the parent refuses a day with no partition
    await connection.execute("SELECT phasegate_close_day($1)", later)
    await connection.execute("SELECT phasegate_day_projections()")  # which leaves a closed day closed
    with pytest.raises(asyncpg.CheckViolationError) as closed:
        await insert_rows(connection, rows[2:4], copy=False, schema=schema)
    never = later + timedelta(days=400)  # a day with no partition
    accepted = rows_on(traces.completed("req_never", at=datetime.combine(never, time(12), tzinfo=UTC)), never)[:1]
    with pytest.raises(asyncpg.CheckViolationError) as no_partition:
        await insert_rows(connection, accepted, copy=False)
    assert closed.value.message == no_partition.value.message  # the writer takes it as the same refusal
    assert await connection.fetchval("SELECT last_seq FROM requests WHERE request_id = 'req_later'") == 2

    done = await partitions.maintain(
        connection, on=later + timedelta(days=3), days_ahead=0, retention_days=1, wait=True
    )
    assert f"request_events_p{later:%Y%m%d}" in done.dropped
    assert await connection.fetchval("SELECT to_regproc($1)", f"project_request_events_p{later:%Y%m%d}") is None
    # a writer that still knew the day appends through the parent, which refuses the dropped day
    with pytest.raises(asyncpg.UndefinedTableError):
        await insert_rows(connection, rows[2:4], copy=False, schema=schema)
    assert later not in schema.days
    with pytest.raises(asyncpg.CheckViolationError):
        await insert_rows(connection, rows[2:4], copy=False, schema=schema)


async def day_objects(connection: asyncpg.Connection, day: date) -> list[tuple[object, ...]]:
    """The row versions of ``day``'s projection function and triggers: made again, they change."""
    rows = await connection.fetch(
        "SELECT 'function', xmin::text FROM pg_proc WHERE proname = $1"
        " UNION ALL SELECT tgname, xmin::text FROM pg_trigger WHERE tgrelid = to_regclass($2) ORDER BY 1",
        f"project_request_events_p{day:%Y%m%d}",
        f"request_events_p{day:%Y%m%d}",
    )
    assert len(rows) == 3
    return [tuple(row) for row in rows]


async def test_a_change_to_the_parents_projection_reaches_every_day(connection: asyncpg.Connection) -> None:
    day = await a_day_of_its_own(connection)
    parent = await connection.fetchval("SELECT pg_get_functiondef('project_request_events()'::regprocedure)")
    marked = parent.replace("RETURN NULL;", "RETURN NULL;  -- a later migration's change", 1)
    assert marked != parent
    await connection.execute(marked)
    assert await connection.fetchval("SELECT phasegate_day_projections()") == 3
    ours = await connection.fetchval(
        "SELECT pg_get_functiondef($1::regprocedure)", f"project_request_events_p{day:%Y%m%d}()"
    )
    assert "a later migration's change" in ours
    assert f"UPDATE requests_p{day:%Y%m%d} r SET" in ours


async def test_downgrade_takes_the_days_projections_away_and_upgrade_makes_them_again(database_url: str) -> None:
    await migrate.downgrade_async(database_url, "0009")
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'request_events_%_day'") == 0
        assert await conn.fetchval("SELECT count(*) FROM pg_proc WHERE proname LIKE 'project_request_events_p%'") == 0
        assert await conn.fetchval("SELECT count(*) FROM pg_proc WHERE proname LIKE 'phasegate_%day%'") == 0
        await migrate.upgrade_async(database_url)
        assert await conn.fetchval("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'request_events_%_day'") == 6
        assert await conn.fetchval("SELECT count(*) FROM pg_proc WHERE proname LIKE 'project_request_events_p%'") == 3
    finally:
        await conn.close()
