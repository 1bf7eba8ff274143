"""Time every query of docs/audit.md on a seeded log: p50 warm, with its plan.

    python ops/bench/audit.py [--events 10000000] [--data-dir DIR] [--reuse] [--runs 7]

It seeds a fresh log with ``ops/seed.py`` (``--events``, 30 days, content policy
``full``) in the embedded PostgreSQL it starts (in ``--data-dir``, kept when given;
``--reuse`` keeps a log seeded there before), then for each query: one run to warm the
cache, then ``--runs`` timed runs (fewer when a run takes over a few seconds), and
prints the p50, the rows returned, the target (10 ms for the live views, 50 ms for
the rest) and a summary of ``EXPLAIN``'s plan (the scans, and any sort or aggregate
at the top). Then the same for each bounded form of the doc ("At ten million events"),
with the indexes its ``-- with:`` lines name built for it and dropped after. Then the
storage per million requests under each content policy (``--storage-events`` each,
seeded into scratch databases and scaled).

Parameters are what an operator would pass: a request that was cut in decode for the
one-request queries, one day back for ``:'since'``, one hour back for the live view of
failures, a trace id that no seeded request has.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from ops.audit_queries import bind, bounded_queries, doc_queries, index_name
from ops.seed import LOAD_SETTINGS, fresh_database, report, seed_database

_PARTITION = re.compile(r"_p\d{8}")
LIVE_VIEWS = {12, 19}  # open requests gone quiet; the last hour's failures
LIVE_TARGET_MS, TARGET_MS = 10.0, 50.0
DATABASE = "phasegate_audit_bench"
STORAGE_TABLES = ("request_events", "requests", "request_attempts", "request_inputs")


def plan_summary(plan: dict[str, Any]) -> str:
    """The plan's scans (with their index), and what the top does, in one line. A day
    partition's scans are counted under its table's pattern (``requests_p*``)."""
    scans: Counter[str] = Counter()

    def walk(node: dict[str, Any]) -> None:
        kind = node["Node Type"]
        if "Scan" in kind and "Relation Name" in node:
            scan = f"{kind} on {node['Relation Name']}" + (f" ({node['Index Name']})" if "Index Name" in node else "")
            scans[_PARTITION.sub("_p*", scan)] += 1
        for child in node.get("Plans", []):
            walk(child)

    walk(plan)
    return f"{plan['Node Type']}: " + ", ".join(f"{n} x {scan}" if n > 1 else scan for scan, n in scans.items())


async def time_query(connection: asyncpg.Connection, sql: str, parameters: list[Any], runs: int) -> tuple[float, int]:
    """p50 in ms of ``runs`` warm runs (one more before, unmeasured), and the rows returned."""
    await connection.fetch(sql, *parameters)
    samples: list[float] = []
    rows = 0
    deadline = time.perf_counter() + 30.0  # a slow query gets fewer runs
    for _ in range(runs):
        began = time.perf_counter()
        rows = len(await connection.fetch(sql, *parameters))
        samples.append((time.perf_counter() - began) * 1000)
        if time.perf_counter() > deadline and len(samples) >= 3:
            break
    return statistics.median(samples), rows


async def parameters_of(connection: asyncpg.Connection) -> dict[str, Any]:
    request_id = await connection.fetchval(
        "SELECT request_id FROM requests WHERE error_code = 'upstream_decode_interrupted'"
        " ORDER BY accepted_at DESC LIMIT 1"
    )
    now = datetime.now(UTC)
    # the seeded requests record no trace: query 18 is timed looking for one in vain
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    return {
        "request_id": request_id,
        "since": now - timedelta(days=1),
        "last_hour": now - timedelta(hours=1),
        "trace_id": trace_id,
    }


async def bench_queries(url: str, runs: int, *, bounded_only: bool = False) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        counts = await connection.fetchrow(
            "SELECT (SELECT count(*) FROM request_events) AS events, (SELECT count(*) FROM requests) AS requests"
        )
        assert counts is not None
        print(f"log: {counts['events']:,} events, {counts['requests']:,} requests")
        parameters = await parameters_of(connection)
        misses = []
        for number, (title, text) in sorted(doc_queries().items() if not bounded_only else []):
            sql, values = bind(text, parameters)
            plan = json.loads(await connection.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *values))[0]["Plan"]
            p50, rows = await time_query(connection, sql, values, runs)
            target = LIVE_TARGET_MS if number in LIVE_VIEWS else TARGET_MS
            verdict = "ok  " if p50 <= target else "MISS"
            if p50 > target:
                misses.append(number)
            print(f"{number:>2}. {verdict} p50 {p50:9.1f} ms (target {target:.0f})  {rows:>8,} rows  {title}")
            print(f"      plan: {plan_summary(plan)}")
        if not bounded_only:
            print(f"missed the target: {misses or 'none'}")
        for number, (text, indexes) in sorted(bounded_queries().items()):
            built = time.perf_counter()
            for statement in indexes:
                await connection.execute(statement)
            built_s = time.perf_counter() - built
            sql, values = bind(text, parameters)
            plan = json.loads(await connection.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *values))[0]["Plan"]
            p50, rows = await time_query(connection, sql, values, runs)
            target = LIVE_TARGET_MS if number in LIVE_VIEWS else TARGET_MS
            verdict = "ok  " if p50 <= target else "MISS"
            made = f", with {len(indexes)} index(es) built in {built_s:.1f} s" if indexes else ""
            print(f"{number:>2}. {verdict} p50 {p50:9.1f} ms (target {target:.0f})  {rows:>8,} rows  bounded{made}")
            print(f"      plan: {plan_summary(plan)}")
            for statement in indexes:
                await connection.execute(f"DROP INDEX {index_name(statement)}")
    finally:
        await connection.close()


async def storage_per_million(url: str, events: int) -> None:
    """Bytes per million requests under each content policy, from a seed of ``events``."""
    for policy in ("full", "digest", "none"):
        scratch = await fresh_database(url, f"phasegate_storage_{policy}")
        generated, _, _ = await seed_database(scratch, events=events, policy=policy)
        connection = await asyncpg.connect(asyncpg_dsn(scratch))
        try:
            sizes = {
                # a partitioned table holds nothing itself: its partitions (and their indexes) do
                table: int(
                    await connection.fetchval(
                        "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass)", table
                    )
                )
                for table in STORAGE_TABLES
            }
        finally:
            await connection.close()
        scale = 1_000_000 / generated.requests
        parts = ", ".join(f"{table} {size * scale / 2**30:.2f}" for table, size in sizes.items())
        print(
            f"storage, content policy {policy:<6}: {sum(sizes.values()) * scale / 2**30:.2f} GiB per million requests"
            f" ({generated.events / generated.requests:.1f} events each; GiB: {parts})"
        )
        admin = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await admin.execute(f'DROP DATABASE "phasegate_storage_{policy}" WITH (FORCE)')
        finally:
            await admin.close()


async def run(args: argparse.Namespace, url: str) -> None:
    from sqlalchemy.engine import make_url

    target = make_url(url).set(database=DATABASE).render_as_string(hide_password=False)
    if not args.reuse:
        target = await fresh_database(url, DATABASE)
        report(*await seed_database(target, events=args.events))
    await bench_queries(target, args.runs, bounded_only=args.bounded_only)
    if args.storage_events:
        await storage_per_million(url, args.storage_events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="the seeded log's size")
    parser.add_argument("--data-dir", help="the embedded server's directory (kept); default: a temporary one")
    parser.add_argument("--reuse", action="store_true", help="time the log seeded in --data-dir before")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bounded-only", action="store_true", help="time only the bounded forms")
    parser.add_argument("--storage-events", type=int, default=500_000, help="per content policy; 0: skip")
    args = parser.parse_args()
    if args.reuse and not args.data_dir:
        parser.error("--reuse needs the --data-dir of the earlier run")
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="phasegate-audit-bench-")
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
    server = EmbeddedPostgres(data_dir, settings=LOAD_SETTINGS)
    url = server.start()
    print(f"embedded PostgreSQL in {data_dir}: {', '.join(f'{k}={v}' for k, v in LOAD_SETTINGS.items())}")
    try:
        asyncio.run(run(args, url))
    finally:
        server.stop()
        if not args.data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
