"""PostgreSQL's CPU per forwarded token, window by window, while a fresh log grows.

    python ops/bench/log_growth.py                       # 6 windows of 5 s at 100 streams
    python ops/bench/log_growth.py --idle-s 100 --pairs 100 --statements 8

One phasegate process (``--processes 1``) in front of the fake vLLM upstream, the log on
a new embedded PostgreSQL, as ``ops/bench/peers.py`` sets them up; then back-to-back
windows at ``--streams``. Each window prints requests a second, the gateway's and
PostgreSQL's CPU per 1,000 tokens and the PostgreSQL process that used the most (the
group-commit writer's backend, as a rule). A per-token cost that grows from window to
window says that something in the log costs more as it grows: migration 0009 came from
such a run. ``--idle-s`` waits before the gateway starts and ``--pairs`` sends requests
at one stream first, as ``peers.py`` does after its other peers: autovacuum then
analyzes the first rows (a minute in), and the trigger's plans are made again on them.
``--statements N`` prints the N statements PostgreSQL spent the most time in
(pg_stat_statements, nested ones included).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.store.database import asyncpg_dsn  # noqa: E402
from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.bench import fake_vllm  # noqa: E402
from ops.bench.gateways import MODEL, Peer, start_peer, wait_serving  # noqa: E402
from ops.bench.measure import TICKS, _stat, descendants, tree_cpu_seconds  # noqa: E402
from ops.bench.peers import loaded, paired, postmaster_pid  # noqa: E402
from ops.processes import free_port, start, stop  # noqa: E402

TOP = """SELECT calls, total_exec_time, mean_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS query
           FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT $1"""


def cpu_by_process(root: int) -> dict[int, tuple[str, float]]:
    """Each process of ``root``'s tree: its title and CPU seconds so far."""
    found = {}
    for pid in descendants(root):
        try:
            fields = _stat(pid)
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue  # it ended meanwhile
        found[pid] = (title, sum(int(value) for value in fields[11:15]) / TICKS)
    return found


async def count_statements(url: str) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await connection.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    finally:
        await connection.close()


async def print_statements(url: str, count: int) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for row in await connection.fetch(TOP, count):
            calls, total, mean = row["calls"], row["total_exec_time"], row["mean_exec_time"]
            print(f"{calls:>8} calls {total:>9.1f} ms {mean:>8.3f} ms each  {row['query']}")
    finally:
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0, help="each window")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=0.0, help="wait this long before the gateway starts")
    parser.add_argument("--pairs", type=int, default=0, help="requests at one stream before the windows")
    parser.add_argument("--statements", type=int, default=0, help="print the N costliest statements at the end")
    options = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-log-growth-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    settings = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}
    database = EmbeddedPostgres(workdir / "pg", settings=settings if options.statements else None)
    upstream_port = free_port()
    upstream = start(fake_vllm.command(upstream_port, MODEL), log=workdir / "upstream.log")
    gateway = None
    try:
        upgrade(database.start())
        if options.statements:
            asyncio.run(count_statements(database.url))
        wait_serving(Peer("fake vLLM", upstream_port, upstream, ""))
        time.sleep(options.idle_s)
        gateway = start_peer("phasegate", upstream_port, workdir, argparse.Namespace(processes=1), database.url)
        wait_serving(gateway)
        if options.pairs:
            asyncio.run(paired(upstream_port, gateway.port, options.pairs, options.tokens))
        postgres = postmaster_pid(database)
        print(f"{options.streams} streams, {options.tokens} tokens a request, windows of {options.seconds:g} s")
        for window in range(options.windows):
            pg_before, gateway_before = cpu_by_process(postgres), tree_cpu_seconds(gateway.process.pid)
            sample, elapsed = asyncio.run(loaded(gateway.port, options.streams, options.seconds, options.tokens))
            pg_after, gateway_after = cpu_by_process(postgres), tree_cpu_seconds(gateway.process.pid)
            tokens = max(sample.tokens, 1)
            used = {pid: cpu - pg_before.get(pid, ("", 0.0))[1] for pid, (_, cpu) in pg_after.items()}
            busiest = max(used, key=lambda pid: used[pid])
            print(
                f"window {window + 1}: {sample.requests / elapsed:.0f} req/s,"
                f" gateway {(gateway_after - gateway_before) / tokens * 1000:.3f},"
                f" PostgreSQL {sum(used.values()) / tokens * 1000:.3f} CPU s per 1k tokens"
                f" (busiest: {used[busiest] / elapsed:.2f} of a core, {pg_after[busiest][0][:40]!r}),"
                f" {sample.failures} failed",
                flush=True,
            )
        if options.statements:
            asyncio.run(print_statements(database.url, options.statements))
    finally:
        if gateway is not None:
            stop(gateway.process)
        stop(upstream)
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
