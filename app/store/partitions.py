"""The log's day partitions: made ahead of need, and dropped whole past retention.

How this works: ``request_events``, ``requests``, ``request_attempts`` and
``request_inputs`` are partitioned by ``accepted_on``, the UTC day a request was
accepted (migration 0007): one partition
a day per table, ``<table>_pYYYYMMDD``, and ``<table>_legacy`` holding everything up to
the day the log was converted. :func:`maintain` (``phasegate db maintain``, and every
gateway hourly) does two things, under one advisory lock so that several gateways
running it at once take turns (a busy lock: someone else is doing it, skip):

- **ahead**: today's partitions and the next ``days_ahead`` days', each created as a
  plain table and then attached, which takes only ``SHARE UPDATE EXCLUSIVE`` on the
  parent (appends and reads go on), where ``CREATE TABLE … PARTITION OF`` would wait
  behind every open reader with ``ACCESS EXCLUSIVE`` and stall the appends queued
  behind it; then the day's own projection, triggers on its partition of the log that
  name its read models alone (migration 0010);
- **retention** (``retention_days``; ``None`` keeps everything): a day whose
  partitions are entirely older than the retention is first written to
  ``archive_dir`` as a trace file (when set; the format of ``phasegate trace export``,
  :mod:`statemachine.trace`), once its own projection is closed to appends, then each
  table's partition is detached
  ``CONCURRENTLY`` (no lock that stops appends) and dropped. Never a ``DELETE``. The
  close stops appends straight into the day, not those through the parent, which
  stop once the day's ``requests`` is detached (the stream guard finds no row): the
  log's partition, detached last, is counted before its drop, and written again,
  whole, if an append came between the archive and the detach.

A detach interrupted half-way (a crash, a cancelled statement) leaves its partition
"detach pending"; the next run finishes it before anything else, and drops the table
only if it is past retention (a day ahead is attached again). Each DDL statement
waits at most ``lock_timeout_s`` for its lock and the run is tried again next time:
partitions are made days ahead, so a skipped run costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import asyncpg

from app.store.codec import from_row
from statemachine.trace import trace_header, trace_line

logger = logging.getLogger("phasegate.store.partitions")

PARTITIONED = ("request_events", "requests", "request_attempts", "request_inputs")
_LOCK_KEY = 0x70686173_6D61  # "phasma": one maintenance at a time, over every gateway
_STORAGE = {"requests": " WITH (fillfactor = 80)"}  # as 0001 made the table: room for HOT updates
_BOUND = re.compile(r"FROM \((?:'(?P<low>[0-9-]+)'|MINVALUE)\) TO \('(?P<high>[0-9-]+)'\)")

_HAS_DAY_PROJECTIONS = "SELECT to_regprocedure('phasegate_day_projection(date)') IS NOT NULL"
_IS_PARTITIONED = "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass('request_events')"
_PARTITIONS = """
SELECT child.relname AS name, pg_get_expr(child.relpartbound, child.oid) AS bound, i.inhdetachpending AS pending
  FROM pg_inherits i
  JOIN pg_class child ON child.oid = i.inhrelid
 WHERE i.inhparent = to_regclass($1)
 ORDER BY 1
"""


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of ``table``: its days are ``[first_day, end)``; ``first_day`` None: from the start."""

    table: str
    name: str
    first_day: date | None
    end: date
    detach_pending: bool = False


@dataclass(slots=True)
class Maintenance:
    """What a run of :func:`maintain` did."""

    created: list[str] = field(default_factory=list)
    archived: list[Path] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped: bool = False  # another run held the lock
    unpartitioned: bool = False  # the log is not partitioned yet (migration 0007)

    def __str__(self) -> str:
        if self.unpartitioned:
            return "the log is not partitioned yet: run 'phasegate db upgrade' first"
        if self.skipped:
            return "another maintenance run is in progress: nothing done"
        return (
            f"{len(self.created)} partitions created, {len(self.archived)} archived,"
            f" {len(self.dropped)} dropped past retention"
        )


