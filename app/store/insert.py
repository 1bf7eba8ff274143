"""How rows get into ``request_events``: one statement per batch, its own transaction.

One row is a plain ``INSERT … VALUES``; a few are an ``INSERT … SELECT FROM unnest(…)``
of column arrays; many are a binary ``COPY``, which costs less CPU per event on both
sides (``ops/bench/eventlog.py``; figures: docs/performance.md). The INSERTs skip events already
recorded (``ON CONFLICT (event_id, accepted_on) DO NOTHING``: a retried append is a no-op); COPY
cannot, so a batch that repeats one fails and the writer writes it again by INSERT.

Every row names its partition, ``accepted_on`` (migration 0007). A row whose day the
store does not know (an append to a request another process accepted: a sweep, a
resume's bookkeeping) takes it from the log, in the same statement: the day of the
request's ``RequestAccepted`` (version 1), never from a read model, which docs/design.md §8 lets
trail the log. The lookup runs only for such rows; COPY cannot, so such a batch goes by
INSERT.

A batch whose rows are all of one day goes straight into that day's partition of
``request_events`` when the partition carries the day's projection (migration 0010): its
statements name that day's read models alone, so the append costs the same however many
days are kept. Any other batch (several days, a day looked up, the legacy partition, a
day whose triggers are not made yet) goes through the parent, whose triggers do the same
on every day. :class:`LogSchema` knows the days, and looks again (at most every
:data:`DAYS_LOOKED_UP_EVERY_S`) when a batch names one it does not know.

A log not yet converted (schema 0006: this release started before ``phasegate db
upgrade``, in a rolling upgrade) takes 0006's statements, which name no day
(:class:`LogSchema`); once the conversion's switch is done they are refused
(SQLSTATE 42P10: no unique index on ``event_id`` alone), and the writer looks again.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Sequence
from datetime import date

import asyncpg

from app.store.codec import EventRow

# The day of the request's first event (the stream key's index of each day, probed),
# else any day will do: with no RequestAccepted in the log the stream guard refuses
# the append (PG409) as it did before partitions.
ACCEPTED_ON = """coalesce({day}, (SELECT accepted.accepted_on FROM request_events accepted
                                    WHERE accepted.request_id = {request_id} AND accepted.version = 1 LIMIT 1),
                 (now() AT TIME ZONE 'UTC')::date)"""

# One event, the common durable append: plain VALUES skip building and unpacking the
# arrays (figures: docs/performance.md). Its day named: a statement that may look the
# day up costs more even when it does not (the lookup's plan locks every day's
# partition of requests at each execution), so that one is taken only when needed.
INSERT_EVENT = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body, accepted_on)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::text::jsonb, $10::date)
ON CONFLICT (event_id, accepted_on) DO NOTHING
"""
INSERT_EVENT_LOOKUP = f"""
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body, accepted_on)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::text::jsonb, {ACCEPTED_ON.format(day="$10::date", request_id="$1")})
ON CONFLICT (event_id, accepted_on) DO NOTHING
"""

_INSERT_EVENTS = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body, accepted_on)
SELECT request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body::jsonb,
       {accepted_on}
  FROM unnest($1::text[], $2::integer[], $3::uuid[], $4::text[], $5::smallint[],
              $6::integer[], $7::integer[], $8::timestamptz[], $9::text[], $10::date[])
       AS batch(request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body,
                accepted_on)
