"""What an append costs by the days the log keeps, through the parent and straight into the day.

    python ops/bench/days_kept.py [--requests 400] [--days 4 92 367] [--rounds 3]
                                  [--settings '' max_locks_per_transaction=1024]

Through the parent, every statement of the projection trigger runs on a generic plan over
a partitioned read model, and PostgreSQL locks every partition such a plan names at each
execution (its scans of the other days are pruned only as it starts): the more days
kept, the more locks an append takes. A transaction holds its first few relation locks
on a fast path of its own; past those they go through the shared lock table, which costs
more each. Since PostgreSQL 18 the fast path holds ``max_locks_per_transaction`` locks
(rounded up to a power of two, at most 16,384), so that setting decides how many days are
cheap. Straight into the day's partition (migration 0010, what the writer does), the
day's own trigger names that day's read models alone.

Here each ``--settings`` variant (default: the server's defaults, and
``max_locks_per_transaction=1024``, the embedded server's) runs an embedded PostgreSQL
of its own, fsync off, so that a flush does not hide the CPU (all at once: the rounds
alternate between them). In each, one log per ``--days`` (a scratch database, migrated,
with that many day partitions made, the requests' day the last of them); then
``--rounds`` rounds, each appending ``--requests`` requests' commit points (two events,
the writer's INSERT … unnest) and one delivery each (one event, INSERT … VALUES) on one
connection in autocommit, through the parent and into the day in turn, in every log and
variant in turn. Prints the medians (p90) in microseconds, and each log's difference
from the fewest days through the parent in the same variant.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store import migrate, partitions
from app.store.codec import EventRow
from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from app.store.insert import LogSchema, insert_rows
from ops.bench.commit_point import INSTANCE, KINDS, bind
from ops.bench.log_rows import rows_on, scratch_database
from ops.bench.measure import percentile
from statemachine.events import Event

FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
# the requests' accept day: after the days the migrations made (those before the log's
# conversion share one legacy partition), so that each log's days are its own partitions
DAY = date.today() + timedelta(days=400)


def rows(events: list[Event]) -> list[EventRow]:
    """The rows of ``events`` (ops/bench/log_rows.py's, at its T0) moved to :data:`DAY`."""
    return rows_on(events, DAY)


async def prepared_log(url: str, days: int) -> str:
    """A migrated scratch log with ``days`` day partitions, the last the requests' day."""
    log_url = await scratch_database(url, f"phasegate_days_{days}")
    await migrate.upgrade_async(log_url)
    conn = await asyncpg.connect(asyncpg_dsn(log_url))
    try:
        await partitions.ensure_days(conn, [DAY - timedelta(days=n) for n in range(days)])
        count = await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhparent = 'requests'::regclass")
        await conn.execute(
            "INSERT INTO gateway_instances (instance_id, name, host, pid, version, lease_ttl_ms, lease_expires_at)"
            " VALUES ($1, 'bench', 'bench', 1, 'bench', 86400000, now() + interval '1 day')",
            INSTANCE,
        )
        print(f"  log of {days} days: {count} partitions of requests")
    finally:
        await conn.close()
    return log_url


async def one_round(
    conn: asyncpg.Connection, tag: str, requests: int, schema: LogSchema | None
) -> dict[str, list[float]]:
    """Seconds each append took, by kind, for ``requests`` fresh requests; ``schema``: the
    writer's knowledge of the days' partitions (appends straight into the day), or None
    (through the parent)."""
    found: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for number in range(requests):
        for kind, (before, appended) in KINDS.items():
            rid = f"{tag}-{kind[0]}-{number}"
            await insert_rows(conn, rows(before(rid)), copy=False, schema=schema)
            batch = rows(appended(rid))
            began = time.perf_counter()
            await insert_rows(conn, batch, copy=False, schema=schema)
            found[kind].append(time.perf_counter() - began)
    return found


async def run(urls: dict[str, str], days: list[int], requests: int, rounds: int) -> None:
    logs: dict[tuple[str, int], tuple[asyncpg.Connection, LogSchema]] = {}
    for variant, url in urls.items():
        print(f"{variant}:")
        for kept in days:
            conn = await asyncpg.connect(asyncpg_dsn(await prepared_log(url, kept)))
            await bind(conn)
            schema = LogSchema()
            await schema.learn(conn)
            assert DAY in schema.days, "the requests' day has no projection of its own"
            for warming in (None, schema):
                await one_round(conn, f"warm{warming is None}", 20, warming)  # plans made, caches warm
            logs[variant, kept] = conn, schema
    ways = {"parent": False, "day": True}
    samples: dict[tuple[str, int, str], dict[str, list[float]]] = {
        (variant, kept, way): {kind: [] for kind in KINDS} for variant, kept in logs for way in ways
    }
    for number in range(rounds):
        for (variant, kept), (conn, schema) in logs.items():
            for way, straight in ways.items():
                found = await one_round(conn, f"r{number}{way}", requests, schema if straight else None)
                for kind, seconds in found.items():
                    samples[variant, kept, way][kind] += seconds
    for conn, _ in logs.values():
        await conn.close()
    print(
        f"\n{requests} requests x {rounds} rounds; microseconds, median (p90);"
        " +: over the fewest days through the parent, same settings"
    )
    for kind in KINDS:
        print(f"\n{kind}")
        for variant in urls:
            base = percentile(samples[variant, days[0], "parent"][kind], 0.5)
            for kept in days:
                for way in ways:
                    values = samples[variant, kept, way][kind]
                    p50, p90 = percentile(values, 0.5), percentile(values, 0.9)
                    print(
                        f"  {variant:<34} {kept:>4} days {way:<6} {p50 * 1e6:7.0f} ({p90 * 1e6:.0f})"
                        f"  {(p50 - base) * 1e6:+5.0f}"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--days", type=int, nargs="+", default=[4, 92, 367])
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["", "max_locks_per_transaction=1024"],
        help="one variant each: NAME=VALUE[,NAME=VALUE…], or '' for the defaults",
    )
    args = parser.parse_args()
    servers: list[tuple[EmbeddedPostgres, str]] = []
    urls: dict[str, str] = {}
    try:
        for variant in args.settings:
            settings = dict(item.split("=", 1) for item in variant.split(",") if item)
            data_dir = tempfile.mkdtemp(prefix="phasegate-bench-")
            os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
            server = EmbeddedPostgres(data_dir, settings=FAST | settings)
            servers.append((server, data_dir))
            urls[variant or "defaults"] = server.start()
        asyncio.run(run(urls, sorted(args.days), args.requests, args.rounds))
    finally:
        for server, data_dir in servers:
            server.stop()
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
