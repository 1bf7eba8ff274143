"""The read models projected in each append's transaction, against a projector that trails
the log and folds a window of it at a time (what trailing would buy).

    python ops/bench/studies/windowed_projection.py [--requests 3000] [--streams 50] [--every 3]
                                            [--windows 1 4 12]

Each way appends the same batches to a day with partitions of its own, in a scratch
database of its own, on one embedded PostgreSQL (fsync off, so that a flush does not hide
the CPU); the ways alternate batch by batch, so a noisy moment hits all. The batches are
those one gateway process's writer commits at 100 streams over two processes: each
request's 13 events (as a plain 7-delta answer records them) in the 9 appends the gateway
makes of them (accepted, decided and started; the first token and the commit point; six
deliveries; the last and the end; a log written at 100 streams holds a request in 8
transactions, median, where two of its appends met in one batch), ``--streams`` requests
in flight, each appending every ``--every`` batches, so that a batch holds ~22 events of
~17 requests at every moment of theirs (that log: 24 events a transaction).

- ``in the append``: the writer's INSERT … unnest straight into the day, whose own
  projection trigger (migration 0010) folds each batch into the read models: today.
- ``trailing, window W``: the same INSERT into a day whose projection trigger is off (the
  instance guard kept: the bare append); then, after every W batches, a projector copies
  the window's events, in log order, into an inbox table that carries the day's own
  projection function as its trigger, in one statement, and empties it. The projection is
  the same function, word for word; a request's row is updated once a window instead of
  once a batch. W = 1 is the projector at the append's pace.

Prints, per request, the statements' time (sent to done, on one connection in
autocommit, microseconds): the appends, the projector, and the sum; and how many read
model updates PostgreSQL made (``pg_stat_user_tables``). The stream guard that today sits
in the projection (a batch starts right after the request's last version) is not taken
from the log here: a trailing design needs it on the append path (an index probe a
request a batch, docs/read-models.md), which this bench does not count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: ops/ is not installed

from app.store import migrate, partitions
from app.store.codec import EventRow
from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from app.store.insert import INSERT_EVENTS, columns, into
from ops import traces
from ops.bench.days_kept import DAY, FAST  # a day of its own, after the migrations'; fsync off
from ops.bench.log_rows import rows_on, scratch_database

TEXTS = tuple(f" t{n}" for n in range(7))
# a request's events by the append the gateway makes of them: 3, 2, 1 × 6, 2
GROUPS = (3, 2, 1, 1, 1, 1, 1, 1, 2)


def requests_rows(count: int) -> list[list[list[EventRow]]]:
    """``count`` requests, each its rows in :data:`GROUPS`."""
    made = []
    for n in range(count):
        events = traces.completed(f"req_{n:06d}", texts=TEXTS).events
        rows, groups, at = rows_on(events, DAY), [], 0
        for size in GROUPS:
            groups.append(rows[at : at + size])
            at += size
        assert at == len(rows), "a request's events changed: GROUPS no longer covers them"
        made.append(groups)
    return made


def batches(requests: list[list[list[EventRow]]], streams: int, every: int) -> list[list[EventRow]]:
    """The writer's batches: ``streams`` requests in flight, each writing its next group
    every ``every`` batches (request i on the batches where (batch + i) % every == 0), so
    that a batch holds about ``streams / every`` requests' groups."""
    waiting = [iter(groups) for groups in reversed(requests)]
    flying: list[tuple[int, Iterator[list[EventRow]]]] = []
    made: list[list[EventRow]] = []
    started = 0
    while waiting or flying:
        while waiting and len(flying) < streams:
            flying.append((started, waiting.pop()))
            started += 1
        batch: list[EventRow] = []
        still = []
        for number, request in flying:
            if (len(made) + number) % every:
                still.append((number, request))
                continue
            group = next(request, None)
            if group is not None:
                batch += group
                still.append((number, request))
        flying = still
        made.append(batch)
    return [batch for batch in made if batch]


@dataclass
class Way:
    """One way in: its scratch log, and the seconds its statements took."""

    name: str
    conn: asyncpg.Connection
    window: int | None  # batches a projector's window; None: projected in the append
    appends: float = 0.0
    projector: float = 0.0
    pending: int = 0  # batches appended since the projector's last window
    cursor: int = 0  # the last position projected
    updates: dict[str, int] = field(default_factory=dict)


