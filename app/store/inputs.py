"""Recorded request inputs (for replaying an incident), written in batches.

How this works: every request records its input off the path to its first token, so
the inserts are batched: one statement (on a pooled connection's raw asyncpg
connection) for all that arrive within the flush delay, and a caller resumes once
its input is written. One batch is written at a time: the next one is written only
after the batch ahead of it, and grows meanwhile. Before, a batch was written every
flush delay whatever the one ahead did, so under a burst (2,000 streams opening) the
input batches waiting for the pool took a pooled connection each (every 5 ms), ahead
of the reads and the tool ledger that share it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import date
from typing import Any

import asyncpg

from app.contract import json_depth as deep_json
from app.store.insert import ACCEPTED_ON, LogSchema

# Every input's day known (the requests accepted here: the common case). No look-up: a
# statement that may look the day up plans (and locks) every day's partition of
# request_events, whether it looks or not, so it costs more the more days are kept
# (ops/bench/studies/inputs_days.py).
INSERT = """
    INSERT INTO request_inputs (request_id, body, model_revision, seed, accepted_on)
    SELECT * FROM unnest($1::text[], $2::text[]::json[], $3::text[], $4::bigint[], $5::date[])
    ON CONFLICT (request_id, accepted_on) DO NOTHING
"""
# Some input's day not known here (a request past the store's remembered days): the day
# of its RequestAccepted in the log, as app/store/insert.py finds it.
INSERT_LOOKUP = f"""
    INSERT INTO request_inputs (request_id, body, model_revision, seed, accepted_on)
    SELECT request_id, body, model_revision, seed, {ACCEPTED_ON.format(day="i.accepted_on", request_id="i.request_id")}
      FROM unnest($1::text[], $2::text[]::json[], $3::text[], $4::bigint[], $5::date[])
           AS i(request_id, body, model_revision, seed, accepted_on)
    ON CONFLICT (request_id, accepted_on) DO NOTHING
"""
PREVIOUS_INSERT = """
    INSERT INTO request_inputs (request_id, body, model_revision, seed)
    SELECT * FROM unnest($1::text[], $2::text[]::json[], $3::text[], $4::bigint[])
    ON CONFLICT (request_id) DO NOTHING
"""


class InputBatches:
    """The inputs recorded and not yet written, and the one batch being written."""

    def __init__(
        self,
        connection: Callable[[], AbstractAsyncContextManager[Any]],
        log: LogSchema,
        accept_days: dict[str, date],
        flush_delay: float,
    ) -> None:
        self._connection = connection  # a pooled connection in a transaction that commits
        self._log = log
        self._accept_days = accept_days  # request -> partition key, of requests accepted here
        self._flush_delay = flush_delay
        self._pending: list[tuple[str, str, str | None, int | None]] = []
        self._next: asyncio.Task[None] | None = None  # writes the pending inputs
        self._writing: asyncio.Task[None] | None = None  # the batch ahead of them

    async def record(self, request_id: str, kept: Any, model_revision: str | None, seed: int | None) -> None:
        """Write ``kept`` with the next batch; return once it is written."""
        self._pending.append(
            (request_id, deep_json.dumps(kept, separators=(", ", ": "), ensure_ascii=True), model_revision, seed)
        )
        if self._next is None:
            self._next = asyncio.get_running_loop().create_task(self._write_next(self._writing))
        await asyncio.shield(self._next)

    async def written(self) -> None:
        """Until every input recorded so far was written (or failed to be)."""
        waiting = [task for task in (self._next, self._writing) if task is not None]
        if waiting:
            await asyncio.wait(waiting)

    async def _write_next(self, ahead: asyncio.Task[None] | None) -> None:
        try:
            await asyncio.sleep(self._flush_delay)
            if ahead is not None:
                await asyncio.wait([ahead])  # its failure is its callers'
        finally:
            batch, self._pending, self._next = self._pending, [], None
            self._writing = asyncio.current_task()
        try:
            await self._write(batch)
        finally:
            if self._writing is asyncio.current_task():
                self._writing = None

    async def _write(self, batch: list[tuple[str, str, str | None, int | None]]) -> None:
        columns = [list(column) for column in zip(*batch, strict=True)]
        days = [self._accept_days.get(request_id) for request_id in columns[0]]
        insert = INSERT if None not in days else INSERT_LOOKUP
        for last in (False, True):
            try:
                async with self._connection() as connection:
                    raw = (await connection.get_raw_connection()).driver_connection
                    if not self._log.partitioned:  # at 0006 still (a rolling upgrade), or converted since
                        await self._log.learn(raw)
                    if self._log.partitioned:
                        await raw.execute(insert, *columns, days)
                    else:
                        await raw.execute(PREVIOUS_INSERT, *columns)
                return
            except asyncpg.InvalidColumnReferenceError:  # the conversion's switch came between: again
                if last:
                    raise