ON CONFLICT (event_id, accepted_on) DO NOTHING
"""
INSERT_EVENTS = _INSERT_EVENTS.format(accepted_on="batch.accepted_on")
INSERT_EVENTS_LOOKUP = _INSERT_EVENTS.format(
    accepted_on=ACCEPTED_ON.format(day="batch.accepted_on", request_id="batch.request_id")
)
COPY_FROM = 64  # events in a batch from which COPY is cheaper than INSERT

# 0006's statements, word for word, for a log not yet partitioned
PREVIOUS_INSERT_EVENT = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::text::jsonb)
ON CONFLICT (event_id) DO NOTHING
"""
PREVIOUS_INSERT_EVENTS = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
SELECT request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body::jsonb
  FROM unnest($1::text[], $2::integer[], $3::uuid[], $4::text[], $5::smallint[],
              $6::integer[], $7::integer[], $8::timestamptz[], $9::text[])
       AS batch(request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
ON CONFLICT (event_id) DO NOTHING
"""
_FIELDS = EventRow._fields[:9]
_PARENT = "INSERT INTO request_events\n"


DAYS_LOOKED_UP_EVERY_S = 10.0  # a day not known to have its partition's projection is looked for again after
_DAY_PARTITIONS = """
SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
 WHERE t.tgname = 'request_events_project_day'
"""
_DAY_PARTITION = re.compile(r"request_events_p(\d{8})")


class LogSchema:
    """Whether ``request_events`` is partitioned (0007) or not yet (0006): which statements
    append; and which days' partitions take appends straight in (0010)."""

    def __init__(self) -> None:
        self.partitioned = True
        self.days: dict[date, str] = {}  # day -> its partition of request_events, with the day's projection
        self._days_looked_up = -DAYS_LOOKED_UP_EVERY_S

    async def learn(self, conn: asyncpg.Connection) -> None:
        self.partitioned = bool(
            await conn.fetchval("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass('request_events')")
        )
        await self._learn_days(conn)

    async def table_for(self, conn: asyncpg.Connection, rows: Sequence[EventRow]) -> str:
        """Where ``rows`` are appended: their day's partition, or the parent."""
        day = rows[0].accepted_on
        if day is None or any(row.accepted_on != day for row in rows):
            return "request_events"
        if day not in self.days and time.monotonic() - self._days_looked_up >= DAYS_LOOKED_UP_EVERY_S:
            await self._learn_days(conn)
        return self.days.get(day, "request_events")

    def forget(self, table: str) -> None:
        """``table`` was not there (dropped past retention): append through the parent."""
        self.days = {day: known for day, known in self.days.items() if known != table}

    async def _learn_days(self, conn: asyncpg.Connection) -> None:
        self._days_looked_up = time.monotonic()
        days = {}
        for (name,) in await conn.fetch(_DAY_PARTITIONS):
            match = _DAY_PARTITION.fullmatch(name)
            if match is not None:
                days[date.fromisoformat(match[1])] = name
        self.days = days


async def insert_rows(
    conn: asyncpg.Connection, rows: Sequence[EventRow], *, copy: bool, schema: LogSchema | None = None
) -> None:
    """Insert ``rows`` in one statement; ``copy``: COPY may be used (a batch without retried
    events). With no ``schema`` they go through the parent."""
    if schema is not None and not schema.partitioned:
        try:
            await _insert_undayed(conn, rows, copy=copy)
            return
        except asyncpg.InvalidColumnReferenceError:  # 0007's switch was just done: look again
            await schema.learn(conn)
            if not schema.partitioned:
                raise
    table = "request_events" if schema is None else await schema.table_for(conn, rows)
    try:
        await _insert_dayed(conn, rows, copy=copy, table=table)
    except asyncpg.UndefinedTableError:
        if schema is not None:
            schema.forget(table)  # the next try goes through the parent, which says why
        raise


async def _insert_dayed(conn: asyncpg.Connection, rows: Sequence[EventRow], *, copy: bool, table: str) -> None:
    dayed = all(row.accepted_on is not None for row in rows)
    if len(rows) == 1:
        statement = INSERT_EVENT if dayed else INSERT_EVENT_LOOKUP
        await conn.execute(into(statement, table), *rows[0])
    elif copy and len(rows) >= COPY_FROM and dayed:
        await conn.copy_records_to_table(table, records=rows, columns=EventRow._fields)
    else:
        await conn.execute(into(INSERT_EVENTS if dayed else INSERT_EVENTS_LOOKUP, table), *columns(rows))


@functools.cache
def into(statement: str, table: str) -> str:
    """``statement`` (one of this module's INSERTs) appending to ``table`` (a day's
    partition) instead of the parent."""
    return statement if table == "request_events" else statement.replace(_PARENT, f"INSERT INTO {table}\n", 1)


async def _insert_undayed(conn: asyncpg.Connection, rows: Sequence[EventRow], *, copy: bool) -> None:
    undayed = [row[:9] for row in rows]
    if len(rows) == 1:
        await conn.execute(PREVIOUS_INSERT_EVENT, *undayed[0])
    elif copy and len(rows) >= COPY_FROM:
        await conn.copy_records_to_table("request_events", records=undayed, columns=_FIELDS)
    else:
        await conn.execute(PREVIOUS_INSERT_EVENTS, *[list(column) for column in zip(*undayed, strict=True)])


def columns(rows: Iterable[EventRow]) -> list[list[object]]:
    """Rows to the INSERT's column arrays."""
    columns: list[list[object]] = [[] for _ in EventRow._fields]
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns
