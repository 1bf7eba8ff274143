"""The log's day partitions: appends land in their request's day, ``maintain`` makes
days ahead and drops whole days past retention, archived first."""

from __future__ import annotations

import asyncio
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from app import cli
from app.incident.trace_io import read_trace
from app.store import PostgresEventStore, partitions
from app.store.audit import fold_disagreements
from app.store.database import asyncpg_dsn
from ops import traces


async def connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url))


async def conversion_day(connection: asyncpg.Connection) -> date:
    """The day the test's database was converted: the first after its legacy partition."""
    (legacy,) = [p for p in await partitions.partitions(connection, "request_events") if p.first_day is None]
    return legacy.end


async def where_rows_are(connection: asyncpg.Connection, request_id: str) -> dict[str, set[str]]:
    """The partitions holding ``request_id``'s rows, per table."""
    found = {}
    for table in partitions.PARTITIONED:
        rows = await connection.fetch(f"SELECT tableoid::regclass::text FROM {table} WHERE request_id = $1", request_id)
        found[table] = {row[0] for row in rows}
    return found


def noon(day: date) -> datetime:
    return datetime.combine(day, time(12), tzinfo=UTC)


async def test_every_row_of_a_request_lands_in_its_accept_days_partitions(database_url: str) -> None:
    connection = await connect(database_url)
    try:
        day = await conversion_day(connection) + timedelta(days=1)  # made by the migration
        trace = traces.fenced_then_retried("req_day", at=noon(day) - timedelta(seconds=1))
        store = await PostgresEventStore.connect(database_url)
        try:
            await store.append(trace.request_id, 0, trace.events[:3])
            await store.record_input(trace.request_id, {"model": "tiny-llm"})  # the day the store knows
        finally:
            await store.close()
        # a store that did not accept it (another gateway's sweep): the INSERT looks the day up
        store = await PostgresEventStore.connect(database_url)
        try:
            await store.append(trace.request_id, 3, trace.events[3:4])  # one row: VALUES
            await store.append(trace.request_id, 4, trace.events[4:])  # several: unnest
            assert await store.read(trace.request_id) == trace.events
        finally:
            await store.close()
        suffix = f"_p{day:%Y%m%d}"
        assert await where_rows_are(connection, trace.request_id) == {
            table: {table + suffix} for table in partitions.PARTITIONED
        }
    finally:
        await connection.close()


async def test_an_input_whose_day_the_store_knows_is_written_without_reading_the_log(database_url: str) -> None:
    """A statement that may look the day up plans and locks every day's partition of the
    log (so it costs more the more days are kept: ops/bench/studies/inputs_days.py); an input of a
    request accepted here names its day and is written with the log locked away."""
    trace = traces.completed("req_input_day", at=datetime.now(UTC))
    store = await PostgresEventStore.connect(database_url)
    locker = await connect(database_url)
    try:
        await store.append(trace.request_id, 0, trace.events[:1])
        async with locker.transaction():
            await locker.execute("LOCK TABLE request_events IN ACCESS EXCLUSIVE MODE")
            await asyncio.wait_for(store.record_input(trace.request_id, {"model": "tiny-llm"}), timeout=30)
        assert (await store.read_input(trace.request_id)) is not None
    finally:
        await locker.close()
        await store.close()


