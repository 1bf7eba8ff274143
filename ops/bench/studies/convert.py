"""Time migration 0007 (the log to day partitions) on a populated log, with a writer appending.

    python ops/bench/studies/convert.py [--url URL] [--events 1000000]

Fills a fresh database at revision 0006 with ``--events`` seeded events (ops/seed.py's
traces, appended as the previous release appended them: COPY through its projection
trigger, in batches), then upgrades it to head while one connection keeps appending
whole requests with a statement both schemas take, and prints how long the upgrade
took and the longest single append meanwhile (the switch's lock). Without ``--url``
(or ``DATABASE_URL``) it starts the embedded PostgreSQL in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: ops/ is not installed

from app.store import migrate
from app.store.codec import EventRow, to_row
from app.store.database import asyncpg_dsn, sqlalchemy_url
from app.store.embedded import EmbeddedPostgres
from ops.seed import fresh_database, seeded_requests
from ops.traces import completed

PREVIOUS = "0006"
COLUMNS = EventRow._fields[:9]  # the previous release's columns: no accept day
APPEND = """
INSERT INTO request_events
    (request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
SELECT request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body::jsonb
  FROM unnest($1::text[], $2::integer[], $3::uuid[], $4::text[], $5::smallint[],
              $6::integer[], $7::integer[], $8::timestamptz[], $9::text[])
       AS batch(request_id, version, event_id, type, schema_version, attempt, lease_epoch, occurred_at, body)
"""


async def populate(url: str, events: int) -> int:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    loaded, batch = 0, []
    try:
        end = datetime.now(UTC).replace(microsecond=0)
        for request in seeded_requests(events=events, days=30, end=end, policy="full", seed=1):
            batch.extend(to_row(event)[:9] for event in request.events)
            if len(batch) >= 50_000:
                await connection.copy_records_to_table("request_events", records=batch, columns=COLUMNS)
                loaded, batch = loaded + len(batch), []
        if batch:
            await connection.copy_records_to_table("request_events", records=batch, columns=COLUMNS)
            loaded += len(batch)
        await connection.execute("VACUUM ANALYZE request_events, requests, request_attempts")
    finally:
        await connection.close()
    return loaded


async def convert(url: str) -> tuple[float, list[float]]:
    writer = await asyncpg.connect(asyncpg_dsn(url))
    waits: list[float] = []
    done = asyncio.Event()

    async def append_meanwhile() -> None:
        number = 0
        while not done.is_set():
            rows = [to_row(event)[:9] for event in completed(f"req_meanwhile_{number}").events]
            began = time.perf_counter()
            await writer.execute(APPEND, *[list(column) for column in zip(*rows, strict=True)])
            waits.append(time.perf_counter() - began)
            number += 1
            await asyncio.sleep(0.001)

    appending = asyncio.ensure_future(append_meanwhile())
    began = time.perf_counter()
    try:
        await migrate.upgrade_async(url)
    finally:
        took = time.perf_counter() - began
        done.set()
        await appending
        await writer.close()
    return took, waits


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    server, scratch = None, None
    url = args.url
    if url is None:
        scratch = tempfile.mkdtemp(prefix="phasegate-convert-")
        os.chmod(scratch, 0o755)
        server = EmbeddedPostgres(scratch)
        url = server.start()
    try:
        fresh = await fresh_database(sqlalchemy_url(url), "phasegate_convert")
        await migrate.downgrade_async(fresh, PREVIOUS)
        began = time.perf_counter()
        loaded = await populate(fresh, args.events)
        print(f"{loaded:,} events loaded at revision {PREVIOUS} in {time.perf_counter() - began:.1f} s")
        took, waits = await convert(fresh)
        waits.sort()
        print(
            f"0007 on {loaded:,} events: {took:.1f} s, while {len(waits)} requests were appended"
            f" (append p50 {waits[len(waits) // 2] * 1000:.2f} ms, longest {waits[-1] * 1000:.0f} ms)"
        )
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
