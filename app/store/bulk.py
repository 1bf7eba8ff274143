"""Loading many events at once: COPY, then the read models built in one set-based pass.

How this works: appends project each batch into ``requests`` and ``request_attempts``
through the statement trigger ``request_events_project`` (migrations/, 0001 and
0002). Run per batch over millions of events, that costs more than the load itself, so
:func:`load_events` does not go through it: it COPYs the rows in and then builds the
read models once over everything it loaded, set-based: one ``INSERT ... SELECT`` of
the trigger's aggregates per table, each row written once (:mod:`app.store.bulk_projection`,
which says how). A test holds the bulk build and the trigger's row-for-row equal, and
the bulk build keeps the trigger's stream guard (``PG409`` on a gap).

All of it is one transaction holding the log's ``ACCESS EXCLUSIVE`` lock, so no
gateway appends meanwhile (they wait) and a failed load leaves nothing behind. Meant
for a fresh log (``ops/seed.py``); the loaded requests must be new ones. The rows come
one accept day at a time (:class:`DayRows`), since the tables are partitioned by it
(migration 0007), and two ways:

- **into an empty log**, PostgreSQL's bulk-loading path ("Populating a Database" in its
  manual), a day at a time: each table's day is a plain table created in the loading
  transaction, with a ``CHECK`` of the day's bound; the day's rows are COPYed in
  ``FREEZE`` (written once, already frozen: no later pass rewrites every page, and
  under ``wal_level=minimal`` nothing is WAL-logged), its read models written into
  their own day tables, the parents' indexes built on each (one sort each, no index
  maintained row by row; a partial index, which holds few rows, is made before the rows
  come, since building it afterwards reads the whole day again), and then each is
  attached as the day's partition: the
  ``CHECK`` spares the attach its scan and the indexes built are adopted, named as a
  partition made by ``phasegate db maintain`` names them. The empty partitions the
  loaded days replace are dropped, and the legacy partition (everything before the
  conversion, empty in a fresh log) ends where the loaded days begin;
- **into a log with rows**, COPY into the parents with the trigger off (each row to its
  partition, every index maintained), then the read models of the loaded rows.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, replace
from datetime import date, timedelta
from pathlib import Path

import asyncpg

from app.store.bulk_projection import PROJECT_ATTEMPTS, PROJECT_REQUESTS, REFUSE, into
from app.store.codec import EventRow
from app.store.partitions import PARTITIONED, drop, ensure_days, partitions, project_day

TRIGGER = "request_events_project"
INPUT_COLUMNS = ("request_id", "body", "model_revision", "seed", "accepted_on")
TABLES = ("request_events", "requests", "request_attempts", "request_inputs")
_STORAGE = {"requests": " WITH (fillfactor = 80)"}  # as 0001 made the table (and maintenance its days)

# A parent's indexes, as statements that build each on a day's table: a unique
# constraint through ALTER TABLE, a plain index as itself, both left unnamed so that
# PostgreSQL names them as the attach would have (what maintenance's partitions get).
_PARENT_INDEXES = """
SELECT pg_get_constraintdef(c.oid) AS constraint_def, pg_get_indexdef(i.indexrelid) AS index_def,
       i.indpred IS NOT NULL AS partial
  FROM pg_index i
  LEFT JOIN pg_constraint c ON c.conindid = i.indexrelid AND c.conrelid = i.indrelid
 WHERE i.indrelid = $1::regclass
 ORDER BY i.indexrelid
"""
_INDEX_HEAD = re.compile(r"^CREATE (UNIQUE )?INDEX \S+ ON ONLY \S+ ")


@dataclass(frozen=True, slots=True)
class DayRows:
    """The rows of the requests accepted on ``day``, as COPY text: ``events`` in
    :data:`EventRow`'s columns, ``inputs`` (if any) in :data:`INPUT_COLUMNS`."""

    day: date
    events: Path | AsyncIterable[bytes]
    inputs: Path | AsyncIterable[bytes] | None = None


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """What a load took, in seconds, and the events it loaded."""

    events: int
    copy_s: float  # COPY of the events (and of the recorded inputs, if any)
    project_s: float  # the read models, in one pass
    index_s: float  # the indexes built and the day tables attached (into an empty log)
    total_s: float = 0.0  # the whole load, from its lock to its commit


