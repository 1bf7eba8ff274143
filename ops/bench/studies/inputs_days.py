"""What writing a batch of recorded inputs costs by the days the log keeps, with the day
named and with the statement that may look it up (app/store/inputs.py).

    python ops/bench/studies/inputs_days.py [--batches 300] [--size 8] [--days 4 367] [--rounds 4]

The statement that may look an input's day up in the log (``INSERT_LOOKUP``: for a
request this store did not accept) names ``request_events`` in a subquery. Planning it,
or running its cached plan, opens and locks every day's partition of the log, whether a
row looks or not; so the writer takes it only when some input's day is not known, and
``INSERT`` otherwise.

One embedded PostgreSQL (fsync off), one migrated log per ``--days`` (made by
``days_kept.prepared_log``); then ``--rounds`` rounds, each writing ``--batches``
batches of ``--size`` inputs of the requests' day by both statements, in every log,
the order of the two swapped each round; the first round warms the plans and is not
counted. Prints the medians (p90) in microseconds a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: ops/ is not installed

from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from app.store.inputs import INSERT, INSERT_LOOKUP
from ops.bench.days_kept import DAY, FAST, prepared_log
from ops.bench.measure import percentile

STATEMENTS = {"day named": INSERT, "may look up": INSERT_LOOKUP}
BODY = json.dumps({"model": "tiny-llm", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 32})


async def run(url: str, days: list[int], batches: int, size: int, rounds: int) -> None:
    logs = {kept: await asyncpg.connect(asyncpg_dsn(await prepared_log(url, kept))) for kept in days}
    numbers = itertools.count()
    samples: dict[tuple[int, str], list[float]] = {(kept, name): [] for kept in days for name in STATEMENTS}
    try:
        for round_number in range(rounds):
            order = list(STATEMENTS.items())[:: 1 if round_number % 2 else -1]
            for kept, conn in logs.items():
                for name, statement in order:
                    for _ in range(batches):
                        ids = [f"input-{next(numbers)}" for _ in range(size)]
                        began = time.perf_counter()
                        await conn.execute(statement, ids, [BODY] * size, [None] * size, [3] * size, [DAY] * size)
                        if round_number:
                            samples[kept, name].append(time.perf_counter() - began)
    finally:
        for conn in logs.values():
            await conn.close()
    print(f"\n{batches} batches of {size} inputs x {rounds - 1} rounds; microseconds a batch, median (p90)")
    for (kept, name), values in samples.items():
        p50, p90 = percentile(values, 0.5), percentile(values, 0.9)
        print(f"  {kept:>4} days  {name:<12} {p50 * 1e6:7.0f} ({p90 * 1e6:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--size", type=int, default=8, help="inputs a batch")
    parser.add_argument("--days", type=int, nargs="+", default=[4, 367])
    parser.add_argument("--rounds", type=int, default=4, help="the first warms the plans")
    args = parser.parse_args()
    data_dir = tempfile.mkdtemp(prefix="phasegate-bench-")
    os.chmod(data_dir, 0o755)  # ours: the server's user must enter it
    server = EmbeddedPostgres(data_dir, settings=FAST)
    try:
        asyncio.run(run(server.start(), sorted(args.days), args.batches, args.size, args.rounds))
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
