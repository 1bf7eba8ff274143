"""The commit point's append taken apart: where its milliseconds go.

    python ops/bench/commit_point.py [--url URL] [--requests 300]

Without ``--url`` it starts the embedded PostgreSQL with its default, durable settings
(fsync on) and these for the measurement: ``pg_stat_statements`` (every statement, nested
ones included, with its planning), and WAL I/O timing. With ``--url`` the server must
have ``shared_preload_libraries = 'pg_stat_statements'`` for the statement table.

For each of ``--requests`` fresh requests, opened as the gateway opens one (accepted, an
attempt started), two appends are measured, as the writer sends them with the instance
guard bound to a live gateway instance, on a day with partitions of its own:

- **the commit point**: the first token received and the first delta committed, two
  events, one INSERT … SELECT FROM unnest, committed at once (durable);
- **a delivery batch**: one ``DeltasDelivered``, the single-row INSERT.

Each is taken these ways, interleaved request by request so that a noisy moment hits all:

1. ``store``: ``PostgresEventStore.append(durable=True)``, what the driver awaits;
2. ``day``: the writer's statement straight into the day's partition (migration 0010)
   on a connection of its own, in autocommit (sent to committed): PostgreSQL's share
   and one round trip;
3. ``parent``: the same statement through the parent, whose triggers project;
4. ``bare``: the same statement into a day whose projection trigger is off, the
   instance guard kept: the floor that the projection adds to (what a cheaper projection could reach);
5. ``statement`` and ``commit``: the ``day`` way in ``BEGIN``; INSERT; ``COMMIT``, each
   timed: the statement's work, and the commit (its WAL flush);
6. ``EXPLAIN (ANALYZE)`` of the ``day`` way's INSERT, rolled back: planning, the
   executor, and each trigger's time as PostgreSQL counts them;
7. ``SELECT 1``: a round trip alone.

Then ``pg_stat_statements`` over the runs: each statement's mean execution and
planning time a call, the triggers' own statements among them; and the WAL's fsyncs from
``pg_stat_io``. All figures are medians (and p90) of the requests, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store import migrate, partitions
from app.store.codec import EventRow
from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from app.store.insert import INSERT_EVENT, INSERT_EVENTS, LogSchema, columns, insert_rows, into
from app.store.instances import InstanceInfo, InstanceRegistry
from app.store.postgres import PostgresEventStore
from ops.bench.log_rows import T0, delivery, moved, opening, rows_on, scratch_database
from ops.bench.measure import percentile
from statemachine.events import Event, FirstDeltaCommitted, FirstTokenReceived

INSTANCE = "gw_bench"
MEASURING = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
    "track_wal_io_timing": "on",
    "track_io_timing": "on",
}
WAYS = ("store", "day", "parent", "bare", "statement", "commit", "round trip")
# the requests' day, and the bare way's: after the days the migrations made, each with
# partitions of its own (those before the log's conversion share the legacy one)
DAY = date.today() + timedelta(days=400)
BARE_DAY = DAY + timedelta(days=1)


def commit_point(request_id: str) -> list[Event]:
    """What the writer appends at a stream's commit point: the first token, the commit."""
    return [
        FirstTokenReceived(request_id, 3, T0 + timedelta(milliseconds=1), 1, 1),
        FirstDeltaCommitted(request_id, 4, T0 + timedelta(milliseconds=2), 1, 1),
    ]


# each kind: the events before it (from the request's start), and its own
KINDS: dict[str, tuple[Callable[[str], list[Event]], Callable[[str], list[Event]]]] = {
    "commit point": (lambda rid: opening(rid)[:2], commit_point),
    "delivery batch": (lambda rid: [*opening(rid)[:2], *commit_point(rid)], lambda rid: [delivery(rid, 1)]),
}


class Samples(dict[str, list[float]]):
    def add(self, way: str, seconds: float) -> None:
        self.setdefault(way, []).append(seconds)


async def timed(work: Awaitable[Any]) -> float:
    """Seconds ``work`` (a coroutine, which starts when awaited) took."""
    began = time.perf_counter()
    await work
    return time.perf_counter() - began