async def prepared(url: str, name: str, window: int | None) -> Way:
    """A scratch log with :data:`DAY`'s partitions; for a window, the day's projection
    off and an inbox that projects whatever is put in it."""
    log_url = await scratch_database(url, name)
    await migrate.upgrade_async(log_url)
    conn = await asyncpg.connect(asyncpg_dsn(log_url))
    await partitions.ensure_days(conn, [DAY])
    function = f"project_request_events_p{DAY:%Y%m%d}"
    assert await conn.fetchval("SELECT to_regprocedure($1)", f"{function}()"), "migration 0010's day projection"
    if window is not None:
        await conn.execute(f"ALTER TABLE request_events_p{DAY:%Y%m%d} DISABLE TRIGGER request_events_project_day")
        # the connection's own, emptied as each window commits (no TRUNCATE, no dead rows)
        await conn.execute("CREATE TEMPORARY TABLE projection_inbox (LIKE request_events) ON COMMIT DELETE ROWS")
        await conn.execute(
            "CREATE TRIGGER projection_inbox_project AFTER INSERT ON projection_inbox"
            f" REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        )
    return Way(name, conn, window)


async def append(way: Way, batch: Sequence[EventRow]) -> None:
    statement = into(INSERT_EVENTS, f"request_events_p{DAY:%Y%m%d}")
    began = time.perf_counter()
    await way.conn.execute(statement, *columns(batch))
    way.appends += time.perf_counter() - began
    if way.window is None:
        return
    way.pending += 1
    if way.pending >= way.window:
        await project(way)


async def project(way: Way) -> None:
    """The window: every event after the cursor, in log order, through the inbox."""
    began = time.perf_counter()
    async with way.conn.transaction():  # one statement: the window in, projected; the cursor out
        last = await way.conn.fetchval(
            "WITH window_rows AS (INSERT INTO projection_inbox"
            " SELECT * FROM request_events WHERE accepted_on = $1 AND position > $2 ORDER BY position"
            " RETURNING position) SELECT max(position) FROM window_rows",
            DAY,
            way.cursor,
        )
    way.projector += time.perf_counter() - began
    way.pending = 0
    way.cursor = way.cursor if last is None else last


async def updates(way: Way) -> dict[str, int]:
    """The read models' rows written (inserted or updated), as the statistics count them."""
    await way.conn.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, flushed
    await way.conn.execute("SELECT 1")
    await way.conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await way.conn.fetch(
        "SELECT relname, n_tup_ins + n_tup_upd AS written FROM pg_stat_user_tables WHERE relname IN ($1, $2)",
        f"requests_p{DAY:%Y%m%d}",
        f"request_attempts_p{DAY:%Y%m%d}",
    )
    return {row["relname"].split("_p")[0]: row["written"] for row in rows}


async def read_models(way: Way) -> list[list[asyncpg.Record]]:
    return [
        await way.conn.fetch("SELECT * FROM requests ORDER BY request_id"),
        await way.conn.fetch("SELECT * FROM request_attempts ORDER BY request_id, attempt"),
    ]


async def measure(url: str, requests: int, streams: int, every: int, windows: Sequence[int]) -> list[Way]:
    """Append ``requests`` requests every way (:func:`batches`), each way's read models
    checked equal to the append's own, row for row; the ways, timed."""
    made = batches(requests_rows(requests), streams, every)
    rows = sum(len(batch) for batch in made)
    print(
        f"{requests} requests, {rows} events in {len(made)} batches of ~{rows / len(made):.0f},"
        f" {streams} in flight, each writing every {every} batches"
    )
    names = [None, *windows]
    ways = [await prepared(url, f"phasegate_projection_{os.getpid()}_{n or 'append'}", n) for n in names]
    try:
        for batch in made:
            for way in ways:
                await append(way, batch)
        for way in ways:
            if way.window is not None and way.pending:
                await project(way)
            way.updates = await updates(way)
        projected = await read_models(ways[0])
        assert len(projected[0]) == requests, f"{len(projected[0])} of {requests} requests projected"
        for way in ways[1:]:
            assert await read_models(way) == projected, f"{way.name}'s read models differ from the append's"
        return ways
    finally:
        for way in ways:
            await way.conn.close()
        await drop_databases(url, [way.name for way in ways])


async def drop_databases(url: str, names: Sequence[str]) -> None:
    admin = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for name in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await admin.close()


async def run(url: str, requests: int, streams: int, every: int, windows: Sequence[int]) -> None:
    report(await measure(url, requests, streams, every, windows), requests)


def report(ways: Sequence[Way], requests: int) -> None:
    per = 1e6 / requests
    print(f"\n{'way':<26}{'appends':>10}{'projector':>11}{'sum':>9}   µs a request; rows written a request")
    for way in ways:
        label = "in the append" if way.window is None else f"trailing, window {way.window}"
        written = ", ".join(f"{table} {count / requests:.1f}" for table, count in sorted(way.updates.items()))
        print(
            f"{label:<26}{way.appends * per:>10.0f}{way.projector * per:>11.0f}"
            f"{(way.appends + way.projector) * per:>9.0f}   {written}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--streams", type=int, default=50, help="in flight: a writer's share at 100 streams, 2 processes"
    )
    parser.add_argument("--every", type=int, default=3, help="batches between a request's appends")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4, 12])
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"), help="a server of your own, else embedded")
    args = parser.parse_args(argv)
    if args.url:
        asyncio.run(run(args.url, args.requests, args.streams, args.every, args.windows))
        return
    data_dir = tempfile.mkdtemp(prefix="phasegate-bench-")
    os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
    server = EmbeddedPostgres(data_dir, settings=FAST)
    try:
        asyncio.run(run(server.start(), args.requests, args.streams, args.every, args.windows))
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
