"""What a delivery batch's age deadline costs (app/driver/batch_ages.py): one timer a
gateway for every open batch, against a ``loop.call_later`` a batch.

    python ops/bench/studies/batch_ages.py [--batches 200000] [--rounds 3]

Each way, ``--batches`` deadlines of 20 ms (the default ``delivery_batch_ms``) are set
as a gateway sets them, a hundred between two turns of the event loop, and all of them
come due (the callback does nothing: most batches closed before their deadline). It
prints the CPU time a batch of each, round by round, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from app.driver.batch_ages import BatchAges

AGE_S = 0.02


def closed_already(batch: int) -> None:
    """The callback of a batch that closed before its deadline."""


async def deadlines(batches: int, watch: Callable[[int], None]) -> float:
    """CPU seconds to set ``batches`` deadlines with ``watch`` and see them all come due."""
    started = time.process_time()
    for n in range(batches):
        watch(n)
        if n % 100 == 0:
            await asyncio.sleep(0)
    await asyncio.sleep(AGE_S * 2)  # the last come due (idle: no CPU)
    return time.process_time() - started


async def one_timer_a_gateway(batches: int) -> float:
    ages = BatchAges()
    return await deadlines(batches, lambda n: ages.watch(closed_already, n, AGE_S))


async def one_timer_a_batch(batches: int) -> float:
    loop = asyncio.get_running_loop()

    def watch(n: int) -> None:
        loop.call_later(AGE_S, closed_already, n)

    return await deadlines(batches, watch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    for round_ in range(options.rounds):
        gateway = asyncio.run(one_timer_a_gateway(options.batches)) / options.batches * 1e6
        each = asyncio.run(one_timer_a_batch(options.batches)) / options.batches * 1e6
        print(f"round {round_ + 1}: one timer a gateway {gateway:.2f} µs a batch, a call_later a batch {each:.2f} µs")


if __name__ == "__main__":
    main()