async def load_events(connection: asyncpg.Connection, days: Sequence[DayRows], *, work_mem: str = "256MB") -> LoadTimes:
    """COPY each day's rows (:class:`DayRows`) into ``request_events`` and
    ``request_inputs``, then build the read models of the loaded requests; see the
    module docstring."""
    began = time.perf_counter()
    async with connection.transaction():
        await connection.execute(f"LOCK TABLE {', '.join(TABLES)} IN ACCESS EXCLUSIVE MODE")
        await connection.execute(f"SET LOCAL work_mem = '{work_mem}'")
        await connection.execute(f"SET LOCAL maintenance_work_mem = '{work_mem}'")
        empty = all([await connection.fetchval(f"SELECT NOT EXISTS (SELECT FROM {table})") for table in TABLES])
        if empty and days:
            times = await _load_apart(connection, sorted(days, key=lambda rows: rows.day))
        else:
            times = await _load_through_parents(connection, days)
    return replace(times, total_s=time.perf_counter() - began)


async def _load_through_parents(connection: asyncpg.Connection, days: Sequence[DayRows]) -> LoadTimes:
    await ensure_days(connection, [rows.day for rows in days])
    before = int(await connection.fetchval("SELECT coalesce(max(position), 0) FROM request_events"))
    await connection.execute(f"ALTER TABLE request_events DISABLE TRIGGER {TRIGGER}")
    began = time.perf_counter()
    loaded = 0
    for rows in days:
        loaded += await _copy(connection, "request_events", rows.events, EventRow._fields)
        if rows.inputs is not None:
            await _copy(connection, "request_inputs", rows.inputs, INPUT_COLUMNS)
    copied = time.perf_counter()
    # statistics for what was just loaded: without them the projection's joins are
    # planned for a few hundred rows (nested loops over millions)
    await connection.execute("ANALYZE request_events")
    await project_loaded(connection, after_position=before)
    await connection.execute(f"ALTER TABLE request_events ENABLE TRIGGER {TRIGGER}")
    return LoadTimes(loaded, copied - began, time.perf_counter() - copied, 0.0)


async def _load_apart(connection: asyncpg.Connection, days: Sequence[DayRows]) -> LoadTimes:
    """Into an empty log: each day in tables of its own, attached once built."""
    await connection.execute(f"TRUNCATE {', '.join(TABLES)}")
    loaded_days = [rows.day for rows in days]
    await _make_room(connection, loaded_days[0], loaded_days[-1])
    indexes = {table: await _index_statements(connection, table) for table in PARTITIONED}
    # a partial index holds few rows: kept as they come costs less than reading the day again
    early = {table: [statement for statement, partial in built if partial] for table, built in indexes.items()}
    late = {table: [statement for statement, partial in built if not partial] for table, built in indexes.items()}
    position = await connection.fetchval("SELECT pg_get_serial_sequence('request_events', 'position')")
    await connection.execute(REFUSE)
    loaded, copy_s, project_s, index_s = 0, 0.0, 0.0, 0.0
    for rows in days:
        began = time.perf_counter()
        tables = {table: f"{table}_p{rows.day:%Y%m%d}" for table in PARTITIONED}
        for table, name in tables.items():
            bound = f"accepted_on >= '{rows.day}' AND accepted_on < '{rows.day + timedelta(days=1)}'"
            await connection.execute(
                f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS,"
                f" CONSTRAINT {name}_bound CHECK ({bound})){_STORAGE.get(table, '')}"
            )
            for statement in early[table]:
                await connection.execute(statement.replace("{table}", name))
        # the parent's identity, attached or not: one order of positions over all days
        events = tables["request_events"]
        await connection.execute(f"ALTER TABLE {events} ALTER COLUMN position SET DEFAULT nextval('{position}')")
        loaded += await _copy(connection, events, rows.events, EventRow._fields, freeze=True)
        if rows.inputs is not None:
            await _copy(connection, tables["request_inputs"], rows.inputs, INPUT_COLUMNS, freeze=True)
        await connection.execute(f"ALTER TABLE {events} ALTER COLUMN position DROP DEFAULT")
        copied = time.perf_counter()
        await _project(connection, events, requests=tables["requests"], attempts=tables["request_attempts"])
        projected = time.perf_counter()
        for table, name in tables.items():
            for statement in late[table]:
                await connection.execute(statement.replace("{table}", name))
            await connection.execute(
                f"ALTER TABLE {table} ATTACH PARTITION {name}"
                f" FOR VALUES FROM ('{rows.day}') TO ('{rows.day + timedelta(days=1)}')"
            )
            await connection.execute(f"ALTER TABLE {name} DROP CONSTRAINT {name}_bound")
        await project_day(connection, rows.day)
        copy_s, project_s = copy_s + copied - began, project_s + projected - copied
        index_s += time.perf_counter() - projected
    await connection.execute("DROP FUNCTION pg_temp.refuse(text, text)")
    # the days between the loaded ones, if any, get their (empty) partitions too
    span = [loaded_days[0] + timedelta(days=n) for n in range((loaded_days[-1] - loaded_days[0]).days + 1)]
    await ensure_days(connection, sorted(set(span) - set(loaded_days)))
    return LoadTimes(loaded, copy_s, project_s, index_s)


