"""Benchmark the event log: durable append latency, group-commit throughput, follow lag.

    python ops/bench/eventlog.py [--url URL] [--streams 50] [--events 4000] [--compare-core] [--standby]

Without ``--url`` (or ``DATABASE_URL``) it starts the embedded PostgreSQL in a
temporary directory with its default, durable settings (fsync on). It creates a
scratch database, migrates it, measures, and drops it.

- durable append: one token delivery per append, awaited to its commit, one after
  another (the issue's target: p50 <= 0.4 ms); interleaved with the same INSERT on a
  bare asyncpg connection (what PostgreSQL takes: the row, its indexes, the
  projection, the commit's fsync) and a ``SELECT 1`` (the round trip alone);
- durable lifecycle: the same for the three events the gateway awaits before a
  stream's first token (accepted, attempt started, first delta committed), which the
  projection handles with its general UPDATE, not the narrow one for deliveries;
- group commit: ``--streams`` concurrent requests each appending ``--events`` token
  deliveries non-durably (one event per append, as the driver does), until flushed;
  the rate includes building the events;
- instance guard: the same durable append with the store bound to a live gateway
  instance (PostgreSQL checks its lease in the insert's own statement, migration
  0004) and unbound, interleaved (the goal: the guard adds <= 20 us at p50);
- follow lag: a follower reads the log while one writer appends a durable event
  every 2 ms; lag is from the append's return to the follower's receipt.
- ``--compare-core``: the same durable single-event INSERT through SQLAlchemy Core,
  the reason the writer's hot path uses raw asyncpg.
- ``--standby``: instead of one server, a primary with a synchronous streaming standby
  on this machine (``ops/replication.py``; the store on the multi-host URL, as a gateway
  would be), every figure above taken through it; then what ``synchronous_commit``
  costs: the direct INSERT in interleaved blocks at ``local`` (the primary's own flush
  only), ``remote_write``, ``on`` (the standby flushed: the default, what the gateway's
  durable appends wait for) and ``remote_apply``. Both servers share this machine's
  disk and cores, so the standby's round trip is a loopback one: over a network add its
  latency to every durable append.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store import migrate
from app.store.database import asyncpg_dsn, sqlalchemy_url
from app.store.embedded import EmbeddedPostgres
from app.store.insert import INSERT_EVENT
from app.store.instances import InstanceInfo, InstanceRegistry
from app.store.postgres import PostgresEventStore
from ops.bench.log_rows import dayed_row, delivery, opening, params_of, scratch_database
from ops.bench.measure import percentile
from ops.processes import free_port
from ops.replication import replica_pair


class Durable(NamedTuple):
    store: list[float]  # store.append(..., durable=True) of one delivery
    direct: list[float]  # the writer's INSERT on a connection of its own: PostgreSQL's share
    round_trip: list[float]  # SELECT 1 on that connection: the socket and two wake-ups


async def bench_durable(store: PostgresEventStore, count: int) -> Durable:
    """Durable single deliveries through the store, interleaved with the direct path."""
    await store.append("durable", 0, opening("durable"))
    direct = await asyncpg.connect(asyncpg_dsn(store.url))
    result = Durable([], [], [])
    try:
        for event in opening("direct"):
            await direct.execute(INSERT_EVENT, *dayed_row(event))
        for block in range(0, count, 100):  # interleaved, so that a noisy moment hits all three
            for index in range(block, min(block + 100, count)):
                event = delivery("durable", index)
                began = time.perf_counter()
                await store.append("durable", 3 + index, [event])
                result.store.append(time.perf_counter() - began)
            for index in range(block, min(block + 100, count)):
                row = dayed_row(delivery("direct", index))
                began = time.perf_counter()
                await direct.execute(INSERT_EVENT, *row)
                result.direct.append(time.perf_counter() - began)
                began = time.perf_counter()
                await direct.fetchval("SELECT 1")
                result.round_trip.append(time.perf_counter() - began)
    finally:
        await direct.close()
    return result


async def bench_guard(store: PostgresEventStore, count: int) -> tuple[list[float], list[float]]:
    """Durable single deliveries with the instance guard on and off, in alternating blocks."""
    registry = InstanceRegistry(store)
    await registry.register(InstanceInfo("gw_bench", "bench:0", "bench", os.getpid(), "bench", None), ttl_s=3600.0)
    guarded: list[float] = []
    unguarded: list[float] = []
    seq = {"guard-on": 3, "guard-off": 3}
    for name in seq:
        await store.append(name, 0, opening(name))
    for block in range(0, count, 100):
        for name, instance, samples in (("guard-on", "gw_bench", guarded), ("guard-off", None, unguarded)):
            store.writer.bind_instance(instance)
            for index in range(block, min(block + 100, count) + 1):  # the first one binds: not measured
                began = time.perf_counter()
                await store.append(name, seq[name], [delivery(name, seq[name] - 3)])
                seq[name] += 1
                if index > block:
                    samples.append(time.perf_counter() - began)
    store.writer.bind_instance(None)
    return guarded, unguarded


async def bench_durable_openings(store: PostgresEventStore, count: int) -> list[float]:
    """What the gateway awaits before a stream's first token: accepted, started, committed."""
    latencies = []
    for number in range(count // 3):
        name = f"opening-{number}"
        for seq, event in enumerate(opening(name)):
            began = time.perf_counter()
            await store.append(name, seq, [event])
            latencies.append(time.perf_counter() - began)
    return latencies


async def bench_group_commit(store: PostgresEventStore, streams: int, events: int) -> tuple[float, int]:
    names = [f"gc-{n}" for n in range(streams)]
    for name in names:
        await store.append(name, 0, opening(name))

    async def stream(name: str) -> None:
        for index in range(events):
            # built as it is appended, as the driver does (and then dropped: holding
            # every event of the run alive would make the benchmark about the GC)
            await store.append(name, 3 + index, [delivery(name, index)], durable=False)
            if index % 64 == 63:
                await asyncio.sleep(0)  # a token stream yields between deliveries

    batches_before = store.writer.batches
    began = time.perf_counter()
    await asyncio.gather(*(stream(name) for name in names))
    await store.flush()
    elapsed = time.perf_counter() - began
    return streams * events / elapsed, store.writer.batches - batches_before


async def bench_follow_lag(store: PostgresEventStore, count: int) -> list[float]:
    start_position = await _last_position(store)
    appended: dict[int, float] = {}
    lags: list[float] = []
    done = asyncio.Event()

    async def follower() -> None:
        async for _, event in store.follow(start_position):
            if event.request_id == "lag" and event.seq > 3:
                lags.append(time.perf_counter() - appended[event.seq])
                if len(lags) == count:
                    done.set()
                    return

    task = asyncio.create_task(follower())
    await store.append("lag", 0, opening("lag"))
    for index in range(count):
        event = delivery("lag", index)
        await store.append("lag", 3 + index, [event])
        appended[event.seq] = time.perf_counter()
        await asyncio.sleep(0.002)
    await asyncio.wait_for(done.wait(), 30)
    await task
    return lags


async def bench_core(url: str, count: int) -> list[float]:
    """The writer's single-event INSERT, run through SQLAlchemy Core instead of asyncpg."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(sqlalchemy_url(url))
    # "$1" -> ":p1", "$9::text" -> "CAST(:p9 AS text)": the same statement, named parameters
    named = re.sub(r"\$(\d+)::(\w+)", r"CAST(:p\1 AS \2)", INSERT_EVENT)
    insert = text(re.sub(r"\$(\d+)", r":p\1", named))
    latencies = []
    try:
        async with engine.connect() as connection:
            for event in opening("core"):
                await connection.execute(insert, params_of(event))
            await connection.commit()
            for index in range(count):
                began = time.perf_counter()
                await connection.execute(insert, params_of(delivery("core", index)))
                await connection.commit()
                latencies.append(time.perf_counter() - began)
    finally:
        await engine.dispose()
    return latencies


SYNCHRONOUS_COMMIT_LEVELS = ("local", "remote_write", "on", "remote_apply")


async def bench_synchronous_commit(url: str, count: int) -> dict[str, list[float]]:
    """The direct single-event INSERT at each ``synchronous_commit`` level, in interleaved blocks."""
    connections = {level: await asyncpg.connect(asyncpg_dsn(url)) for level in SYNCHRONOUS_COMMIT_LEVELS}
    samples: dict[str, list[float]] = {level: [] for level in SYNCHRONOUS_COMMIT_LEVELS}
    try:
        for level, connection in connections.items():
            await connection.execute(f"SET synchronous_commit TO {level}")
            for event in opening(f"sync-{level}"):
                await connection.execute(INSERT_EVENT, *dayed_row(event))
        for block in range(0, count, 100):
            for level, connection in connections.items():
                for index in range(block, min(block + 100, count)):
                    row = dayed_row(delivery(f"sync-{level}", index))
                    began = time.perf_counter()
                    await connection.execute(INSERT_EVENT, *row)
                    samples[level].append(time.perf_counter() - began)
    finally:
        for connection in connections.values():
            await connection.close()
    return samples


async def _last_position(store: PostgresEventStore) -> int:
    connection = await asyncpg.connect(asyncpg_dsn(store.url))
    try:
        return int(await connection.fetchval("SELECT coalesce(max(position), 0) FROM request_events"))
    finally:
        await connection.close()


async def run(args: argparse.Namespace, url: str) -> None:
    bench_url = await scratch_database(url, "phasegate_bench")
    await migrate.upgrade_async(bench_url)
    store = await PostgresEventStore.connect(bench_url, flush_delay=args.flush_delay)
    ms = 1000.0
    try:
        durable = await bench_durable(store, args.durable)
        print(
            f"durable append      p50 {percentile(durable.store, 0.5) * ms:.3f} ms   "
            f"p99 {percentile(durable.store, 0.99) * ms:.3f} ms   ({len(durable.store)} single-event appends)"
        )
        print(
            f"  direct INSERT     p50 {percentile(durable.direct, 0.5) * ms:.3f} ms   "
            f"p99 {percentile(durable.direct, 0.99) * ms:.3f} ms   (the same statement, no store: PostgreSQL's share)"
        )
        print(
            f"  SELECT 1          p50 {percentile(durable.round_trip, 0.5) * ms:.3f} ms   "
            f"p99 {percentile(durable.round_trip, 0.99) * ms:.3f} ms   (a round trip on this machine)"
        )
        guarded, unguarded = await bench_guard(store, args.durable)
        on, off = percentile(guarded, 0.5), percentile(unguarded, 0.5)
        print(
            f"instance guard on   p50 {on * ms:.3f} ms   p99 {percentile(guarded, 0.99) * ms:.3f} ms   "
            f"off p50 {off * ms:.3f} ms   p99 {percentile(unguarded, 0.99) * ms:.3f} ms   "
            f"(the guard adds {(on - off) * 1e6:+.0f} us at p50)"
        )
        openings = await bench_durable_openings(store, args.durable)
        print(
            f"durable lifecycle   p50 {percentile(openings, 0.5) * ms:.3f} ms   "
            f"p99 {percentile(openings, 0.99) * ms:.3f} ms   ({len(openings)} single-event appends: "
            "accepted, attempt started, first delta committed)"
        )
        rate, batches = await bench_group_commit(store, args.streams, args.events)
        total = args.streams * args.events
        print(
            f"group commit        {rate:,.0f} events/s   ({args.streams} streams x {args.events} deliveries, "
            f"{batches} transactions, {total / max(batches, 1):.0f} events each)"
        )
        lags = await bench_follow_lag(store, args.lag)
        p50, p99 = percentile(lags, 0.5) * ms, percentile(lags, 0.99) * ms
        print(
            f"follow lag          p50 {p50:.3f} ms   p99 {p99:.3f} ms   max {max(lags) * ms:.3f} ms"
            f"   ({len(lags)} events, same process)"
        )
    finally:
        await store.close()
    if args.standby:
        levels = await bench_synchronous_commit(bench_url, args.durable)
        local = percentile(levels["local"], 0.5)
        for level, samples in levels.items():
            p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
            print(
                f"synchronous_commit {level:<12} p50 {p50 * ms:.3f} ms   p99 {p99 * ms:.3f} ms"
                f"   ({(p50 - local) * 1e6:+.0f} us at p50 against local; direct INSERT)"
            )
    if args.compare_core:
        core = await bench_core(bench_url, args.durable)
        p50, p99 = percentile(core, 0.5) * ms, percentile(core, 0.99) * ms
        print(
            f"core durable append p50 {p50:.3f} ms   p99 {p99:.3f} ms"
            f"   (SQLAlchemy Core, same INSERT; mean {statistics.fmean(core) * ms:.3f} ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--durable", type=int, default=3000, help="durable single-event appends")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--events", type=int, default=4000, help="deliveries per stream")
    parser.add_argument("--lag", type=int, default=1000, help="events for the follow-lag test")
    parser.add_argument("--flush-delay", type=float, default=0.005)
    parser.add_argument("--compare-core", action="store_true")
    parser.add_argument("--standby", action="store_true", help="a primary and a synchronous standby, embedded")
    args = parser.parse_args()
    if args.standby:
        if args.url:
            parser.error("--standby starts its own pair of servers: give no --url")
        root = tempfile.mkdtemp(prefix="phasegate-bench-pair-")
        os.chmod(root, 0o755)  # ours: the servers' user must enter it
        try:
            with replica_pair(Path(root), free_port(), free_port()) as pair:
                print("embedded primary and synchronous standby (fsync on), streaming")
                asyncio.run(run(args, pair.url()))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    server = None
    url = args.url
    if not url:
        data_dir = tempfile.mkdtemp(prefix="phasegate-bench-")
        os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
        server = EmbeddedPostgres(data_dir)
        began = time.perf_counter()
        url = server.start()
        print(f"embedded PostgreSQL started in {time.perf_counter() - began:.2f} s (with initdb)")
        server.restart()
        print(f"embedded PostgreSQL restarted, start took {server.last_start_seconds:.2f} s")
    try:
        asyncio.run(run(args, url))
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