def rows(events: Sequence[Event], day: date = DAY) -> list[EventRow]:
    return rows_on(events, day)


async def bind(conn: asyncpg.Connection) -> None:
    await conn.execute("SELECT set_config('phasegate.instance', $1, false)", INSTANCE)


async def explained(conn: asyncpg.Connection, rows: Sequence[EventRow], table: str) -> dict[str, float]:
    """EXPLAIN ANALYZE of the writer's INSERT of ``rows`` into ``table``, rolled back:
    milliseconds by part."""
    statement, args = (INSERT_EVENT, list(rows[0])) if len(rows) == 1 else (INSERT_EVENTS, columns(rows))
    statement = into(statement, table)
    transaction = conn.transaction()
    await transaction.start()
    try:
        plan = json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, WAL, FORMAT JSON) {statement}", *args))[0]
    finally:
        await transaction.rollback()
    parts = {"planning": plan["Planning Time"], "executor": plan["Execution Time"]}
    for trigger in plan.get("Triggers", []):
        parts[f"trigger {trigger['Trigger Name']}"] = trigger["Time"]
    return parts


async def prepared_days(url: str) -> LogSchema:
    """:data:`DAY`'s and :data:`BARE_DAY`'s partitions, the bare day's projection off;
    the writer's knowledge of the days."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await partitions.ensure_days(conn, [DAY, BARE_DAY])
        await conn.execute(f"ALTER TABLE request_events_p{BARE_DAY:%Y%m%d} DISABLE TRIGGER request_events_project_day")
        schema = LogSchema()
        await schema.learn(conn)
    finally:
        await conn.close()
    assert {DAY, BARE_DAY} <= schema.days.keys(), "the days have no projection of their own (migration 0010)"
    return schema


@dataclass
class Measured:
    """What :func:`measure` found: seconds by kind and way, EXPLAIN's parts (milliseconds)
    by kind, and pg_stat_statements' rows and the WAL's counters where the server has them."""

    results: dict[str, Samples] = field(default_factory=lambda: {kind: Samples() for kind in KINDS})
    explains: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    statements: Sequence[asyncpg.Record] = ()
    wal: asyncpg.Record | None = None


async def measure(url: str, requests: int) -> Measured:
    """Measure ``requests`` requests' appends on the migrated log at ``url``."""
    days = await prepared_days(url)
    store = await PostgresEventStore.connect(url)
    registry = InstanceRegistry(store)
    await registry.register(InstanceInfo(INSTANCE, "bench:0", "bench", os.getpid(), "bench", None), ttl_s=3600.0)
    store.writer.bind_instance(INSTANCE)
    direct = await asyncpg.connect(asyncpg_dsn(url))
    await bind(direct)
    found = Measured()
    results, explains = found.results, found.explains
    try:
        await store.append("warm", 0, moved(opening("warm"), DAY))  # the writer connected and bound
        counting = await _reset_statements(direct)
        await direct.execute("SELECT pg_stat_reset_shared('io')")
        for number in range(requests):
            for kind, (before, appended) in KINDS.items():
                samples = results[kind]
                # the store's path: what the driver awaits
                rid = f"store-{kind[0]}-{number}"
                await store.append(rid, 0, moved(before(rid), DAY))
                events = moved(appended(rid), DAY)
                samples.add("store", await timed(store.append(rid, len(before(rid)), events, durable=True)))
                # the writer's statement on a connection of its own, in autocommit, each way in
                for way, schema, day in (("day", days, DAY), ("parent", None, DAY), ("bare", days, BARE_DAY)):
                    rid = f"{way}-{kind[0]}-{number}"
                    await insert_rows(direct, rows(before(rid), day), copy=False, schema=schema)
                    batch = rows(appended(rid), day)
                    samples.add(way, await timed(insert_rows(direct, batch, copy=False, schema=schema)))
                # in a transaction: the statement, then the commit
                rid = f"split-{kind[0]}-{number}"
                await insert_rows(direct, rows(before(rid)), copy=False, schema=days)
                batch = rows(appended(rid))
                await direct.execute("BEGIN")
                samples.add("statement", await timed(insert_rows(direct, batch, copy=False, schema=days)))
                samples.add("commit", await timed(direct.execute("COMMIT")))
                samples.add("round trip", await timed(direct.fetchval("SELECT 1")))
                # EXPLAIN ANALYZE of it, rolled back
                rid = f"explain-{kind[0]}-{number}"
                await insert_rows(direct, rows(before(rid)), copy=False, schema=days)
                explains[kind].append(await explained(direct, rows(appended(rid)), days.days[DAY]))
        if counting:
            found.statements = await direct.fetch(
                """SELECT query, calls, plans, mean_exec_time, total_plan_time, toplevel FROM pg_stat_statements
                    WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                      AND calls >= $1 ORDER BY total_exec_time DESC LIMIT 25""",
                requests,
            )
        found.wal = await direct.fetchrow(
            "SELECT sum(fsyncs) AS fsyncs, sum(fsync_time) AS fsync_ms, sum(writes) AS writes,"
            " sum(write_time) AS write_ms FROM pg_stat_io WHERE object = 'wal'"
        )
    finally:
        await direct.close()
        await store.close()
    return found


