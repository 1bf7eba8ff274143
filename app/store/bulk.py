"""Loading many events at once: COPY, then the read models built in one set-based pass.

How this works: appends project each batch into ``requests`` and ``request_attempts``
through the statement trigger ``request_events_project`` (migrations/, 0001 and
0002). Run per batch over millions of events, that costs more than the load itself, so
:func:`load_events` disables the trigger, COPYs the rows in, and then builds the
read models once over everything it loaded, set-based: one ``INSERT ... SELECT`` of
the trigger's aggregates per table, each row written once (:mod:`app.store.bulk_projection`,
which says how). The trigger's function, run over the loaded rows as one batch, did
the same work with an UPDATE of every row it had just inserted, and was most of the
load's time. A test holds the bulk build and the trigger's row-for-row equal, and the
bulk build keeps the trigger's stream guard (``PG409`` on a gap).

All of it is one transaction holding the log's ``ACCESS EXCLUSIVE`` lock, so no
gateway appends meanwhile (they wait) and a failed load leaves nothing behind. Meant
for a fresh log (``ops/seed.py``); the loaded requests must be new ones. Into an empty
log it takes PostgreSQL's bulk-loading path ("Populating a Database" in its manual):
the tables are truncated in the loading transaction (under ``wal_level=minimal``
nothing is WAL-logged; COPY cannot ``FREEZE`` rows into a partitioned table), and their secondary indexes
(and foreign key) are dropped and built again at the end, one sort each instead of a
million inserts (one join instead of a check per row).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import asyncpg

from app.store.bulk_projection import PROJECT_ATTEMPTS, PROJECT_REQUESTS, REFUSE
from app.store.codec import EventRow
from app.store.partitions import ensure_days

TRIGGER = "request_events_project"
INPUT_COLUMNS = ("request_id", "body", "model_revision", "seed", "accepted_on")
TABLES = ("request_events", "requests", "request_attempts", "request_inputs")

# The secondary indexes of the loaded tables (not their primary keys, which the
# projection's joins and request_attempts' foreign key use), as statements that drop
# and re-create each: a unique constraint through ALTER TABLE, a plain index as itself.
_SECONDARY_INDEXES = """
SELECT i.indexrelid::regclass::text AS index, t.relname AS table_name, c.conname,
       pg_get_constraintdef(c.oid) AS constraint_def, pg_get_indexdef(i.indexrelid) AS index_def
  FROM pg_index i
  JOIN pg_class t ON t.oid = i.indrelid
  LEFT JOIN pg_constraint c ON c.conindid = i.indexrelid AND c.conrelid = i.indrelid
 WHERE t.relname = ANY($1::text[]) AND t.relnamespace = 'public'::regnamespace AND NOT i.indisprimary
   AND t.relkind = 'r'  -- a partitioned table's indexes stay: see _drop_secondary_indexes
 ORDER BY 1
"""

# Their foreign keys (request_attempts' on requests): one join validates a re-added key,
# where a key in place checks each of a hundred thousand inserted rows on its own.
_FOREIGN_KEYS = """
SELECT t.relname AS table_name, c.conname, pg_get_constraintdef(c.oid) AS constraint_def
  FROM pg_constraint c
  JOIN pg_class t ON t.oid = c.conrelid
 WHERE t.relname = ANY($1::text[]) AND t.relnamespace = 'public'::regnamespace AND c.contype = 'f'
 ORDER BY 1, 2
"""


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """What a load took, in seconds, and the events it loaded."""

    events: int
    copy_s: float  # COPY of the events (and of the recorded inputs, if any)
    project_s: float  # the read models, in one pass
    index_s: float  # the secondary indexes and foreign keys built again (into an empty log)


async def load_events(
    connection: asyncpg.Connection,
    events: Path | AsyncIterable[bytes],
    *,
    inputs: Path | AsyncIterable[bytes] | None = None,
    days: Iterable[date] = (),
    work_mem: str = "256MB",
) -> LoadTimes:
    """COPY ``events`` (text format, :data:`EventRow` columns) into ``request_events``
    and ``inputs`` (text format, :data:`INPUT_COLUMNS`) into ``request_inputs``, then
    build the read models of the loaded requests; see the module docstring. ``days``:
    the accept days of the loaded requests, whose partitions are made if missing."""
    async with connection.transaction():
        await connection.execute(f"LOCK TABLE {', '.join(TABLES)} IN ACCESS EXCLUSIVE MODE")
        await connection.execute(f"SET LOCAL work_mem = '{work_mem}'")
        await connection.execute(f"SET LOCAL maintenance_work_mem = '{work_mem}'")
        await ensure_days(connection, list(days))
        empty = all([await connection.fetchval(f"SELECT NOT EXISTS (SELECT FROM {table})") for table in TABLES])
        rebuild: list[str] = []
        if empty:
            await connection.execute(f"TRUNCATE {', '.join(TABLES)}")
            rebuild = await _drop_secondary_indexes(connection)
        before = int(await connection.fetchval("SELECT coalesce(max(position), 0) FROM request_events"))
        await connection.execute(f"ALTER TABLE request_events DISABLE TRIGGER {TRIGGER}")
        began = time.perf_counter()
        columns = list(EventRow._fields)
        # COPY FREEZE cannot fill a partitioned table: the log's rows are written unfrozen
        await connection.copy_to_table("request_events", source=events, columns=columns)
        if inputs is not None:
            await connection.copy_to_table("request_inputs", source=inputs, columns=list(INPUT_COLUMNS))
        copied = time.perf_counter()
        loaded = int(await connection.fetchval("SELECT count(*) FROM request_events WHERE position > $1", before))
        # statistics for what was just loaded: without them the projection's joins are
        # planned for a few hundred rows (nested loops over millions)
        await connection.execute("ANALYZE request_events")
        await project_loaded(connection, after_position=before)
        projected = time.perf_counter()
        for statement in rebuild:
            await connection.execute(statement)
        await connection.execute(f"ALTER TABLE request_events ENABLE TRIGGER {TRIGGER}")
        indexed = time.perf_counter()
    return LoadTimes(loaded, copied - began, projected - copied, indexed - projected)


async def _drop_secondary_indexes(connection: asyncpg.Connection) -> list[str]:
    """Drop the loaded tables' secondary indexes and foreign keys; the statements that
    build them again (the keys last, once the indexes are back). Not those of the
    partitioned tables (migration 0007): a partition's index attached to its parent's
    cannot be dropped alone, and dropped with the parent's it would be built again
    under another name, so the legacy partition's indexes would lose 0006's names."""
    rebuild = []
    for index in await connection.fetch(_SECONDARY_INDEXES, list(TABLES)):
        if index["conname"] is not None:
            table, name = index["table_name"], index["conname"]
            await connection.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
            rebuild.append(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {index["constraint_def"]}')
        else:
            await connection.execute(f"DROP INDEX {index['index']}")
            rebuild.append(index["index_def"])
    for key in await connection.fetch(_FOREIGN_KEYS, list(TABLES)):
        table, name = key["table_name"], key["conname"]
        await connection.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
        rebuild.append(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {key["constraint_def"]}')
    return rebuild


async def project_loaded(connection: asyncpg.Connection, *, after_position: int) -> None:
    """Build the read models of the events after ``after_position``, whose requests
    must be new, as the trigger would project them as one batch: see
    :mod:`app.store.bulk_projection`. Run inside the loading transaction."""
    position = int(after_position)
    await connection.execute(
        f"CREATE TEMPORARY VIEW new_events AS SELECT * FROM request_events WHERE position > {position}"
    )
    await connection.execute(REFUSE)
    await connection.execute(PROJECT_REQUESTS)
    await connection.execute(PROJECT_ATTEMPTS)
    await connection.execute("DROP FUNCTION pg_temp.refuse(text, text)")
    await connection.execute("DROP VIEW pg_temp.new_events")
