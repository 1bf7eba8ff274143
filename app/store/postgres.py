"""The event store on PostgreSQL.

Appends go through one :class:`GroupCommitWriter` (raw asyncpg, its own connection);
everything else (reads, the follower's polls, the tool ledger, recorded inputs) is
SQLAlchemy Core on a pooled engine that pings connections before use, so after a
PostgreSQL restart the first query reconnects by itself. Lost connections surface
as :class:`StoreUnavailable`, logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from datetime import date
from typing import Any

import asyncpg
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.store import partitions, schema, tool_ledger
from app.store.base import EventStore, RequestInput, ToolExecution, check_append
from app.store.codec import EventRow, from_row, to_row
from app.store.content import erase_one_request, kept_input
from app.store.database import asyncpg_dsn, sqlalchemy_url
from app.store.errors import StoreClosed, StoreError, StoreUnavailable, is_unavailable, refused_as_read_only
from app.store.follow import FollowCursor
from app.store.inputs import InputBatches
from app.store.writer import GroupCommitWriter
from statemachine.events import Event

logger = logging.getLogger("phasegate.store")

# Accept days remembered, of the requests most recently accepted here: one for each
# request still live, with room to spare (each entry stays resident while kept: the
# bound keeps the map well below what a gateway's memory notices, docs/performance.md).
# A forgotten one costs its appends a lookup inside their INSERT, not a round trip.
# Kept in an OrderedDict, whose oldest entry is dropped in O(1): a plain dict's
# ``next(iter(...))`` walks past every entry deleted before it, a cost a request that
# grows with the map (figures: docs/performance.md).
_ACCEPT_DAYS_KEPT = 20_000


# The input's partition is its request's accept day: the store's, else the request's
# row's (the input may be written first: then today, its RequestAccepted's day).
class PostgresEventStore(EventStore):
    """The log in PostgreSQL; open it with :meth:`connect`, end it with :meth:`close`.

    ``flush_delay``: the longest a non-durable append waits for company before its
    batch is written (seconds). ``max_batch_events``: events per transaction at most.
    ``max_queued_events``: accepted but unwritten events at most; appends wait beyond.
    ``poll_interval``: how often followers look for commits made by other processes
    (this process's own commits wake them at once). ``pool_size``: connections for
    reads, follows and the tool ledger (the writer has its own). ``content_policy``:
    what recorded inputs keep (:func:`app.store.content.kept_input`).
    """

    def __init__(
        self,
        url: str,
        *,
        flush_delay: float = 0.005,
        max_batch_events: int = 500,
        max_queued_events: int = 20_000,
        poll_interval: float = 0.05,
        pool_size: int = 5,
        content_policy: str = "full",
    ) -> None:
        self.url = sqlalchemy_url(url)
        self.content_policy = content_policy
        self.poll_interval = poll_interval
        self._engine: AsyncEngine = create_async_engine(
            self.url, pool_size=pool_size, max_overflow=2 * pool_size, pool_pre_ping=True
        )
        self.writer = GroupCommitWriter(
            asyncpg_dsn(url),
            flush_delay=flush_delay,
            max_batch_events=max_batch_events,
            max_queued_events=max_queued_events,
            on_commit=self._committed,
        )
        self._commit_signal: asyncio.Future[None] | None = None
        self._closed = False
        self._outage = False
        self._accept_days: OrderedDict[str, date] = OrderedDict()  # request -> partition key, accepted here
        self._inputs = InputBatches(
            lambda: self._connection(commit=True), self.writer.schema, self._accept_days, flush_delay
        )

    @classmethod
    async def connect(cls, url: str, **options: Any) -> PostgresEventStore:
        """A started store; ``StoreUnavailable`` if PostgreSQL cannot be reached."""
        store = cls(url, **options)
        try:
            await store.writer.start()
        except BaseException:
            await store._engine.dispose()
            raise
        return store

    # --- the log -------------------------------------------------------------------------

    async def append(
        self, request_id: str, expected_version: int, events: Sequence[Event], *, durable: bool = True
    ) -> int:
        check_append(request_id, expected_version, events)
        await self.writer.submit(request_id, expected_version, self._rows(request_id, events), durable)
        return expected_version + len(events)

    async def append_grouped(self, request_id: str, expected_version: int, events: Sequence[Event]) -> Awaitable[None]:
        check_append(request_id, expected_version, events)
        rows = self._rows(request_id, events)
        committed = await self.writer.enqueue(request_id, expected_version, rows, durable=False, track=True)
        assert committed is not None
        return committed

    def append_grouped_now(
        self, request_id: str, expected_version: int, events: Sequence[Event]
    ) -> asyncio.Future[None] | None:
        check_append(request_id, expected_version, events)
        return self.writer.enqueue_now(request_id, expected_version, self._rows(request_id, events))

    def _rows(self, request_id: str, events: Sequence[Event]) -> list[EventRow]:
        """The rows of ``events``, each with its request's accept day (the partition key)
        when this store accepted the request; else the INSERT looks the day up."""
        day = self._accept_days.get(request_id)
        if day is None:
            first = to_row(events[0])
            if first.accepted_on is None:  # not a RequestAccepted: the INSERT finds the day
                return [first, *(to_row(event) for event in events[1:])]
            day = first.accepted_on
            if not self.writer.schema.partitioned:  # 0006 records no day: remember none
                return [first, *(to_row(event, day) for event in events[1:])]
            if len(self._accept_days) >= _ACCEPT_DAYS_KEPT:
                self._accept_days.popitem(last=False)  # the oldest accepted
            self._accept_days[request_id] = day
            return [first, *(to_row(event, day) for event in events[1:])]
        return [to_row(event, day) for event in events]

    async def maintain_partitions(self, **options: Any) -> partitions.Maintenance:
        """Run :func:`app.store.partitions.maintain` on a connection of its own (a
        concurrent detach cannot run inside a transaction, nor on the pool's)."""
        connection = await asyncpg.connect(asyncpg_dsn(self.url), timeout=10)
        try:
            return await partitions.maintain(connection, **options)
        finally:
            await connection.close()

    async def read(self, request_id: str) -> list[Event]:
        events = schema.request_events.c
        query = (
            select(
                events.request_id,
                events.version,
                events.type,
                events.schema_version,
                events.attempt,
                events.lease_epoch,
                events.occurred_at,
                events.body,
            )
            .where(events.request_id == request_id)
            .order_by(events.version)
        )
        async with self._connection() as connection:
            rows = (await connection.execute(query)).all()
        return [from_row(*row) for row in rows]

    async def follow(
        self, after_position: int = 0, *, batch_size: int = 1000
    ) -> AsyncGenerator[tuple[int, Event], None]:
        """See :meth:`EventStore.follow` and :mod:`app.store.follow`; ends when the store closes.

        While PostgreSQL is unavailable it waits and retries.
        """
        async with self._connection() as connection:
            cursor = await FollowCursor.after(connection, after_position)
        while not self._closed:
            signal = self._next_commit()
            try:
                async with self._connection() as connection:
                    batch = await cursor.next_batch(connection, batch_size)
            except StoreClosed:
                return
            except StoreUnavailable:
                await asyncio.sleep(self.poll_interval * 4)
                continue
            for item in batch:
                yield item
            if len(batch) < batch_size:
                await asyncio.wait([signal], timeout=self.poll_interval)

    async def unfinished_requests(self, *, gateway: str | None = None) -> list[str]:
        requests = schema.requests.c
        query = select(requests.request_id).where(requests.outcome.is_(None)).order_by(requests.accepted_at)
        if gateway is not None:
            query = query.where(requests.gateway == gateway)
        async with self._connection() as connection:
            return list((await connection.scalars(query)).all())

    @property
    def accepting(self) -> bool:
        return not self._closed and self.writer.available

    async def ping(self) -> None:
        async with self._connection() as connection:
            read_only = await connection.scalar(text("SELECT pg_is_in_recovery()"))
        if read_only:
            raise StoreUnavailable("PostgreSQL is in recovery: the log is read-only")

    async def flush(self) -> None:
        await self.writer.flush()

    async def close(self) -> None:
        if self._closed:
            return
        await self._inputs.written()
        self._closed = True
        self._committed()  # wake followers so that they end
        try:
            await self.writer.close()
        finally:
            await self._engine.dispose()

    # --- the tool ledger (its statements: app/store/tool_ledger.py) ----------------------

    async def claim_tool_execution(
        self,
        idempotency_key: str,
        request_id: str,
        attempt: int,
        tool_call_id: str,
        name: str,
        arguments: str,
    ) -> bool:
        async with self._connection(commit=True) as connection:
            return await tool_ledger.claim(
                connection, idempotency_key, request_id, attempt, tool_call_id, name, arguments
            )

    async def record_tool_result(self, idempotency_key: str, *, result: Any = None, error: str | None = None) -> None:
        async with self._connection(commit=True) as connection:
            await tool_ledger.finish(connection, idempotency_key, result=result, error=error)

    async def tool_execution(self, idempotency_key: str) -> ToolExecution | None:
        async with self._connection() as connection:
            return await tool_ledger.execution(connection, idempotency_key)

    # --- recorded inputs -----------------------------------------------------------------

    async def record_input(
        self,
        request_id: str,
        body: dict[str, Any],
        *,
        model_revision: str | None = None,
        seed: int | None = None,
        content_policy: str | None = None,
    ) -> None:
        if self._closed:
            raise StoreClosed("the event store is closed")
        kept = kept_input(body, content_policy or self.content_policy)
        if kept is not None:
            await self._inputs.record(request_id, kept, model_revision, seed)

    async def erase_request(self, tenant: str, request_id: str) -> int:
        await self._inputs.written()  # an input still on its way would land after the erase
        async with self._connection(commit=True) as connection:
            return (await erase_one_request(connection, tenant, request_id)).requests

    async def read_input(self, request_id: str) -> RequestInput | None:
        await self._inputs.written()
        inputs = schema.request_inputs.c
        query = select(inputs.request_id, inputs.body, inputs.model_revision, inputs.seed).where(
            inputs.request_id == request_id
        )
        async with self._connection() as connection:
            row = (await connection.execute(query)).first()
        return None if row is None else RequestInput(*row)

    def writing(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A pooled connection in a transaction that commits on exit, for the few
        writes beside the log (:mod:`app.store.instances`)."""
        return self._connection(commit=True)

    def reading(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A pooled connection for read-side queries (:mod:`app.store.queries`); a lost
        PostgreSQL surfaces as :class:`StoreUnavailable`, as for every other query."""
        return self._connection()

    # --- internals -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connection(self, *, commit: bool = False) -> AsyncIterator[Any]:
        if self._closed:
            raise StoreClosed("the event store is closed")
        try:
            async with self._engine.begin() if commit else self._engine.connect() as connection:
                yield connection
        except StoreError:
            raise
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            if refused_as_read_only(exc):  # the pool's connections lead to a server that is no primary
                await self._engine.dispose()
            if not self._outage:
                self._outage = True
                logger.error("PostgreSQL unavailable: %s; queries fail until it returns", _first_line(exc))
            raise StoreUnavailable(f"PostgreSQL is unreachable: {_first_line(exc)}") from exc
        if self._outage:
            self._outage = False
            logger.warning("PostgreSQL available again")

    def _next_commit(self) -> asyncio.Future[None]:
        if self._commit_signal is None:
            self._commit_signal = asyncio.get_running_loop().create_future()
        return self._commit_signal

    def _committed(self) -> None:
        signal, self._commit_signal = self._commit_signal, None
        if signal is not None and not signal.done():
            signal.set_result(None)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