def today() -> date:
    return datetime.now(UTC).date()


async def partitions(connection: asyncpg.Connection, table: str) -> list[Partition]:
    """``table``'s partitions, by name."""
    found = []
    for row in await connection.fetch(_PARTITIONS, table):
        match = _BOUND.search(row["bound"])
        if match is None:  # not a range of days: not ours to manage
            continue
        low = match["low"]
        found.append(
            Partition(
                table,
                row["name"],
                date.fromisoformat(low) if low else None,
                date.fromisoformat(match["high"]),
                row["pending"],
            )
        )
    return found


async def maintain(
    connection: asyncpg.Connection,
    *,
    days_ahead: int = 3,
    retention_days: int | None = None,
    archive_dir: Path | None = None,
    on: date | None = None,
    wait: bool = False,
    lock_timeout_s: float = 5.0,
) -> Maintenance:
    """Make partitions ahead and apply retention (see the module docstring). ``on``: the
    day it is (today, UTC); ``wait``: wait for a run in progress instead of skipping.
    The connection must not be in a transaction: a concurrent detach cannot be."""
    day = on or today()
    done = Maintenance()
    while not await connection.fetchval("SELECT pg_try_advisory_lock($1)", _LOCK_KEY):
        if not wait:
            done.skipped = True
            return done
        await asyncio.sleep(0.1)
    try:
        if not await connection.fetchval(_IS_PARTITIONED):
            done.unpartitioned = True  # at 0006 still (a rolling upgrade): `phasegate db upgrade` first
            return done
        await connection.execute(f"SET lock_timeout = '{int(lock_timeout_s * 1000)}ms'")
        cutoff = None if retention_days is None else day - timedelta(days=retention_days)
        for table in PARTITIONED:
            for pending in [p for p in await partitions(connection, table) if p.detach_pending]:
                await connection.execute(f"ALTER TABLE {table} DETACH PARTITION {pending.name} FINALIZE")
                if cutoff is not None and pending.end <= cutoff:
                    await drop(connection, pending)
                    done.dropped.append(pending.name)
                else:  # not ours to drop: someone detached it by hand; a day ahead is attached again
                    logger.warning("finished the detach of %s, left in place: it is not past retention", pending.name)
        await _create_ahead(connection, day, days_ahead, done)
        if cutoff is not None:
            await _retire(connection, cutoff, archive_dir, done)
    finally:
        await connection.execute("RESET lock_timeout")
        await connection.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return done


async def ensure_days(connection: asyncpg.Connection, days: Sequence[date]) -> list[str]:
    """Make the partitions of ``days`` that are missing (a trace imported, a log seeded);
    days before the conversion fall in the legacy partition and need none."""
    done = Maintenance()
    for day in sorted(set(days)):
        await _create_day(connection, day, done)
    return done.created


async def _create_ahead(connection: asyncpg.Connection, day: date, days_ahead: int, done: Maintenance) -> None:
    for offset in range(days_ahead + 1):
        await _create_day(connection, day + timedelta(days=offset), done)


async def _create_day(connection: asyncpg.Connection, day: date, done: Maintenance) -> None:
    for table in PARTITIONED:
        covered = any(
            (p.first_day is None or p.first_day <= day) and day < p.end for p in await partitions(connection, table)
        )
        if covered:
            continue
        name = f"{table}_p{day:%Y%m%d}"
        # LIKE the parent: its columns, defaults, generation expressions and CHECKs; the
        # identity stays the parent's (one sequence of positions for all partitions)
        await connection.execute(  # IF NOT EXISTS: a detached day's table is attached again
            f"CREATE TABLE IF NOT EXISTS {name}"
            f" (LIKE {table} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS){_STORAGE.get(table, '')}"
        )
        await connection.execute(
            f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ('{day}') TO ('{day + timedelta(days=1)}')"
        )
        done.created.append(name)
    await project_day(connection, day)