async def _make_room(connection: asyncpg.Connection, first: date, last: date) -> None:
    """In an empty log, make the days ``first`` to ``last`` free for tables of their
    own: the partition from the start (the legacy one) ends at ``first``, and the empty
    partitions within those days are dropped."""
    for table in PARTITIONED:
        for partition in await partitions(connection, table):
            if partition.first_day is None:
                if partition.end > first:
                    await connection.execute(f"ALTER TABLE {table} DETACH PARTITION {partition.name}")
                    await connection.execute(
                        f"ALTER TABLE {table} ATTACH PARTITION {partition.name}"
                        f" FOR VALUES FROM (MINVALUE) TO ('{first}')"
                    )
            elif partition.first_day <= last and partition.end > first:
                await connection.execute(f"ALTER TABLE {table} DETACH PARTITION {partition.name}")
                await drop(connection, partition)


async def _index_statements(connection: asyncpg.Connection, table: str) -> list[tuple[str, bool]]:
    """The statements that build ``table``'s indexes on a table ``{table}``, each with
    whether the index is partial."""
    statements = []
    for index in await connection.fetch(_PARENT_INDEXES, table):
        if index["constraint_def"] is not None:
            statement = f"ALTER TABLE {{table}} ADD {index['constraint_def']}"
        else:
            head = _INDEX_HEAD.match(index["index_def"])
            assert head is not None, index["index_def"]
            statement = f"CREATE {head[1] or ''}INDEX ON {{table}} {index['index_def'][head.end() :]}"
        statements.append((statement, index["partial"]))
    return statements


async def _copy(
    connection: asyncpg.Connection,
    table: str,
    source: Path | AsyncIterable[bytes],
    columns: Sequence[str],
    *,
    freeze: bool = False,
) -> int:
    """COPY ``source`` into ``table``; the rows copied."""
    status = await connection.copy_to_table(table, source=source, columns=list(columns), freeze=freeze)
    return int(status.split()[-1])


async def _project(connection: asyncpg.Connection, events: str, *, requests: str, attempts: str) -> None:
    """Write the read models of the rows of ``events`` (a table, or a table and a
    condition on its rows) into ``requests`` and ``attempts``."""
    await connection.execute(f"CREATE TEMPORARY VIEW new_events AS SELECT * FROM {events}")
    await connection.execute(into(PROJECT_REQUESTS, requests=requests))
    await connection.execute(into(PROJECT_ATTEMPTS, requests=requests, request_attempts=attempts))
    await connection.execute("DROP VIEW pg_temp.new_events")


async def project_loaded(connection: asyncpg.Connection, *, after_position: int) -> None:
    """Build the read models of the events after ``after_position``, whose requests
    must be new, as the trigger would project them as one batch: see
    :mod:`app.store.bulk_projection`. Run inside the loading transaction."""
    position = int(after_position)
    await connection.execute(REFUSE)
    await _project(
        connection,
        f"request_events WHERE position > {position}",
        requests="requests",
        attempts="request_attempts",
    )
    await connection.execute("DROP FUNCTION pg_temp.refuse(text, text)")
