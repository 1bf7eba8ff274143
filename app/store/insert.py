"""How rows get into ``request_events``: one statement per batch, its own transaction.

One row is a plain ``INSERT … VALUES``; a few are an ``INSERT … SELECT FROM unnest(…)``
of column arrays; many are a binary ``COPY``, which costs less CPU per event on both
sides (``ops/bench/eventlog.py``; figures: docs/performance.md). The INSERTs skip events already
recorded (``ON CONFLICT (event_id) DO NOTHING``: a retried append is a no-op); COPY
cannot, so a batch that repeats one fails and the writer writes it again by INSERT.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import asyncpg

from app.store.codec import EventRow

# One event, the common durable append: plain VALUES skip building and unpacking the
# arrays (figures: docs/performance.md).
INSERT_EVENT = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::text::jsonb)
ON CONFLICT (event_id) DO NOTHING
"""

INSERT_EVENTS = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
SELECT request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body::jsonb
  FROM unnest($1::text[], $2::integer[], $3::uuid[], $4::text[], $5::smallint[],
              $6::integer[], $7::integer[], $8::timestamptz[], $9::text[])
       AS batch(request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
ON CONFLICT (event_id) DO NOTHING
"""
COPY_FROM = 64  # events in a batch from which COPY is cheaper than INSERT


async def insert_rows(conn: asyncpg.Connection, rows: Sequence[EventRow], *, copy: bool) -> None:
    """Insert ``rows`` in one statement; ``copy``: COPY may be used (a batch without retried events)."""
    if len(rows) == 1:
        await conn.execute(INSERT_EVENT, *rows[0])
    elif copy and len(rows) >= COPY_FROM:
        await conn.copy_records_to_table("request_events", records=rows, columns=EventRow._fields)
    else:
        await conn.execute(INSERT_EVENTS, *columns(rows))


def columns(rows: Iterable[EventRow]) -> list[list[object]]:
    """Rows to the INSERT's column arrays."""
    columns: list[list[object]] = [[] for _ in EventRow._fields]
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns
