"""Loading many events at once: COPY, then the read models built in one set-based pass.

How this works: appends project each batch into ``requests`` and ``request_attempts``
through the statement trigger ``request_events_project`` (migrations/, 0001 and
0002). Run per batch over millions of events, that costs more than the load itself, so
:func:`load_events` disables the trigger, COPYs the rows in, and then runs the very
same projection once over everything it loaded, as if it were one batch: the trigger's
function, read back from PostgreSQL (``pg_get_functiondef``), is created again as a
temporary function whose ``new_events`` is a temporary view over the loaded rows. One
projection, so the bulk build cannot drift from the triggers' (a later migration that
replaces the function is picked up as it is); the trigger's own stream guard checks
every loaded stream (``PG409`` on a gap). A test holds the two builds row-for-row equal.

All of it is one transaction holding the log's ``ACCESS EXCLUSIVE`` lock, so no
gateway appends meanwhile (they wait) and a failed load leaves nothing behind. Meant
for a fresh log (``ops/seed.py``); the loaded requests must be new ones. Into an empty
log it takes PostgreSQL's bulk-loading path ("Populating a Database" in its manual):
the tables are truncated in the loading transaction (so COPY may ``FREEZE`` its rows,
and under ``wal_level=minimal`` nothing is WAL-logged), and their secondary indexes
are dropped and built again at the end, one sort each instead of a million inserts.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from app.store.codec import EventRow

TRIGGER = "request_events_project"
FUNCTION = "project_request_events"
INPUT_COLUMNS = ("request_id", "body", "model_revision", "seed")
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
 ORDER BY 1
"""


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """What a load took, in seconds, and the events it loaded."""

    events: int
    copy_s: float  # COPY of the events (and of the recorded inputs, if any)
    project_s: float  # the read models, in one pass
    index_s: float  # the secondary indexes built again (into an empty log)


async def load_events(
    connection: asyncpg.Connection,
    events: Path | AsyncIterable[bytes],
    *,
    inputs: Path | AsyncIterable[bytes] | None = None,
    work_mem: str = "256MB",
) -> LoadTimes:
    """COPY ``events`` (text format, :data:`EventRow` columns) into ``request_events``
    and ``inputs`` (text format, :data:`INPUT_COLUMNS`) into ``request_inputs``, then
    build the read models of the loaded requests; see the module docstring."""
    async with connection.transaction():
        await connection.execute(f"LOCK TABLE {', '.join(TABLES)} IN ACCESS EXCLUSIVE MODE")
        await connection.execute(f"SET LOCAL work_mem = '{work_mem}'")
        await connection.execute(f"SET LOCAL maintenance_work_mem = '{work_mem}'")
        empty = all([await connection.fetchval(f"SELECT NOT EXISTS (SELECT FROM {table})") for table in TABLES])
        rebuild: list[str] = []
        if empty:
            await connection.execute(f"TRUNCATE {', '.join(TABLES)}")
            rebuild = await _drop_secondary_indexes(connection)
        before = int(await connection.fetchval("SELECT coalesce(max(position), 0) FROM request_events"))
        await connection.execute(f"ALTER TABLE request_events DISABLE TRIGGER {TRIGGER}")
        began = time.perf_counter()
        columns = list(EventRow._fields)
        await connection.copy_to_table("request_events", source=events, columns=columns, freeze=empty)
        if inputs is not None:
            await connection.copy_to_table("request_inputs", source=inputs, columns=list(INPUT_COLUMNS), freeze=empty)
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
    """Drop the loaded tables' secondary indexes; the statements that build them again."""
    rebuild = []
    for index in await connection.fetch(_SECONDARY_INDEXES, list(TABLES)):
        if index["conname"] is not None:
            table, name = index["table_name"], index["conname"]
            await connection.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
            rebuild.append(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {index["constraint_def"]}')
        else:
            await connection.execute(f"DROP INDEX {index['index']}")
            rebuild.append(index["index_def"])
    return rebuild


async def project_loaded(connection: asyncpg.Connection, *, after_position: int) -> None:
    """Project the events after ``after_position`` into the read models, as the trigger
    would project them as one batch. Run inside the loading transaction."""
    await connection.execute(
        f"CREATE TEMPORARY VIEW new_events AS SELECT * FROM request_events WHERE position > {int(after_position)}"
    )
    await connection.execute(await _batch_function(connection))
    await connection.execute("SELECT pg_temp.project_loaded_events()")
    await connection.execute("DROP FUNCTION pg_temp.project_loaded_events()")
    await connection.execute("DROP VIEW pg_temp.new_events")


async def _batch_function(connection: asyncpg.Connection) -> str:
    """The trigger's function as a plain temporary one over the view ``new_events``."""
    definition: str = await connection.fetchval(f"SELECT pg_get_functiondef('{FUNCTION}'::regproc)")
    header, returns = r"FUNCTION\s+(?:public\.)?project_request_events\(\)", r"RETURNS\s+trigger"
    rewritten, renamed = re.subn(header, "FUNCTION pg_temp.project_loaded_events()", definition, count=1)
    rewritten, typed = re.subn(returns, "RETURNS void", rewritten, count=1)
    rewritten, returned = re.subn(r"RETURN\s+NULL\s*;", "RETURN;", rewritten)
    if (renamed, typed, returned) != (1, 1, 1) or re.search(r"\bTG_|\bNEW\b|\bOLD\b", rewritten):
        raise RuntimeError(f"{FUNCTION}() no longer has the shape the bulk load runs as one batch")
    return rewritten