async def test_the_day_of_a_request_the_store_did_not_accept_comes_from_the_log_not_its_row(
    database_url: str,
) -> None:
    """docs/design.md §8 lets the read models trail the log: the accept day an append looks up
    is the day of the request's RequestAccepted, whether or not its row is there yet."""
    connection = await connect(database_url)
    try:
        day = await conversion_day(connection) + timedelta(days=1)  # not today: a fallback to today would show
        # read models that trail: nothing projects, so the request has no row at all
        await connection.execute("ALTER TABLE request_events DISABLE TRIGGER request_events_project")
        await connection.execute(f"ALTER TABLE request_events_p{day:%Y%m%d} DISABLE TRIGGER request_events_project_day")
        trace = traces.fenced_then_retried("req_day_from_log", at=noon(day))
        store = await PostgresEventStore.connect(database_url)
        try:
            await store.append(trace.request_id, 0, trace.events[:3])
        finally:
            await store.close()
        store = await PostgresEventStore.connect(database_url)  # another gateway's: the day looked up
        try:
            await store.append(trace.request_id, 3, trace.events[3:4])  # one row: VALUES
            await store.append(trace.request_id, 4, trace.events[4:])  # several: unnest
            await store.record_input(trace.request_id, {"model": "tiny-llm"})
            assert await store.read(trace.request_id) == trace.events
        finally:
            await store.close()
        suffix = f"_p{day:%Y%m%d}"
        assert await where_rows_are(connection, trace.request_id) == {
            "request_events": {"request_events" + suffix},
            "requests": set(),
            "request_attempts": set(),
            "request_inputs": {"request_inputs" + suffix},
        }
    finally:
        await connection.close()


async def test_a_request_of_the_past_lands_in_the_legacy_partition(event_store: PostgresEventStore) -> None:
    trace = traces.completed("req_old")  # accepted 2026-11-30, before any test database was converted
    await event_store.append(trace.request_id, 0, trace.events)
    await event_store.record_input(trace.request_id, {"model": "tiny-llm"})
    connection = await connect(event_store.url)
    try:
        assert await where_rows_are(connection, trace.request_id) == {
            table: {f"{table}_legacy"} for table in partitions.PARTITIONED
        }
    finally:
        await connection.close()


async def test_maintain_makes_days_ahead_once(database_url: str) -> None:
    connection = await connect(database_url)
    try:
        converted = await conversion_day(connection)
        done = await partitions.maintain(connection, days_ahead=5, on=converted)
        assert done.created == [
            f"{table}_p{converted + timedelta(days=n):%Y%m%d}" for n in (3, 4, 5) for table in partitions.PARTITIONED
        ]
        assert (await partitions.maintain(connection, days_ahead=5, on=converted)).created == []
        # a gap (the gateway was down for days) is filled from today on
        later = await partitions.maintain(connection, days_ahead=1, on=converted + timedelta(days=9))
        assert len(later.created) == 2 * len(partitions.PARTITIONED)
    finally:
        await connection.close()


async def test_retention_archives_then_drops_whole_days(database_url: str, tmp_path: Path) -> None:
    connection = await connect(database_url)
    store = await PostgresEventStore.connect(database_url)
    try:
        converted = await conversion_day(connection)
        kept_day = converted + timedelta(days=6)
        await partitions.maintain(connection, days_ahead=6, on=converted)
        requests = {
            "req_legacy": traces.completed("req_legacy"),
            "req_next_day": traces.with_tool_call("req_next_day", at=noon(converted + timedelta(days=1))),
            "req_kept": traces.fenced_then_retried("req_kept", at=noon(kept_day)),
        }
        for trace in requests.values():
            await store.append(trace.request_id, 0, trace.events)
            await store.record_input(trace.request_id, {"model": "tiny-llm"})

        # on kept_day + 2 with 2 days kept: every day before kept_day goes, legacy included
        done = await partitions.maintain(
            connection, days_ahead=1, retention_days=2, archive_dir=tmp_path, on=kept_day + timedelta(days=2)
        )
        gone = [converted + timedelta(days=n) for n in range(6)]
        assert sorted(done.dropped) == sorted(
            [f"{table}_legacy" for table in partitions.PARTITIONED]
            + [f"{table}_p{day:%Y%m%d}" for day in gone for table in partitions.PARTITIONED]
        )
        remaining = {p.name for p in await partitions.partitions(connection, "request_events")}
        assert min(remaining) == f"request_events_p{kept_day:%Y%m%d}"
        assert await store.read("req_legacy") == [] and await store.read("req_next_day") == []
        assert await store.read("req_kept") == requests["req_kept"].events
        assert await connection.fetchval("SELECT count(*) FROM requests") == 1
        assert await connection.fetchval("SELECT array_agg(request_id) FROM request_inputs") == ["req_kept"]

        # each day's events were written first, as a trace that reads back as they were
        assert sorted(path.name for path in done.archived) == sorted(
            ["request_events_legacy.jsonl"] + [f"request_events_p{day:%Y%m%d}.jsonl" for day in gone]
        )
        assert not list(tmp_path.glob("*.partial"))
        archived = read_trace(str(tmp_path / f"request_events_p{converted + timedelta(days=1):%Y%m%d}.jsonl"))
        assert archived.events == requests["req_next_day"].events
        assert read_trace(str(tmp_path / "request_events_legacy.jsonl")).events == requests["req_legacy"].events

        # and the log goes on
        fresh = traces.completed("req_after", at=noon(kept_day + timedelta(days=2)))
        await store.append(fresh.request_id, 0, fresh.events)
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as db:
                assert await fold_disagreements(db) == []
        finally:
            await engine.dispose()
    finally:
        await store.close()
        await connection.close()