async def project_day(connection: asyncpg.Connection, day: date) -> None:
    """Give ``day``'s partition of the log its own projection (migration 0010), once the
    day's four partitions are attached; a log before 0010 has none to give."""
    if await connection.fetchval(_HAS_DAY_PROJECTIONS):
        await connection.execute("SELECT phasegate_day_projection($1)", day)


async def _retire(connection: asyncpg.Connection, cutoff: date, archive_dir: Path | None, done: Maintenance) -> None:
    """Archive, detach and drop every partition whose days all come before ``cutoff``."""
    expired = {table: [p for p in await partitions(connection, table) if p.end <= cutoff] for table in PARTITIONED}
    day_projections = await connection.fetchval(_HAS_DAY_PROJECTIONS)
    archived: dict[str, int] = {}  # a partition of the log -> the events its archive holds
    for events in expired["request_events"]:
        if day_projections and events.first_day is not None:  # no append reaches it archived or half detached
            await connection.execute("SELECT phasegate_close_day($1)", events.first_day)
        if archive_dir is not None:
            path, archived[events.name] = await archive(connection, events, archive_dir)
            done.archived.append(path)
    for table in ("request_inputs", "request_attempts", "requests", "request_events"):  # the log last
        for partition in expired[table]:
            await connection.execute(f"ALTER TABLE {table} DETACH PARTITION {partition.name} CONCURRENTLY")
            if archive_dir is not None and await _appended_since(connection, partition, archived):
                logger.info("%s took appends after its archive: archiving it again", partition.name)
                await archive(connection, partition, archive_dir)
            await drop(connection, partition)
            done.dropped.append(partition.name)
            logger.info("dropped %s (accepted before %s) past retention", partition.name, partition.end)


async def _appended_since(connection: asyncpg.Connection, partition: Partition, archived: dict[str, int]) -> bool:
    """Whether the log's ``partition``, detached (no append reaches it now), holds events
    its archive does not."""
    if partition.name not in archived:
        return False
    return bool(await connection.fetchval(f"SELECT count(*) FROM {partition.name}") != archived[partition.name])


async def drop(connection: asyncpg.Connection, partition: Partition) -> None:
    """Drop a detached ``partition``, and with a day of the log its own projection."""
    await connection.execute(f"DROP TABLE {partition.name}")
    if partition.table == "request_events":  # the day's projection (0010), its triggers gone with the table
        await connection.execute(f"DROP FUNCTION IF EXISTS project_{partition.name}()")


async def archive(connection: asyncpg.Connection, partition: Partition, archive_dir: Path) -> tuple[Path, int]:
    """Write ``partition`` of ``request_events`` as a trace file in ``archive_dir``:
    ``<partition>.jsonl``, written aside and renamed into place once complete, so a
    file there is always whole. Returns its path and the events it holds."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    path = archive_dir / f"{partition.name}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    name = partition.name  # ours, from pg_inherits: safe to name in SQL
    async with connection.transaction(isolation="repeatable_read", readonly=True):
        requests = [
            row[0]
            for row in await connection.fetch(f"SELECT request_id FROM {name} WHERE version = 1 ORDER BY position")
        ]
        with partial.open("w", encoding="utf-8") as out:
            out.write(trace_header(requests, {"partition": name, "accepted_before": str(partition.end)}))
            rows = connection.cursor(
                f"SELECT request_id, version, type, schema_version, attempt, lease_epoch, occurred_at, body::text"
                f" FROM {name} ORDER BY position",
                prefetch=2000,
            )
            written = 0
            async for row in rows:
                out.write(trace_line(from_row(*row)))
                written += 1
            out.flush()
            os.fsync(out.fileno())
    partial.replace(path)
    logger.info("archived %s (%d requests) to %s", name, len(requests), path)
    return path, written