async def _reset_statements(conn: asyncpg.Connection) -> bool:
    """Start pg_stat_statements' counts afresh; False where the server does not load it."""
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await conn.execute("SELECT pg_stat_statements_reset()")
    except (asyncpg.UndefinedFunctionError, asyncpg.ObjectNotInPrerequisiteStateError, asyncpg.UndefinedFileError):
        return False
    return True


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f}"


def report(found: Measured, requests: int) -> None:
    print(f"{requests} requests; microseconds, median (p90)")
    for kind, samples in found.results.items():
        print(f"\n{kind}")
        for way in WAYS:
            values = samples[way]
            print(f"  {way:<34}{us(percentile(values, 0.5))} ({us(percentile(values, 0.9)).strip()})")
        parts: dict[str, list[float]] = {}
        for explain in found.explains[kind]:
            for part, ms in explain.items():
                parts.setdefault(part, []).append(ms / 1000)
        for part, values in parts.items():
            label = f"EXPLAIN ANALYZE {part}".replace("trigger request_events_", "trigger ")
            print(f"  {label:<34}{us(percentile(values, 0.5))} ({us(percentile(values, 0.9)).strip()})")
    statements, wal = found.statements, found.wal
    if not statements:
        print("\n(no pg_stat_statements here: run without --url for the statements' table)")
    else:
        print("\npg_stat_statements over the run (every way above): microseconds a call; plans: times planned")
        print(f"  {'calls':>7} {'plans':>7} {'exec':>6} {'plan':>6}  statement")
    for row in statements:
        query = " ".join(str(row["query"]).split())[:96]
        level = "" if row["toplevel"] else "  (nested)"
        execution, planning = row["mean_exec_time"] * 1000, row["total_plan_time"] * 1000 / row["calls"]
        print(f"  {row['calls']:>7} {row['plans']:>7} {execution:6.0f} {planning:6.0f}  {query}{level}")
    if wal is not None and wal["fsyncs"]:
        mean = float(wal["fsync_ms"]) / float(wal["fsyncs"]) * 1000
        writes = f"{wal['writes']} writes, {float(wal['write_ms']):.1f} ms in all"
        print(f"\nWAL: {wal['fsyncs']} fsyncs, mean {mean:.0f} us; {writes}")


async def run(url: str, requests: int) -> None:
    bench_url = await scratch_database(url, "phasegate_bench_commit")
    await migrate.upgrade_async(bench_url)
    report(await measure(bench_url, requests), requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    if args.url:
        asyncio.run(run(args.url, args.requests))
        return
    data_dir = tempfile.mkdtemp(prefix="phasegate-bench-")
    os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
    server = EmbeddedPostgres(data_dir, settings=MEASURING)
    try:
        url = server.start()
        print(f"embedded PostgreSQL {', '.join(f'{k}={v}' for k, v in MEASURING.items())}")
        asyncio.run(run(url, args.requests))
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