async def test_an_append_between_a_days_archive_and_its_detach_is_archived_too(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed day refuses appends straight into it; one through the parent (a store that
    did not accept the request) lands until the day's read models are detached. Retention
    counts the detached log partition and writes its archive again: nothing is dropped
    unarchived."""
    connection = await connect(database_url)
    try:
        converted = await conversion_day(connection)
        day = converted + timedelta(days=1)
        trace = traces.completed("req_late", at=noon(day))
        store = await PostgresEventStore.connect(database_url)
        try:
            await store.append(trace.request_id, 0, trace.events[:-1])
        finally:
            await store.close()
        archive = partitions.archive
        late = []

        async def archive_then_append(conn: asyncpg.Connection, partition: partitions.Partition, to: Path) -> object:
            archived = await archive(conn, partition, to)
            if partition.first_day == day and not late:
                other = await PostgresEventStore.connect(database_url)  # its day looked up: through the parent
                try:
                    late.append(await other.append(trace.request_id, len(trace.events) - 1, trace.events[-1:]))
                finally:
                    await other.close()
            return archived

        monkeypatch.setattr(partitions, "archive", archive_then_append)
        done = await partitions.maintain(
            connection, days_ahead=1, retention_days=1, archive_dir=tmp_path, on=day + timedelta(days=2)
        )
        assert late == [len(trace.events)]  # the append did land, after the day's first archive
        assert f"request_events_p{day:%Y%m%d}" in done.dropped
        assert read_trace(str(tmp_path / f"request_events_p{day:%Y%m%d}.jsonl")).events == trace.events
        assert not list(tmp_path.glob("*.partial"))
    finally:
        await connection.close()


async def test_maintenance_runs_one_at_a_time(database_url: str) -> None:
    connections = [await connect(database_url) for _ in range(4)]
    try:
        converted = await conversion_day(connections[0])
        runs = await asyncio.gather(
            *(partitions.maintain(c, days_ahead=8, on=converted, wait=False) for c in connections[:2]),
            *(partitions.maintain(c, days_ahead=8, on=converted, wait=True) for c in connections[2:]),
        )
        created = [name for run in runs for name in run.created]
        assert len(created) == len(set(created)) == 6 * len(partitions.PARTITIONED)
        assert all(not run.skipped for run in runs[2:])  # those that waited ran, and found it done
    finally:
        for connection in connections:
            await connection.close()


async def interrupted_detach(
    name: str, reader: asyncpg.Connection, detacher: asyncpg.Connection, connection: asyncpg.Connection
) -> None:
    """Leave ``requests``' partition ``name`` "detach pending", as a crash would: a
    reader's open snapshot holds the detach in its second transaction, where it is
    cancelled."""
    reader_transaction = reader.transaction()
    await reader_transaction.start()
    await reader.fetch("SELECT 1 FROM requests LIMIT 1")
    detach = asyncio.ensure_future(detacher.execute(f"ALTER TABLE requests DETACH PARTITION {name} CONCURRENTLY"))
    while not [p for p in await partitions.partitions(connection, "requests") if p.detach_pending]:
        await asyncio.sleep(0.05)
    await connection.execute("SELECT pg_cancel_backend($1)", detacher.get_server_pid())
    with pytest.raises(asyncpg.QueryCanceledError):
        await detach
    await reader_transaction.rollback()


async def test_an_interrupted_detach_is_finished_by_the_next_run(database_url: str) -> None:
    reader, detacher, connection = [await connect(database_url) for _ in range(3)]
    try:
        converted = await conversion_day(connection)
        name = f"requests_p{converted + timedelta(days=1):%Y%m%d}"
        await interrupted_detach(name, reader, detacher, connection)

        done = await partitions.maintain(connection, days_ahead=1, on=converted)
        assert done.dropped == []  # not past retention: finished, and attached again, being a day ahead
        assert done.created == [name]
        assert not [p for p in await partitions.partitions(connection, "requests") if p.detach_pending]
        done = await partitions.maintain(connection, days_ahead=1, retention_days=1, on=converted)
        assert done.dropped == []  # nothing is past retention yet

        # past retention, a pending detach is finished and the table dropped
        await interrupted_detach(name, reader, detacher, connection)
        done = await partitions.maintain(connection, days_ahead=1, retention_days=1, on=converted + timedelta(days=3))
        assert name in done.dropped
        assert await connection.fetchval("SELECT to_regclass($1)", name) is None
    finally:
        for each in (reader, detacher, connection):
            await each.close()


def test_phasegate_db_maintain(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def missing() -> int:
        """The partitions of today and the 4 days ahead that are not there yet: the migrations
        made some ahead of the day they ran, which need not be today (a run across midnight)."""
        connection = await connect(database_url)
        try:
            wanted = {partitions.today() + timedelta(days=n) for n in range(5)}
            found = [await partitions.partitions(connection, table) for table in partitions.PARTITIONED]
            return sum(len(wanted - {p.first_day for p in each}) for each in found)
        finally:
            await connection.close()

    monkeypatch.setenv("DATABASE_URL", database_url)
    expected = asyncio.run(missing())
    assert expected >= len(partitions.PARTITIONED)  # the 4th day ahead, at least, is made here
    assert cli.main(["db", "maintain", "--days-ahead", "4"]) == 0
    assert capsys.readouterr().out.startswith(f"{expected} partitions created, 0 archived")
    assert asyncio.run(missing()) == 0
    assert cli.main(["db", "maintain", "--retention-days", "0"]) == 2


async def test_a_store_past_its_bound_of_accept_days_forgets_the_oldest_and_still_lands_its_rows(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.store.postgres._ACCEPT_DAYS_KEPT", 2)
    connection = await connect(database_url)
    try:
        day = await conversion_day(connection) + timedelta(days=1)
        accepted = [traces.fenced_then_retried(f"req_bound_{n}", at=noon(day)) for n in range(3)]
        store = await PostgresEventStore.connect(database_url)
        try:
            for trace in accepted:
                await store.append(trace.request_id, 0, trace.events[:3])
            # the first accepted is forgotten, in the order accepted; the two latest are kept
            assert list(store._accept_days) == ["req_bound_1", "req_bound_2"]
            for trace in accepted:  # the first's rows: its day looked up in the INSERT
                await store.append(trace.request_id, 3, trace.events[3:])
                assert await store.read(trace.request_id) == trace.events
        finally:
            await store.close()
        for trace in accepted:
            rows = await where_rows_are(connection, trace.request_id)
            assert rows["request_events"] == {f"request_events_p{day:%Y%m%d}"}
    finally:
        await connection.close()
